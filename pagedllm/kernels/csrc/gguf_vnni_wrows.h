// The int8 way on AVX-512 VNNI for one or two rows of x (decoding): four rows of W in flight at
// a time, one from each of four streams (for_rows_in_four_streams), each with its own chain, and
// the four rows' sums reduced together (sum_four). The one-row-of-W ways (gguf_vnni_int8.h) have
// one chain per row of x (a row of 640 Q8_0 weights: 10 FMAs of 4 cycles), a reduction per row
// and, for the legacy types, a pass over the constants after it: at one row of x they, not the
// memory, bound the product. For the legacy types the offsets' term is VPDPBUSD's starting value
// (exact integers: no constants' pass); the K-quants keep q8k_fused_rows' arithmetic. Measured in
// one process, alternated, caches flushed (Zen 5, 2 threads), one row, against the kernels before
// (e50c230), GB/s (a read of the same bytes): Gemma 3's 262,144 x 640 Q8_0 head 25.6 -> 33.7
// (41.6), Qwen3's 151,936 x 1,024 Q6_K head 32.4 -> 36.7 (38.5), Q4_K 3,072 wide 24.1 -> 32.9
// (34.7), 8,192 wide 35.7 -> 44.1 (47.0), SmolLM2's 576-wide Q4_1 20.0 -> 29.6 (44.6).
// Self-contained; in namespace gguf.
#pragma once

#include <cstdint>
#include <cstring>

#include <omp.h>

#include "gguf_blocks.h"
#include "gguf_common.h"
#include "gguf_float.h"
#include "gguf_int8.h"
#include "gguf_vnni_blocks.h"

namespace gguf {

#ifdef GGUF_AVX512
// A row of x as legacy_four_rows reads it, per lane of 4 weights (a lane of VPDPBUSD's result):
// its int8 values, its block's scale, the offset's integer term (-offset times the lane's sum of
// values: VPDPBUSD starts from it, so each lane's sum is of the weights' signed values, exact)
// and, for Q4_1/Q5_1, the scale times the lane's sum (the minimum's factor).
struct XLanes {
  const int8_t* q;
  const float* dx;
  const int32_t* start;
  const float* xs;
};

// [sum a0, sum a1, sum a2, sum a3], each vector summed in the same order wherever it sits
// among the four (so a row's result does not depend on its neighbours).
inline __m128 sum_four(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xDD));
  y = _mm512_add_ps(y, _mm512_permute_ps(y, _MM_SHUFFLE(2, 3, 0, 1)));
  y = _mm512_add_ps(y, _mm512_permute_ps(y, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), y));
}

// y[rows[n]] = sums[n] where valid has bit n.
inline void store_four(float* y, const int64_t rows[4], unsigned valid, __m128 sums) {
  alignas(16) float v[4];
  _mm_store_ps(v, sums);
  for (int n = 0; n < 4; ++n)
    if (valid >> n & 1) y[rows[n]] = v[n];
}

// y[r * y_stride + rows[n]] for the R rows of x and the four rows of W `rows` (for_rows_in_four_streams'):
// four rows of W in flight, each with its own chain, and x's vectors loaded once for the four.
// (A row that is not valid is computed like the others, its sums not stored.)
template <int T, int R>
inline void legacy_four_rows(float* y, int64_t y_stride, const uint8_t* packed, int64_t row_bytes, const int64_t rows[4],
                             unsigned valid, int64_t num_blocks, const XLanes* x) {
  constexpr bool has_min = T == kQ4_1 || T == kQ5_1, has_offset = legacy_offset<T> != 0;
  const int bytes = type_size(T).bytes;
  const uint8_t* p[4];
  for (int n = 0; n < 4; ++n) p[n] = packed + rows[n] * row_bytes;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < 4; ++n) acc[r][n] = _mm512_setzero_ps();
  // 64 weights from block b (and b + 1) of each row, s: their scales per lane, mn: minimums
  const auto step = [&](int64_t b, const int64_t next, const __m512* s, const __m512* mn) {
    const int64_t k = 32 * b;
    __m512i xq[R], start[R];
    __m512 dx[R], xs[R];
    for (int r = 0; r < R; ++r) {
      xq[r] = _mm512_loadu_si512(x[r].q + k);
      dx[r] = _mm512_loadu_ps(x[r].dx + k / 4);
      start[r] = has_offset ? _mm512_loadu_si512(x[r].start + k / 4) : _mm512_setzero_si512();
      if constexpr (has_min) xs[r] = _mm512_loadu_ps(x[r].xs + k / 4);
    }
#pragma GCC unroll 4
    for (int n = 0; n < 4; ++n) {
      const uint8_t* q = p[n] + b * bytes;
      const __m512i u = legacy_pair_values<T>(q, q + next);
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_dpbusd_epi32(start[r], u, xq[r]);
        acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s[n], dx[r]), acc[r][n]);
        if constexpr (has_min) acc[r][n] = _mm512_fmadd_ps(mn[n], xs[r], acc[r][n]);
      }
    }
  };
  // eight blocks (then the last few) at a time, their float16 scales (and minimums) converted at once
  const auto group = [&](int64_t b, int blocks) {
    __m512 d[4], m[4];
    for (int n = 0; n < 4; ++n) {
      const uint8_t* q = p[n] + b * bytes;
      prefetch_ahead(q, 8 * bytes);
      d[n] = _mm512_castps256_ps512(_mm256_cvtph_ps(halves_of_8_blocks(q, bytes, 0, blocks)));
      m[n] = has_min ? _mm512_castps256_ps512(_mm256_cvtph_ps(halves_of_8_blocks(q, bytes, 2, blocks))) : d[n];
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      if (2 * j >= blocks) break;
      const __m512i which = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * j)), _mm256_set1_epi32(2 * j + 1), 1);
      __m512 s[4], mn[4];
      for (int n = 0; n < 4; ++n) {
        s[n] = _mm512_permutexvar_ps(which, d[n]);
        mn[n] = has_min ? _mm512_permutexvar_ps(which, m[n]) : s[n];
      }
      step(b + 2 * j, 2 * j + 1 < blocks ? bytes : 0, s, mn);  // a lone last block: its second half meets x's zeros
    }
  };
  int64_t b = 0;
  for (; b + 8 <= num_blocks; b += 8) group(b, 8);
  if (b < num_blocks) group(b, static_cast<int>(num_blocks - b));
  for (int r = 0; r < R; ++r) store_four(y + r * y_stride, rows, valid, sum_four(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// The K-quants' way (q8k_fused_rows' arithmetic, x quantized per 256) for one row of x and four
// rows of W: per super-block and row of W, one VPMADDUBSW and one VPDPWSSD by the sub-blocks'
// scales per 64 weights into an integer sum, one FMA by d dx, and one FMA of the constants per 16
// weights (Q4_K/Q5_K's minimums, Q6_K's 32) with x's sums; the four rows' sums reduced together.
// From cache a 1-row Q4_K product 1024 wide ran 15% faster than q8k_fused_rows (65 against 57
// GB/s), 3072 wide 16%; from DRAM it reads at the read rate, as that one did.
template <int T>
inline void q8k_four_rows(float* y, const uint8_t* packed, int64_t row_bytes, const int64_t rows[4], unsigned valid,
                          int64_t num_blocks, const Int8Rows& a) {
  const int bytes = type_size(T).bytes;
  const uint8_t* p[4];
  for (int n = 0; n < 4; ++n) p[n] = packed + rows[n] * row_bytes;
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  __m512 acc[4], off[4];
  for (int n = 0; n < 4; ++n) acc[n] = off[n] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m512i scales[4];  // the sub-block scales as int16 (lanes 0-7, or 0-15 for Q6_K)
    __m512 c16[4];      // the constants per 16 weights
    float d[4];
    for (int n = 0; n < 4; ++n) {
      const uint8_t* q = p[n] + b * bytes;
      prefetch_ahead(q, bytes);
      if constexpr (T == kQ6_K) {
        d[n] = half_to_float(q + 208);
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 192));
        scales[n] = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc));
        c16[n] = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(d[n]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))),
                               _mm512_set1_ps(32.0f));
      } else {
        d[n] = half_to_float(q);
        const K4Scales k = k4_scales_mins(q);
        const __m256 m8 = _mm256_mul_ps(_mm256_set1_ps(half_to_float(q + 2)), k4_bytes_as_floats(k.mins));
        c16[n] = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(m8));
        scales[n] = _mm512_castsi128_si512(_mm_cvtepu8_epi16(k.scales));
      }
    }
    __m512i isum[4];
    for (int n = 0; n < 4; ++n) isum[n] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i which = T == kQ6_K
          ? _mm512_add_epi16(_mm512_loadu_si512(kLaneEighths), _mm512_set1_epi16(static_cast<short>(4 * c)))
          : _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(static_cast<short>(2 * c))),
                               _mm256_set1_epi16(static_cast<short>(2 * c + 1)), 1);
      const __m512i qx = _mm512_loadu_si512(a.qx + 256 * b + 64 * c);
      for (int n = 0; n < 4; ++n) {
        const uint8_t* q = p[n] + b * bytes;
        const __m512i u = T == kQ6_K ? k6_chunk(q, c) : k4_chunk<T>(q, c);
        isum[n] = _mm512_dpwssd_epi32(isum[n], _mm512_maddubs_epi16(u, qx), _mm512_permutexvar_epi16(which, scales[n]));
      }
    }
    const float dx = a.dx16[16 * b];
    const __m512 xs = _mm512_loadu_ps(a.xs16 + 16 * b);
    for (int n = 0; n < 4; ++n) {
      acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[n]), _mm512_set1_ps(d[n] * dx), acc[n]);
      off[n] = _mm512_fmadd_ps(c16[n], xs, off[n]);
    }
  }
  store_four(y, rows, valid, sum_four(_mm512_sub_ps(acc[0], off[0]), _mm512_sub_ps(acc[1], off[1]),
                                      _mm512_sub_ps(acc[2], off[2]), _mm512_sub_ps(acc[3], off[3])));
}

template <int T>
void q8k_wrows_matmul(float* y, const uint8_t* packed, int64_t out_features, int64_t in_features, const Int8Rows& a,
                      int num_threads) {
  const TypeSize t = type_size(T);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
#pragma omp parallel num_threads(num_threads)
  for_rows_in_four_streams(out_features, [&](const int64_t rows[4], unsigned valid) {
    q8k_four_rows<T>(y, packed, row_bytes, rows, valid, num_blocks, a);
  });
}

// The rows of x legacy_wrows_matmul takes (more: int8_fused_rows, where x's vectors fill the registers).
constexpr int kWRowsMaxX = 2;

// dxl: each row of x's scale per lane of 4 weights (int8_matmul_avx512's).
template <int T>
void legacy_wrows_matmul(float* y, const uint8_t* packed, int64_t num_rows, int64_t out_features, int64_t in_features,
                         const Int8Rows& a, const float* dxl, int num_threads) {
  const TypeSize t = type_size(T);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const int64_t lanes = a.padded / 4;
  float* lane_xs = static_cast<float*>(thread_buffer(7, 8 * num_rows * lanes));
  int32_t* start = reinterpret_cast<int32_t*>(lane_xs + num_rows * lanes);
  XLanes x[kWRowsMaxX];
  for (int64_t r = 0; r < num_rows; ++r) {
    const int8_t* q = a.qx + r * a.padded;
    const float* dx = dxl + r * lanes;
    for (int64_t l = 0; l < lanes; ++l) {
      const int sum = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
      lane_xs[r * lanes + l] = dx[l] * static_cast<float>(sum);
      start[r * lanes + l] = -legacy_offset<T> * sum;
    }
    x[r] = XLanes{q, dx, start + r * lanes, lane_xs + r * lanes};
  }
#pragma omp parallel num_threads(num_threads)
  for_rows_in_four_streams(out_features, [&](const int64_t rows[4], unsigned valid) {
    if (num_rows == 1)
      legacy_four_rows<T, 1>(y, out_features, packed, row_bytes, rows, valid, num_blocks, x);
    else
      legacy_four_rows<T, 2>(y, out_features, packed, row_bytes, rows, valid, num_blocks, x);
  });
}
#endif

}  // namespace gguf
