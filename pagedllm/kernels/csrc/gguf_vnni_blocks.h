// The AVX-512 VNNI ways' block decoders (gguf_vnni_int8.h, gguf_vnni_wrows.h, and the AMX ways):
// a block's weights as the unsigned bytes VPDPBUSD and VPMADDUBSW take, and the K-quants'
// sub-block scales. Self-contained; in namespace gguf.
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "gguf_common.h"

namespace gguf {

#ifdef GGUF_AVX512
// Q4_K's and Q5_K's eight 6-bit sub-block scales and minimums of the super-block at p, each as the
// low 8 bytes of a vector (ggml's utmp unpacking, kept in registers: through 8-byte arrays on the
// stack, two 4-byte stores then an 8-byte load, a 1-row Q4_K product 1024 wide ran 5-20% slower).
struct K4Scales {
  __m128i scales, mins;
};
inline K4Scales k4_scales_mins(const uint8_t* p) {
  uint32_t q0, q1, q2;
  std::memcpy(&q0, p + 4, 4);
  std::memcpy(&q1, p + 8, 4);
  std::memcpy(&q2, p + 12, 4);
  const uint64_t s = (q0 & 0x3F3F3F3Fu) | uint64_t{(q2 & 0x0F0F0F0Fu) | (((q0 >> 6) & 0x03030303u) << 4)} << 32;
  const uint64_t m = (q1 & 0x3F3F3F3Fu) | uint64_t{((q2 >> 4) & 0x0F0F0F0Fu) | (((q1 >> 6) & 0x03030303u) << 4)} << 32;
  return {_mm_cvtsi64_si128(static_cast<long long>(s)), _mm_cvtsi64_si128(static_cast<long long>(m))};
}

inline __m256 k4_bytes_as_floats(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

// Weights 64 c to 64 c + 63 of the Q4_K or Q5_K super-block at p as 64 unsigned bytes in natural
// order: sub-block 2 c, then 2 c + 1.
template <int T>
inline __m512i k4_chunk(const uint8_t* p, int c) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (T == kQ4_K ? 16 : 48) + 32 * c));
  __m512i u = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1),
                               _mm512_set1_epi8(0x0F));
  if constexpr (T == kQ5_K) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const uint64_t lo = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * c))));
    const uint64_t hi = _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1))));
    u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(lo | hi << 32, _mm512_set1_epi8(16)));
  }
  return u;
}

// Each of 32 int16 lanes' eighth: the sub-block of 16 weights whose products the lane holds, in a chunk of 64.
alignas(64) constexpr int16_t kLaneEighths[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                  2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};

// Weights 64 c to 64 c + 63 of the Q6_K super-block at p as 64 unsigned bytes (0..63) in natural
// order: sub-blocks 4 c to 4 c + 3.
inline __m512i k6_chunk(const uint8_t* p, int c) {
  const int h = c / 2;
  const __m512i low4 = _mm512_set1_epi8(0x0F), three = _mm512_set1_epi8(3);
  const __m512i ql = _mm512_loadu_si512(p + 64 * h);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
  const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
  if (c % 2 == 0) return _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(_mm512_and_si512(qh2, three), 4));
  return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                         _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh2, 4), three), 4));
}

// A legacy type's unsigned values: Q8_0's int8 + 128, Q4_0's 4 bits, Q5_0's 5 (the value is
// d (u - offset)); Q4_1's and Q5_1's as they are (d u + m).
template <int T>
constexpr int legacy_offset = T == kQ8_0 ? 128 : T == kQ5_0 ? 16 : T == kQ4_0 ? 8 : 0;

// The values of a pair of legacy blocks at p0, p1 as 64 unsigned bytes (VPDPBUSD's unsigned
// operand), in the order of their weights.
template <int T>
inline __m512i legacy_pair_values(const uint8_t* p0, const uint8_t* p1) {
  constexpr bool has_min = T == kQ4_1 || T == kQ5_1, five = T == kQ5_0 || T == kQ5_1;
  constexpr int qs_at = T == kQ8_0 ? 2 : (has_min ? 4 : 2) + (five ? 4 : 0), qh_at = has_min ? 4 : 2;
  if constexpr (T == kQ8_0) {
    const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + qs_at))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + qs_at)), 1);
    return _mm512_xor_si512(u, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m512i halves = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);  // [lo0 hi0 lo1 hi1] from [lo0 lo1], [hi0 hi1]
    const __m256i both = _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + qs_at)),
                                          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + qs_at)));
    const __m512i lo = _mm512_castsi256_si512(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)));
    const __m512i hi = _mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi16(both, 4), _mm256_set1_epi8(0x0F)));
    __m512i u = _mm512_permutex2var_epi64(lo, halves, hi);
    if constexpr (five) {
      uint32_t h0, h1;
      std::memcpy(&h0, p0 + qh_at, 4);
      std::memcpy(&h1, p1 + qh_at, 4);
      const __mmask64 bits = static_cast<uint64_t>(h0) | static_cast<uint64_t>(h1) << 32;
      u = _mm512_or_si512(u, _mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(16)));
    }
    return u;
  }
}

#endif

}  // namespace gguf
