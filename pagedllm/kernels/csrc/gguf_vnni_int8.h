// The int8 way on AVX-512 VNNI (path 'avx512', and 'amx' below its tiles' sizes), over the
// activations gguf_int8.h quantizes (Int8Rows). Self-contained; in namespace gguf. The legacy
// types scale each 64 products by floats (int8_fused_rows); the K-quants, with x quantized per
// 256, apply their sub-block scales to integer sums (q8k_fused_rows, llama.cpp's Q8_K way); one row
// of x (two of a legacy type) takes four rows of W at a time (gguf_vnni_wrows.h). int8_chunks_avx512 is also the
// AMX ways' decoder.

#pragma once

#include <cstdint>
#include <cstring>

#include <omp.h>

#include "gguf_blocks.h"
#include "gguf_common.h"
#include "gguf_float.h"
#include "gguf_int8.h"
#include "gguf_vnni_blocks.h"
#include "gguf_vnni_wrows.h"

namespace gguf {

#ifdef GGUF_AVX512
// The int8 way on AVX-512 VNNI, a few rows of x at a time and no buffer for W: each 64 weights of
// a block (a pair of legacy blocks) are decoded in registers into their unsigned values
// (Q8_0's int8 + 128, so VPDPBUSD's unsigned operand holds them; its constant c is 128 d) and a
// vector of 16 scales, one per 4 weights (per lane of VPDPBUSD's result), and every row of x
// takes them: one VPDPBUSD, one conversion, one multiply by the activations' lane scales and one
// FMA per 64 products. The constants c (per 16 weights) are kept per row of W and dotted with
// the activations' sums at the end. sink(k, u, s): k the first weight's index in the row.
template <int T, class Sink>
inline void int8_chunks_avx512(const uint8_t* row, int64_t num_blocks, float* c16, Sink&& sink) {
  const TypeSize t = type_size(T);
  if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1 || T == kQ8_0) {
    constexpr bool has_min = T == kQ4_1 || T == kQ5_1;
    constexpr float offset = static_cast<float>(legacy_offset<T>);
    // Eight blocks at a time: their float16 scales (and minimums) converted in one instruction.
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    int64_t b = 0;
    for (; b + 8 <= num_blocks; b += 8) {
      const uint8_t* p = row + b * t.bytes;
      prefetch_ahead(p, 8 * t.bytes);
      const __m128i dh = halves_of_8_blocks(p, t.bytes, 0);
      const __m128i mh = has_min ? halves_of_8_blocks(p, t.bytes, 2) : _mm_setzero_si128();
      const __m256 d8 = _mm256_cvtph_ps(dh);
      const __m256 c8 = has_min ? _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(mh)) : _mm256_mul_ps(d8, _mm256_set1_ps(offset));
      _mm512_storeu_ps(c16 + 2 * b, _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(c8)));
      const __m512 d512 = _mm512_castps256_ps512(d8);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i which = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * j)), _mm256_set1_epi32(2 * j + 1), 1);
        sink((b + 2 * j) * 32, legacy_pair_values<T>(p + 2 * j * t.bytes, p + (2 * j + 1) * t.bytes), _mm512_permutexvar_ps(which, d512));
      }
    }
    for (; b < num_blocks; b += 2) {
      const bool pair = b + 1 < num_blocks;
      const uint8_t* p0 = row + b * t.bytes;
      const uint8_t* p1 = pair ? p0 + t.bytes : p0;  // a lone last block: its values meet zeros of x
      const float d0 = half_to_float(p0), d1 = pair ? half_to_float(p1) : 0.0f;
      const float c0 = has_min ? -half_to_float(p0 + 2) : offset * d0;
      c16[2 * b] = c16[2 * b + 1] = c0;
      if (pair) c16[2 * b + 2] = c16[2 * b + 3] = has_min ? -half_to_float(p1 + 2) : offset * d1;
      sink(b * 32, legacy_pair_values<T>(p0, p1), _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1));
    }
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* p = row + b * t.bytes;
      prefetch_ahead(p, t.bytes);
      const K4Scales k = k4_scales_mins(p);
      const __m256 s8 = _mm256_mul_ps(_mm256_set1_ps(half_to_float(p)), k4_bytes_as_floats(k.scales));
      const __m256 m8 = _mm256_mul_ps(_mm256_set1_ps(half_to_float(p + 2)), k4_bytes_as_floats(k.mins));
      _mm512_storeu_ps(c16 + 16 * b, _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(m8)));
      const __m512 s512 = _mm512_castps256_ps512(s8);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i which = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * c)), _mm256_set1_epi32(2 * c + 1), 1);
        sink(256 * b + 64 * c, k4_chunk<T>(p, c), _mm512_permutexvar_ps(which, s512));
      }
    }
  } else if constexpr (T == kQ6_K) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* p = row + b * t.bytes;
      prefetch_ahead(p, t.bytes);
      const __m512 s16 = _mm512_mul_ps(_mm512_set1_ps(half_to_float(p + 208)),
                                       _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)))));
      _mm512_storeu_ps(c16 + 16 * b, _mm512_mul_ps(s16, _mm512_set1_ps(32.0f)));
      const __m512i g0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c)
        sink(256 * b + 64 * c, k6_chunk(p, c), _mm512_permutexvar_ps(_mm512_add_epi32(g0, _mm512_set1_epi32(4 * c)), s16));
    }
  }
}

// The machine's int8 peak on VNNI: 8 independent chains of VPDPBUSD (64 multiply-adds each).
// Returns the multiply-adds done.
__attribute__((noinline)) inline int64_t vnni_peak_loop(int64_t iterations) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m512i u0 = _mm512_set1_epi8(1), u1 = _mm512_set1_epi8(2), x0 = _mm512_set1_epi8(3), x1 = _mm512_set1_epi8(-4);
  for (int64_t i = 0; i < iterations; ++i) {
    __asm__ volatile("" : "+v"(u0), "+v"(u1), "+v"(x0), "+v"(x1));
    a0 = _mm512_dpbusd_epi32(a0, u0, x0);
    a1 = _mm512_dpbusd_epi32(a1, u0, x1);
    a2 = _mm512_dpbusd_epi32(a2, u1, x0);
    a3 = _mm512_dpbusd_epi32(a3, u1, x1);
    a4 = _mm512_dpbusd_epi32(a4, x0, u0);
    a5 = _mm512_dpbusd_epi32(a5, x1, u0);
    a6 = _mm512_dpbusd_epi32(a6, x0, u1);
    a7 = _mm512_dpbusd_epi32(a7, x1, u1);
  }
  const __m512i all = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                       _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
  __asm__ volatile("" : : "v"(all));
  return iterations * 8 * 64;
}

// y[r * y_stride] for R rows of x from r0 and one row of W; dxl: each row's scale per 4 weights.
template <int T, int R>
inline void int8_fused_rows(float* y, int64_t y_stride, const uint8_t* row, int64_t num_blocks, const Int8Rows& a,
                            const float* dxl, int64_t r0, float* c16) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t lanes = a.padded / 4, groups = a.padded / 16;
  int8_chunks_avx512<T>(row, num_blocks, c16, [&](int64_t k, __m512i u, __m512 s) {
    for (int r = 0; r < R; ++r) {
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(a.qx + (r0 + r) * a.padded + k));
      const __m512 scale = _mm512_mul_ps(s, _mm512_loadu_ps(dxl + (r0 + r) * lanes + k / 4));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
    }
  });
  // the constants' term, sum_g c_g xs_g, two chains per row (c16 and xs16 are zero past the row)
  __m512 off[R][2];
  for (int r = 0; r < R; ++r) off[r][0] = off[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 m = groups - g >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (groups - g)) - 1);
    const __m512 cv = _mm512_maskz_loadu_ps(m, c16 + g);
    for (int r = 0; r < R; ++r)
      off[r][(g / 16) & 1] = _mm512_fmadd_ps(cv, _mm512_maskz_loadu_ps(m, a.xs16 + (r0 + r) * groups + g), off[r][(g / 16) & 1]);
  }
  for (int r = 0; r < R; ++r)
    y[r * y_stride] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[r], _mm512_add_ps(off[r][0], off[r][1])));
}

// The K-quants with x quantized per 256 (llama.cpp's Q8_K way on AVX-512 VNNI): a super-block's
// sub-block scales (Q4_K/Q5_K: eight of 6 bits; Q6_K: sixteen signed bytes) apply to integer
// sums, so each row of x takes, per 64 weights, one VPMADDUBSW (u by qx into int16 pairs, at most
// 2 x 63 x 127) and one VPDPWSSD by the sub-blocks' scales into int32 lanes (exact: at most
// 256 x 63 x 127 x 128 in all), and per super-block one conversion and one FMA by d dx: half
// the vector work of int8_fused_rows, whose scales are floats per 64. The constants' term
// (minimums; Q6_K's 32) is the same as there (c16 against xs16), but for up to 4 rows of x it is
// one FMA per super-block in registers: the pass over c16 after each row of W, with its stores
// and loads, held a 1-row Q4_K product at 36-46 GB/s where a read gave 51-55 (46-53 without it).
template <int T, int R>
inline void q8k_fused_rows(float* y, int64_t y_stride, const uint8_t* row, int64_t num_blocks, const Int8Rows& a,
                           int64_t r0, float* c16) {
  const TypeSize t = type_size(T);
  const int64_t groups = a.padded / 16;
  constexpr bool kInRegisters = R <= 4;  // the constants' term
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* p = row + b * t.bytes;
    prefetch_ahead(p, t.bytes);
    // the sub-block scales as int16 (lanes 0-7, or 0-15 for Q6_K), and the constants per 16 weights
    __m512i scales;
    __m512 constants;
    float d;
    if constexpr (T == kQ6_K) {
      d = half_to_float(p + 208);
      const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
      scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc));
      const __m512 s16 = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
      constants = _mm512_mul_ps(s16, _mm512_set1_ps(32.0f));
    } else {
      d = half_to_float(p);
      const K4Scales k = k4_scales_mins(p);
      const __m256 m8 = _mm256_mul_ps(_mm256_set1_ps(half_to_float(p + 2)), k4_bytes_as_floats(k.mins));
      constants = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(m8));
      scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(k.scales));
    }
    if constexpr (kInRegisters)
      for (int r = 0; r < R; ++r) off[r] = _mm512_fmadd_ps(constants, _mm512_loadu_ps(a.xs16 + (r0 + r) * groups + 16 * b), off[r]);
    else
      _mm512_storeu_ps(c16 + 16 * b, constants);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m512i u, which;  // which: each int16 lane's sub-block (a lane holds two weights' products)
      if constexpr (T == kQ6_K) {
        u = k6_chunk(p, c);
        which = _mm512_add_epi16(_mm512_loadu_si512(kLaneEighths), _mm512_set1_epi16(static_cast<short>(4 * c)));
      } else {
        u = k4_chunk<T>(p, c);
        which = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<short>(2 * c))),
                                   _mm256_set1_epi16(static_cast<short>(2 * c + 1)), 1);
      }
      const __m512i scale = _mm512_permutexvar_epi16(which, scales);
      for (int r = 0; r < R; ++r) {
        const __m512i q = _mm512_loadu_si512(a.qx + (r0 + r) * a.padded + 256 * b + 64 * c);
        isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_maddubs_epi16(u, q), scale);
      }
    }
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_set1_ps(d * a.dx16[(r0 + r) * groups + 16 * b]), acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (!kInRegisters) {
      __m512 o[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t g = 0; g < 16 * num_blocks; g += 16)
        o[(g / 16) & 1] = _mm512_fmadd_ps(_mm512_loadu_ps(c16 + g), _mm512_loadu_ps(a.xs16 + (r0 + r) * groups + g), o[(g / 16) & 1]);
      off[r] = _mm512_add_ps(o[0], o[1]);
    }
    y[r * y_stride] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[r], off[r]));
  }
}

template <int T, int R>
inline void int8_rows_avx512(float* y, int64_t y_stride, const uint8_t* row, int64_t num_blocks, const Int8Rows& a,
                             const float* dxl, int64_t r0, float* c16) {
  if constexpr (T == kQ4_K || T == kQ5_K || T == kQ6_K)  // x per 256: the scales apply to integer sums
    q8k_fused_rows<T, R>(y, y_stride, row, num_blocks, a, r0, c16);
  else
    int8_fused_rows<T, R>(y, y_stride, row, num_blocks, a, dxl, r0, c16);
}

template <int T>
void int8_matmul_avx512(float* y, const uint8_t* packed, int64_t num_rows, int64_t out_features, int64_t in_features,
                        const Int8Rows& a, int num_threads) {
  constexpr bool kQ8K = T == kQ4_K || T == kQ5_K || T == kQ6_K;  // q8k_fused_rows: no lane scales
  if constexpr (kQ8K)
    if (num_rows == 1) return q8k_wrows_matmul<T>(y, packed, out_features, in_features, a, num_threads);
  const TypeSize t = type_size(T);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const int64_t lanes = a.padded / 4, groups = a.padded / 16;
  float* dxl = kQ8K ? nullptr : static_cast<float*>(thread_buffer(6, sizeof(float) * num_rows * lanes));
  if constexpr (!kQ8K) {
    for (int64_t r = 0; r < num_rows; ++r)
      for (int64_t l = 0; l < lanes; ++l) dxl[r * lanes + l] = a.dx16[r * groups + l / 4];
    if (num_rows <= kWRowsMaxX)
      return legacy_wrows_matmul<T>(y, packed, num_rows, out_features, in_features, a, dxl, num_threads);
  }
  constexpr int kGroup = 8;
#pragma omp parallel num_threads(num_threads)
  {
    float* c16 = static_cast<float*>(thread_buffer(0, sizeof(float) * groups));
    std::memset(c16, 0, sizeof(float) * groups);  // past the row's groups: zero, never written
    for_rows_streamed(out_features, [&](int64_t n) {
      const uint8_t* row = packed + n * row_bytes;
      for (int64_t r0 = 0; r0 < num_rows; r0 += kGroup) {
        float* yr = y + r0 * out_features + n;
        switch (num_rows - r0 < kGroup ? num_rows - r0 : kGroup) {
          case 1: int8_rows_avx512<T, 1>(yr, out_features, row, num_blocks, a, dxl, r0, c16); break;
          case 2: int8_rows_avx512<T, 2>(yr, out_features, row, num_blocks, a, dxl, r0, c16); break;
          case 3: int8_rows_avx512<T, 3>(yr, out_features, row, num_blocks, a, dxl, r0, c16); break;
          case 4: int8_rows_avx512<T, 4>(yr, out_features, row, num_blocks, a, dxl, r0, c16); break;
          case 5: int8_rows_avx512<T, 5>(yr, out_features, row, num_blocks, a, dxl, r0, c16); break;
          case 6: int8_rows_avx512<T, 6>(yr, out_features, row, num_blocks, a, dxl, r0, c16); break;
          case 7: int8_rows_avx512<T, 7>(yr, out_features, row, num_blocks, a, dxl, r0, c16); break;
          default: int8_rows_avx512<T, 8>(yr, out_features, row, num_blocks, a, dxl, r0, c16); break;
        }
      }
    });
  }
}

void int8_matmul_avx512(int qtype, float* y, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                        int64_t in_features, const Int8Rows& a, int num_threads) {
  switch (qtype) {
    case kQ4_0: return int8_matmul_avx512<kQ4_0>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ4_1: return int8_matmul_avx512<kQ4_1>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ5_0: return int8_matmul_avx512<kQ5_0>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ5_1: return int8_matmul_avx512<kQ5_1>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ8_0: return int8_matmul_avx512<kQ8_0>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ4_K: return int8_matmul_avx512<kQ4_K>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ5_K: return int8_matmul_avx512<kQ5_K>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ6_K: return int8_matmul_avx512<kQ6_K>(y, packed, num_rows, out_features, in_features, a, num_threads);
    default: return;
  }
}
#endif

}  // namespace gguf
