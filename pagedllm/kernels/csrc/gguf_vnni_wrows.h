// The int8 way on AVX-512 VNNI for one or two rows of x (decoding) and the legacy types (Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0): four rows of W in flight at a time. int8_fused_rows (gguf_vnni_int8.h)
// walks one row of W, and at one row of x its one chain of FMAs (a row of 640 weights: 10, 4
// cycles each), its pass over the constants and its reduction bound it, not the memory. Here each
// of the four rows has its own chain, x's vectors are loaded once for the four, the offsets' term
// starts VPDPBUSD's sums (exact integers: no constants' pass) and the four rows' sums are reduced
// together (sum_four). Measured in one process, alternated, caches flushed (Zen 5, 2 threads):
// an LM head's 262,144 x 640 Q8_0 table (Gemma 3's) at one row 36.1 -> 45.9 GB/s where a read of
// the same bytes gave 50.6; SmolLM2's 576-wide Q4_1 22.7 -> 33.7. Self-contained; in namespace gguf.
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

// y[r * y_stride + n] for the R rows of x and the `rows` (1-4) rows of W from w: four rows of W
// in flight, each with its own chain, and x's vectors loaded once for the four. (A row past the
// end of W is the last one again, its sums not stored: every row is computed the same way.) The
// four rows are adjacent, read in turn a chunk of each, which the hardware prefetchers follow
// badly (the Q8_0 head at 1 row: 23 GB/s with the per-chunk prefetch of the other ways): the
// next four rows are prefetched whole as these start (70-71 GB/s where a read gave 77-81).
template <int T, int R>
inline void legacy_four_rows(float* y, int64_t y_stride, const uint8_t* w, int64_t row_bytes, int64_t rows,
                             int64_t num_blocks, const XLanes* x) {
  constexpr bool has_min = T == kQ4_1 || T == kQ5_1, has_offset = legacy_offset<T> != 0;
  const int bytes = type_size(T).bytes;
  const uint8_t* p[4];
  for (int n = 0; n < 4; ++n) p[n] = w + (n < rows ? n : rows - 1) * row_bytes;
  for (int64_t off = 0; off < 4 * row_bytes; off += 64)  // (past W's end: a prefetch never faults)
    _mm_prefetch(reinterpret_cast<const char*>(w + 4 * row_bytes + off), _MM_HINT_NTA);
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
  int64_t b = 0;
  for (; b + 8 <= num_blocks; b += 8) {  // eight blocks' float16 scales (and minimums) converted at once
    __m512 d[4], m[4];
    for (int n = 0; n < 4; ++n) {
      const uint8_t* q = p[n] + b * bytes;
      d[n] = _mm512_castps256_ps512(_mm256_cvtph_ps(halves_of_8_blocks(q, bytes, 0)));
      m[n] = has_min ? _mm512_castps256_ps512(_mm256_cvtph_ps(halves_of_8_blocks(q, bytes, 2))) : d[n];
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512i which = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(2 * j)), _mm256_set1_epi32(2 * j + 1), 1);
      __m512 s[4], mn[4];
      for (int n = 0; n < 4; ++n) {
        s[n] = _mm512_permutexvar_ps(which, d[n]);
        mn[n] = has_min ? _mm512_permutexvar_ps(which, m[n]) : s[n];
      }
      step(b + 2 * j, bytes, s, mn);
    }
  }
  for (; b < num_blocks; b += 2) {  // a lone last block: its second half meets x's zeros
    const bool pair = b + 1 < num_blocks;
    __m512 s[4], mn[4];
    for (int n = 0; n < 4; ++n) {
      const uint8_t* q = p[n] + b * bytes;
      s[n] = _mm512_insertf32x8(_mm512_set1_ps(half_to_float(q)), _mm256_set1_ps(pair ? half_to_float(q + bytes) : 0.0f), 1);
      mn[n] = has_min ? _mm512_insertf32x8(_mm512_set1_ps(half_to_float(q + 2)),
                                           _mm256_set1_ps(pair ? half_to_float(q + bytes + 2) : 0.0f), 1)
                      : s[n];
    }
    step(b, pair ? bytes : 0, s, mn);
  }
  for (int r = 0; r < R; ++r)
    _mm_mask_storeu_ps(y + r * y_stride, static_cast<__mmask8>((1u << rows) - 1),
                       sum_four(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// The rows of x legacy_wrows_matmul takes (more: int8_fused_rows, where x's vectors fill the registers).
constexpr int kWRowsMaxX = 2;

template <int T>
void legacy_wrows_matmul(float* y, const uint8_t* packed, int64_t num_rows, int64_t out_features, int64_t in_features,
                         const Int8Rows& a, int num_threads) {
  const TypeSize t = type_size(T);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const int64_t lanes = a.padded / 4, groups = a.padded / 16;
  float* lane_dx = static_cast<float*>(thread_buffer(6, 12 * num_rows * lanes));
  float* lane_xs = lane_dx + num_rows * lanes;
  int32_t* start = reinterpret_cast<int32_t*>(lane_xs + num_rows * lanes);
  XLanes x[kWRowsMaxX];
  for (int64_t r = 0; r < num_rows; ++r) {
    const int8_t* q = a.qx + r * a.padded;
    for (int64_t l = 0; l < lanes; ++l) {
      const int sum = q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3];
      const float dx = a.dx16[r * groups + l / 4];
      lane_dx[r * lanes + l] = dx;
      lane_xs[r * lanes + l] = dx * static_cast<float>(sum);
      start[r * lanes + l] = -legacy_offset<T> * sum;
    }
    x[r] = XLanes{q, lane_dx + r * lanes, start + r * lanes, lane_xs + r * lanes};
  }
#pragma omp parallel num_threads(num_threads)
  for_row_blocks_streamed(out_features, 4, [&](int64_t n0, int64_t rows) {
    if (num_rows == 1)
      legacy_four_rows<T, 1>(y + n0, out_features, packed + n0 * row_bytes, row_bytes, rows, num_blocks, x);
    else
      legacy_four_rows<T, 2>(y + n0, out_features, packed + n0 * row_bytes, row_bytes, rows, num_blocks, x);
  });
}
#endif

}  // namespace gguf
