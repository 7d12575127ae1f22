// The int8 ways' shared part (gguf_vnni_int8.h, gguf_amx_int8.h, gguf_amx_q8k.h, and the
// portable way in gguf_matmul.cpp): x quantized per block as llama.cpp's Q8_0 (32) or Q8_K (256),
// with each group of 16's scale and its scaled sum, and the portable dot products.
// Self-contained; in namespace gguf.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "gguf_common.h"

namespace gguf {

// ---------------------------------------------------------------------------------------------
// int8 activations.

#ifdef GGUF_AVX512
// One row of quantize_activations, 16 values a vector: max |x| per block, then each value times
// the block's 1 / d rounded to nearest even (as std::nearbyint in the default rounding mode).
inline void quantize_row_avx512(const float* x, int64_t in_features, int block, int8_t* q, float* d16, float* s16) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t k0 = 0; k0 < in_features; k0 += block) {
    __m512 amax = _mm512_setzero_ps();
    for (int h = 0; h < block / 16; ++h) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, _mm512_loadu_ps(x + k0 + 16 * h)));
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    for (int h = 0; h < block / 16; ++h) {
      const __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k0 + 16 * h), inv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16 * h), _mm512_cvtepi32_epi8(v));
      d16[k0 / 16 + h] = d;
      s16[k0 / 16 + h] = d * static_cast<float>(_mm512_reduce_add_epi32(v));
    }
  }
}
#endif

// Row r of x quantized per block of `block` (32, or 256 for the K-quants: llama.cpp's Q8_K, so that
// a super-block's sub-block scales apply to integer sums, gguf_amx_q8k.h) into qx (stride `padded`
// bytes, zero past in_features), with per group of 16 its block's scale dx16 and dx times the sum
// of the group's int8 values xs16 (stride padded / 16, zero past in_features / 16). in_features:
// a multiple of `block`.
void quantize_activations(const float* x, int64_t num_rows, int64_t in_features, int64_t padded, int8_t* qx,
                          float* dx16, float* xs16, int block = 32) {
  const int64_t groups = padded / 16;
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* xr = x + r * in_features;
    int8_t* q = qx + r * padded;
    float* d16 = dx16 + r * groups;
    float* s16 = xs16 + r * groups;
#ifdef GGUF_AVX512
    if (in_features % 32 == 0) {  // 16 at a time; the same numbers as the loop below
      quantize_row_avx512(xr, in_features, block, q, d16, s16);
      std::memset(q + in_features, 0, padded - in_features);
      for (int64_t g = in_features / 16; g < groups; ++g) d16[g] = s16[g] = 0.0f;
      continue;
    }
#endif
    for (int64_t k0 = 0; k0 < in_features; k0 += block) {
      float amax = 0.0f;
      for (int j = 0; j < block; ++j) amax = std::fmax(amax, std::fabs(xr[k0 + j]));
      const float d = amax / 127.0f;
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;
      for (int h = 0; h < block / 16; ++h) {
        int sum = 0;
        for (int j = 16 * h; j < 16 * h + 16; ++j) {
          const int v = static_cast<int>(std::nearbyint(xr[k0 + j] * inv));
          q[k0 + j] = static_cast<int8_t>(v);
          sum += v;
        }
        d16[k0 / 16 + h] = d;
        s16[k0 / 16 + h] = d * static_cast<float>(sum);
      }
    }
    std::memset(q + in_features, 0, padded - in_features);
    for (int64_t g = in_features / 16; g < groups; ++g) d16[g] = s16[g] = 0.0f;
  }
}

// The types the VNNI and AMX ways (gguf_vnni_int8.h, gguf_amx*.h) decode; the others (Q2_K, Q3_K,
// IQ4_NL, IQ4_XS) take the AVX2 ways on AVX-512 machines too.
inline bool vnni_type(int qtype) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
    default: return false;
  }
}

// The block x is quantized in for a product with W of type qtype: 256 for the K-quants (as
// llama.cpp's Q8_K), 32 for the legacy types (Q8_0's, Q8_1's).
inline int activation_block(int qtype) { return type_size(qtype).weights == 256 ? 256 : 32; }

// Activations and a row of W as the int8 dot products read them.
struct Int8Rows {
  const int8_t* qx;
  const float* dx16;
  const float* xs16;
  int64_t padded;  // bytes per row of qx: in_features rounded up to 64
};

float offset_term(const float* c16, const float* xs16, int64_t groups) {
  float sum = 0.0f;
  for (int64_t g = 0; g < groups; ++g) sum += c16[g] * xs16[g];
  return sum;
}

void int8_dot_portable(float* y, int64_t y_stride, const uint8_t* u, const float* s16, const float* c16, bool is_signed,
                       const Int8Rows& a, int64_t r0, int rows) {
  const int64_t groups = a.padded / 16;
  for (int r = 0; r < rows; ++r) {
    const int8_t* q = a.qx + (r0 + r) * a.padded;
    const float* d16 = a.dx16 + (r0 + r) * groups;
    float sum = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int dot = 0;
      for (int j = 0; j < 16; ++j) {
        const int w = is_signed ? static_cast<int8_t>(u[16 * g + j]) : u[16 * g + j];
        dot += w * q[16 * g + j];
      }
      sum += s16[g] * d16[g] * static_cast<float>(dot);
    }
    y[r * y_stride] = sum - offset_term(c16, a.xs16 + (r0 + r) * groups, groups);
  }
}

}  // namespace gguf
