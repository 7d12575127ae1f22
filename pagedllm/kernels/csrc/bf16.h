// bfloat16 stored as uint16_t: conversions to and from float32 (the kernels compute in float32
// and round once per value stored, to nearest even, as torch does).
#pragma once

#include <cstdint>
#include <cstring>

namespace pagedllm_bf16 {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even
  *out = static_cast<uint16_t>(bits >> 16);
}
// x rounded to bfloat16 and back: the value a bfloat16 tensor holds after an operation.
inline float round_bf16(float x) {
  uint16_t b;
  from_float(x, &b);
  return to_float(b);
}

}  // namespace pagedllm_bf16
