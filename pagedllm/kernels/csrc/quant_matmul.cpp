// y = x W^T with W from a GGUF block quantization (Q4_1 or Q8_0), for a few rows of x.
//
// Decoding a handful of sequences is bound by reading the weights: a float32 copy of a 135M
// parameter model is 540 MB per step. Per block of 32 weights, Q4_1 holds a scale d, a minimum
// m and 32 4-bit values q (w = d q + m); Q8_0 holds d and 32 int8 values (w = d q). At load
// time the blocks are unpacked once into their values (Q4_1: the file's 16 bytes of nibbles,
// value j in the low nibble of byte j and value j + 16 in the high one; Q8_0: one byte each) and
// float32 scales and minimums: 0.75 bytes per Q4_1 weight, against 4 for float32, and no
// float16 to convert. A few rows are bound by reading them, so the nibbles stay packed: two
// instructions split a block's 16 bytes into its 32 values.
// Two ways through, by the number of rows of x:
// - a few rows (decoding a handful of sequences, below kTiledRows): each block's 32 weights are
//   expanded in registers (w = q d + m, one FMA per 8), and every row of x in a group of up to 8
//   takes them. The weights are read once; the expansion is the arithmetic's overhead.
// - more rows: kTileW rows of W at a time are expanded into a float buffer that stays in the
//   core's L1 cache, then a register tile of kTileW x kTileX dot products runs over every pair
//   of rows: each load of x feeds kTileW FMAs and each load of W kTileX, where the first way
//   reloads x for every row of W. About 1.4x its rate at 16-64 rows on the 2-core AVX2 machine
//   (`pagedllm bench matmul`).
// Rows of W are split across OpenMP threads. Math in float32.

#include <cstdint>
#include <cstring>

#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#define QUANT_AVX2 1
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kRowGroup = 8;  // rows of x that share each expanded block (few rows)
constexpr int kTiledRows = 8;  // from this many rows of x on, the tiled way
constexpr int kTileW = 6;  // rows of W expanded together (tiled way)
constexpr int kTileX = 2;  // rows of x per register tile (tiled way): 12 accumulators

// Bytes of values per row of W: Q4_1 (the type with minimums) keeps two per byte.
template <bool kNibbles>
constexpr int64_t row_bytes(int64_t in_features) {
  return kNibbles ? in_features / 2 : in_features;
}

#ifdef QUANT_AVX2
using namespace pagedllm_simd;

// The 32 values of block b as 4 vectors of 8 floats (see the top of the file for the layouts).
template <bool kSigned, bool kNibbles>
inline void load_block(__m256 q[4], const uint8_t* values, int b) {
  if (kNibbles) {
    __m128i lo, hi;
    split_nibbles(values + b * (kBlock / 2), &lo, &hi);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    for (int c = 0; c < 4; ++c) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(values + b * kBlock + 8 * c));
      q[c] = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
    }
  }
}

// y[r * out_features + n] = x_r . w_n for R rows of x (R <= 8) and one row n of W. With few
// rows, each row keeps several accumulators so that consecutive FMAs do not wait on each other.
template <int R, bool kSigned, bool kMin>
inline void dot_rows(float* y, int64_t out_features, const float* x, int64_t in_features, const uint8_t* values,
                     const float* scales, const float* mins, int num_blocks) {
  // Accumulators per row: as many as the 16 vector registers allow beside the 4 weights, d and m.
  constexpr int A = R == 1 || R == 2 ? 4 : R <= 4 ? 2 : 1;
  __m256 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  for (int b = 0; b < num_blocks; ++b) {
    const __m256 d = _mm256_broadcast_ss(scales + b);
    const __m256 m = kMin ? _mm256_broadcast_ss(mins + b) : _mm256_setzero_ps();
    __m256 w[4];
    load_block<kSigned, kMin>(w, values, b);
    for (int c = 0; c < 4; ++c) w[c] = kMin ? _mm256_fmadd_ps(w[c], d, m) : _mm256_mul_ps(w[c], d);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * in_features + b * kBlock;
      for (int c = 0; c < 4; ++c) acc[r][c % A] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(xb + 8 * c), acc[r][c % A]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 sum = acc[r][0];
    for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[r][a]);
    y[r * out_features] = hsum(sum);
  }
}

// y[r * out_features] = x_r . w for `rows` rows of x (at most kRowGroup) and one row of W.
template <bool kSigned, bool kMin>
inline void row_group(float* y, int64_t out_features, const float* x, int64_t in_features, const uint8_t* values,
                      const float* scales, const float* mins, int num_blocks, int rows) {
  switch (rows) {
    case 1: return dot_rows<1, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 2: return dot_rows<2, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 3: return dot_rows<3, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 4: return dot_rows<4, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 5: return dot_rows<5, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 6: return dot_rows<6, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 7: return dot_rows<7, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    default: return dot_rows<8, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
  }
}


// Expands one row of W (num_blocks blocks) into floats.
template <bool kSigned, bool kMin>
inline void expand_row(float* dst, const uint8_t* values, const float* scales, const float* mins, int num_blocks) {
  for (int b = 0; b < num_blocks; ++b) {
    const __m256 d = _mm256_broadcast_ss(scales + b);
    const __m256 m = kMin ? _mm256_broadcast_ss(mins + b) : _mm256_setzero_ps();
    __m256 q[4];
    load_block<kSigned, kMin>(q, values, b);
    for (int c = 0; c < 4; ++c)
      _mm256_store_ps(dst + b * kBlock + 8 * c, kMin ? _mm256_fmadd_ps(q[c], d, m) : _mm256_mul_ps(q[c], d));
  }
}

// y[r * out_features + j] = x_r . w_j for R rows of x and the kTileW expanded rows w_j of W
// (w: kTileW rows of in_features floats).
template <int R>
inline void register_tile(float* y, int64_t out_features, const float* x, int64_t in_features, const float* w) {
  __m256 acc[R][kTileW];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kTileW; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in_features; k += 8) {
    __m256 wv[kTileW];
    for (int j = 0; j < kTileW; ++j) wv[j] = _mm256_load_ps(w + j * in_features + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * in_features + k);
      for (int j = 0; j < kTileW; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kTileW; ++j) y[r * out_features + j] = hsum(acc[r][j]);
}

// Rows [n0, n0 + kTileW) of y for every row of x, through a per-thread buffer `w`.
template <bool kSigned, bool kMin>
inline void tiled_rows(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins,
                       int num_rows, int out_features, int in_features, int n0, float* w) {
  const int num_blocks = in_features / kBlock;
  for (int j = 0; j < kTileW; ++j) {
    const int64_t n = n0 + j;
    expand_row<kSigned, kMin>(w + j * in_features, values + n * row_bytes<kMin>(in_features), scales + n * num_blocks,
                              kMin ? mins + n * num_blocks : nullptr, num_blocks);
  }
  int r = 0;
  for (; r + kTileX <= num_rows; r += kTileX)
    register_tile<kTileX>(y + static_cast<int64_t>(r) * out_features + n0, out_features,
                          x + static_cast<int64_t>(r) * in_features, in_features, w);
  for (; r < num_rows; ++r)
    register_tile<1>(y + static_cast<int64_t>(r) * out_features + n0, out_features,
                     x + static_cast<int64_t>(r) * in_features, in_features, w);
}
#define QUANT_TILED 1

#else  // portable

template <bool kSigned, bool kMin>
inline void row_group(float* y, int64_t out_features, const float* x, int64_t in_features, const uint8_t* values,
                      const float* scales, const float* mins, int num_blocks, int rows) {
  for (int r = 0; r < rows; ++r) {
    float dot = 0.0f;
    for (int b = 0; b < num_blocks; ++b) {
      const float m = kMin ? mins[b] : 0.0f;
      for (int j = 0; j < kBlock; ++j) {
        const int k = b * kBlock + j;
        const float q = kSigned ? static_cast<float>(static_cast<int8_t>(values[k]))
                                : static_cast<float>(j < 16 ? values[b * 16 + j] & 0x0F : values[b * 16 + j - 16] >> 4);
        dot += (q * scales[b] + m) * x[r * in_features + k];
      }
    }
    y[r * out_features] = dot;
  }
}

#endif

// y rows for rows [n_begin, n_end) of W, one row of W at a time (the few-rows way).
template <bool kSigned, bool kMin>
inline void direct_row(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins,
                       int num_rows, int out_features, int in_features, int n) {
  const int num_blocks = in_features / kBlock;
  const uint8_t* v = values + static_cast<int64_t>(n) * row_bytes<kMin>(in_features);
  const float* d = scales + static_cast<int64_t>(n) * num_blocks;
  const float* m = kMin ? mins + static_cast<int64_t>(n) * num_blocks : nullptr;
  for (int r0 = 0; r0 < num_rows; r0 += kRowGroup) {
    const int rows = num_rows - r0 < kRowGroup ? num_rows - r0 : kRowGroup;
    row_group<kSigned, kMin>(y + static_cast<int64_t>(r0) * out_features + n, out_features,
                             x + static_cast<int64_t>(r0) * in_features, in_features, v, d, m, num_blocks, rows);
  }
}

template <bool kSigned, bool kMin>
void matmul(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins, int num_rows,
            int out_features, int in_features, int num_threads) {
#ifdef QUANT_TILED
  if (num_rows >= kTiledRows) {
    const int num_tiles = out_features / kTileW;
#pragma omp parallel num_threads(num_threads)
    {
      float* w = static_cast<float*>(_mm_malloc(sizeof(float) * kTileW * in_features, 64));
#pragma omp for schedule(static)
      for (int t = 0; t < num_tiles; ++t)
        tiled_rows<kSigned, kMin>(y, x, values, scales, mins, num_rows, out_features, in_features, t * kTileW, w);
      _mm_free(w);
#pragma omp for schedule(static)
      for (int n = num_tiles * kTileW; n < out_features; ++n)  // rows of W past the last whole tile
        direct_row<kSigned, kMin>(y, x, values, scales, mins, num_rows, out_features, in_features, n);
    }
    return;
  }
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int n = 0; n < out_features; ++n)
    direct_row<kSigned, kMin>(y, x, values, scales, mins, num_rows, out_features, in_features, n);
}

}  // namespace

extern "C" {

// x: [num_rows, in_features] float32; values: [out_features, in_features] one signed byte each
// for Q8_0, [out_features, in_features / 2] nibbles for Q4_1; scales, mins: [out_features, in_features / 32] float32
// (mins null for Q8_0); y: [num_rows, out_features] float32. in_features: a multiple of 32.
void quant_matmul_f32(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins,
                      int num_rows, int out_features, int in_features, int num_threads) {
  if (mins != nullptr)
    matmul<false, true>(y, x, values, scales, mins, num_rows, out_features, in_features, num_threads);
  else
    matmul<true, false>(y, x, values, scales, mins, num_rows, out_features, in_features, num_threads);
}

}  // extern "C"
