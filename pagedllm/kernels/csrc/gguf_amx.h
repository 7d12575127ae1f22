// The prompt-sized GGUF product on AMX (Intel's tile unit, AMX-BF16), W expanded as the float way
// expands it (gguf_float.h's expand_row). Self-contained; in namespace gguf.
//
// Float32 operands carried in two bfloat16 halves each (v = hi + lo to within 2^-18 |v|: hi its
// nearest bfloat16, lo that of the remainder), and three tile products (hi hi, hi lo, lo hi) per
// step, accumulated in float32 tiles: every term is within 3 2^-18 of its float32 product, inside
// the float way's rounding bound, at AMX's rate (TDPBF16PS: 16 x 16 x 32 products a tile).
//
// The weights are the tile product's A operand: 32 rows of W at a time are expanded to float32
// (expand_row, the float way's) and split into hi and lo rows, natural order; x is its B operand,
// split once per call and laid out as the unit reads B (VNNI: per 16 rows of x and 32 of k, a
// tile of 16 pairs of k by 16 rows of x). Each C tile holds 16 rows of W by 16 rows of x and is
// written to y transposed. Rows of W are split across threads; each thread configures its tiles.

#pragma once

#include <cstdint>
#include <cstring>

#include <omp.h>

#include "amx_tiles.h"
#include "gguf_blocks.h"
#include "gguf_common.h"
#include "gguf_float.h"

namespace gguf {

#if defined(GGUF_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GGUF_AMX 1
constexpr int kAmxMinRows = 32;  // from this many rows of x on, AMX's way (float32)
using pagedllm_amx::amx_permitted;  // amx_tiles.h, which gguf_matmul.cpp includes (through amx_exact.h)
using pagedllm_amx::TileConfig;
using pagedllm_amx::TileScope;

// 32 float32 -> their bfloat16 hi and lo halves (32 each, natural order).
inline void split32(const float* v, uint16_t* hi, uint16_t* lo) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
  const __m512 hb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
  _mm512_storeu_si512(hi, h);
  _mm512_storeu_si512(lo, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha))));
}

constexpr int kAmxRows = 32;  // rows of W per block, and x's rows padded to a multiple of this

// x [num_rows, in_features] -> hi and lo in B's layout: tile (mt, kt) at ((mt * KT + kt) * 256)
// uint32 (pairs of bfloat16), element [kk][m] = x[16 mt + m][32 kt + 2 kk .. + 1]; rows past
// num_rows zero. Run by every thread of a team (its share of the row tiles).
inline void amx_split_x(const float* x, int64_t num_rows, int64_t in_features, int64_t padded_rows, uint32_t* hi,
                        uint32_t* lo) {
  const int64_t kt_count = in_features / 32;
  alignas(64) uint16_t h[32], l[32];
#pragma omp for schedule(static)
  for (int64_t m = 0; m < padded_rows; ++m) {
    const int64_t mt = m / 16, ml = m % 16;
    for (int64_t kt = 0; kt < kt_count; ++kt) {
      uint32_t* th = hi + (mt * kt_count + kt) * 256 + ml;
      uint32_t* tl = lo + (mt * kt_count + kt) * 256 + ml;
      if (m < num_rows) {
        split32(x + m * in_features + 32 * kt, h, l);
        for (int kk = 0; kk < 16; ++kk) {
          std::memcpy(th + 16 * kk, h + 2 * kk, 4);
          std::memcpy(tl + 16 * kk, l + 2 * kk, 4);
        }
      } else {
        for (int kk = 0; kk < 16; ++kk) th[16 * kk] = tl[16 * kk] = 0;
      }
    }
  }
}

void amx_matmul_rows(int qtype, float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                     int64_t in_features, int num_threads) {
  const TypeSize t = type_size(qtype);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const int64_t kt_count = in_features / 32, padded_rows = round_up(num_rows, kAmxRows);
  const int64_t x_tiles = padded_rows / 16 * kt_count * 256;  // uint32 per half
  uint32_t* xh = static_cast<uint32_t*>(thread_buffer(7, sizeof(uint32_t) * 2 * x_tiles));
  uint32_t* xl = xh + x_tiles;
  const int64_t n_blocks = (out_features + kAmxRows - 1) / kAmxRows;
#pragma omp parallel num_threads(num_threads)
  {
    amx_split_x(x, num_rows, in_features, padded_rows, xh, xl);  // (ends in the team's barrier)
    float* w = static_cast<float*>(thread_buffer(2, sizeof(float) * in_features));
    uint16_t* wh = static_cast<uint16_t*>(thread_buffer(8, sizeof(uint16_t) * 2 * kAmxRows * in_features));
    uint16_t* wl = wh + kAmxRows * in_features;
    alignas(64) float c[4][16 * 16];
    const TileScope tiles;  // tiles 0-3: C (16 x 16 float32), 4-5: A (16 rows x 32 bfloat16), 6-7: B (16 pairs x 16 x 2)
    const int64_t stride = 2 * in_features;  // bytes between rows of wh, wl
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < n_blocks; ++nb) {
      const int64_t n0 = nb * kAmxRows;
      for (int r = 0; r < kAmxRows; ++r) {
        uint16_t* hr = wh + r * in_features;
        uint16_t* lr = wl + r * in_features;
        if (n0 + r < out_features) {
          expand_row<V512>(qtype, packed + (n0 + r) * row_bytes, num_blocks, w);
          for (int64_t k = 0; k < in_features; k += 32) split32(w + k, hr + k, lr + k);
        } else {
          std::memset(hr, 0, stride);
          std::memset(lr, 0, stride);
        }
      }
      for (int64_t mt = 0; mt < padded_rows / 16; mt += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint32_t* b0h = xh + mt * kt_count * 256;
        const uint32_t* b1h = b0h + kt_count * 256;
        const uint32_t* b0l = xl + mt * kt_count * 256;
        const uint32_t* b1l = b0l + kt_count * 256;
        // Tiles 4-5 hold W's rows (hi or lo), 6-7 x's (hi or lo); the three products in the order
        // that reloads least: hi lo, hi hi, lo hi (eight tile loads a step).
        const auto products = [] {
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        };
        for (int64_t kt = 0; kt < kt_count; ++kt) {
          _tile_loadd(4, wh + 32 * kt, stride);
          _tile_loadd(5, wh + 16 * in_features + 32 * kt, stride);
          _tile_loadd(6, b0l + kt * 256, 64);
          _tile_loadd(7, b1l + kt * 256, 64);
          products();
          _tile_loadd(6, b0h + kt * 256, 64);
          _tile_loadd(7, b1h + kt * 256, 64);
          products();
          _tile_loadd(4, wl + 32 * kt, stride);
          _tile_loadd(5, wl + 16 * in_features + 32 * kt, stride);
          products();
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        _tile_stored(3, c[3], 64);
        // c[2 a + b][n][m]: rows 16 a + n of the block of W, rows 16 (mt + b) + m of x
        for (int a = 0; a < 2; ++a)
          for (int b = 0; b < 2; ++b)
            for (int m = 0; m < 16; ++m) {
              const int64_t row = 16 * (mt + b) + m;
              if (row >= num_rows) continue;
              for (int n = 0; n < 16; ++n) {
                const int64_t col = n0 + 16 * a + n;
                if (col < out_features) y[row * out_features + col] = c[2 * a + b][n * 16 + m];
              }
            }
      }
    }
  }
}
// At most kAmxChunk rows of x at a time (in even chunks): the split x of a chunk stays in the core's L2 while every
// block of W meets it (measured, one core, Q4_K 8192 x 2048: 357 GFLOP/s at 128-256 rows, 324 at
// 512 in one piece), for one more expansion of W per chunk.
constexpr int64_t kAmxChunk = 256;
void amx_matmul(int qtype, float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                int64_t in_features, int num_threads) {
  const int64_t chunks = (num_rows + kAmxChunk - 1) / kAmxChunk;
  const int64_t chunk = round_up((num_rows + chunks - 1) / chunks, kAmxRows);  // even chunks, padded least
  for (int64_t r0 = 0; r0 < num_rows; r0 += chunk) {
    const int64_t rows = num_rows - r0 < chunk ? num_rows - r0 : chunk;
    amx_matmul_rows(qtype, y + r0 * out_features, x + r0 * in_features, packed, rows, out_features, in_features, num_threads);
  }
}
#endif

}  // namespace gguf
