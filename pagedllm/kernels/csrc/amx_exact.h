// Float32 products on AMX tiles with exact operands (AMX-BF16), for weights whose blocks of 32 are
// w = d q + m with q an integer that a bfloat16 holds exactly (|q| <= 256): the GGUF types with
// one scale per 32 weights (gguf_matmul's exact way, gguf_amx_exact.h, from their int8 decoding
// u, s, c: q = u, d = s, m = -c). Header-only; the caller gives each step's rows of W through an
// expander.
//
// Block b of a product is
//   sum_k x[k] w[k] = d_b sum_k x[k] q[k] + m_b sum_k x[k],
// and x[k] is carried exactly as three bfloat16 (x = hi + mid + lo: each the nearest bfloat16 of
// what the ones before left; 8 significant bits each, float32's 24 in all). Every product x q is
// then exact in float32, and one TDPBF16PS per part sums a block's 32 of them for 16 rows of W
// and 16 rows of x in float32, as the FMA ways do: the result is a float32 product like theirs,
// its sums in another order. Each C element is its own dot product: a row of x gets the same
// bits whatever other rows share the call.
//
// Per step of 32 rows of W: the expander writes their q as bfloat16 (A's rows, natural order) and
// their d and m per block; then per block, for each 16 rows of x, three tile products (one per
// part of x) into two C tiles, which are stored and scaled by d_b (and m_b times x's block sums
// added) into float32 accumulators in L1. The tile unit does the multiplying; the vector unit
// expands the weights and applies the scales. x is laid out once per call as the unit reads B
// (VNNI pairs: per block and 16 rows of x, a tile of 16 pairs of k by 16 rows); rows of W are
// split across threads, each of which configures its tiles (amx_tiles.h).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGEDLLM_AMX_EXACT 1
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "amx_tiles.h"

namespace pagedllm_amx {

constexpr int kAmxBlock = 32;     // weights per block (one scale), one tile's k
constexpr int kAmxW = 32;         // rows of W per step (two A tiles)
constexpr int kAmxChunk = 16;     // rows of x per B tile
constexpr int kAmxParts = 3;      // bfloat16 parts carrying a float32 exactly
// Rows of x per pass over W: its accumulators (16 KB) stay in L1 and x's layout (6 bytes a value)
// in L2 (measured, the default model's products of 512 rows: 412 ms in passes of 64, 377 of 128,
// 402 of 256).
constexpr int kAmxPassRows = 128;
constexpr int kAmxTile = 256;     // uint32 in a tile of 16 rows of 64 bytes

// A 64-byte aligned buffer of at least `floats` floats that the calling thread keeps between
// calls (one per slot).
inline float* exact_buffer(int slot, int64_t floats) {
  struct Buffer {
    float* data = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(data); }
  };
  static thread_local Buffer buffers[8];  // 0-4: exact_pass's, 5-7: the expanders'
  Buffer& b = buffers[slot];
  if (b.size < floats) {
    std::free(b.data);
    b.size = (floats + 15) / 16 * 16;
    b.data = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * b.size));
  }
  return b.data;
}

// 16 floats -> their three bfloat16 parts (v = parts[0] + parts[1] + parts[2], normal floats).
inline void split_exact(__m512 v, __m256i parts[kAmxParts]) {
  for (int p = 0; p < kAmxParts; ++p) {
    parts[p] = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    v = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(parts[p]), 16)));
  }
}

// x [rows, in_features] in B's layout: the tile of (block kt, chunk c, part p) at
// ((kt * chunks + c) * kAmxParts + p) * kAmxTile uint32, element [kk][m] the pair of bfloat16
// parts of x[16 c + m][32 kt + 2 kk .. + 1]; rows past `rows` zero. sums[(kt * chunks + c) * 16 + m]:
// x's block sums (kMin). Run by every thread of a team (its share of the blocks).
template <bool kMin>
inline void amx_layout_x(const float* x, int rows, int in_features, int chunks, uint32_t* xb, float* sums) {
  const int kt_count = in_features / kAmxBlock;
  const __m512i pair_rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(16));
  // split by blocks of k, each its own tiles: split by rows of x, the threads' stores met in
  // every line of a tile (16 rows of x side by side) and a 1-row product took 5x the time
#pragma omp for schedule(static)
  for (int kt = 0; kt < kt_count; ++kt) {
    for (int m = 0; m < chunks * kAmxChunk; ++m) {
      const int c = m / kAmxChunk, ml = m % kAmxChunk;
      uint32_t* tile = xb + static_cast<int64_t>(kt * chunks + c) * kAmxParts * kAmxTile + ml;
      if (m >= rows) {
        for (int p = 0; p < kAmxParts; ++p)
          for (int kk = 0; kk < 16; ++kk) tile[p * kAmxTile + 16 * kk] = 0;
        if (kMin) sums[(kt * chunks + c) * kAmxChunk + ml] = 0.0f;
        continue;
      }
      const float* xk = x + static_cast<int64_t>(m) * in_features + kt * kAmxBlock;
      const __m512 x0 = _mm512_loadu_ps(xk), x1 = _mm512_loadu_ps(xk + 16);
      __m256i p0[kAmxParts], p1[kAmxParts];
      split_exact(x0, p0);
      split_exact(x1, p1);
      for (int p = 0; p < kAmxParts; ++p) {
        // 32 bfloat16 in k's order are 16 pairs (2 kk, 2 kk + 1): pair kk goes to the tile's row kk
        const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(p0[p]), p1[p], 1);
        _mm512_i32scatter_epi32(tile + p * kAmxTile, pair_rows, pairs, 4);
      }
      if (kMin) sums[(kt * chunks + c) * kAmxChunk + ml] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    }
  }
}

// One pass: up to kAmxPassRows rows of x. expand(n0, nw, a, d, m): rows n0 .. n0 + nw - 1 of W
// (nw <= kAmxW): their q as bfloat16 at a + j * in_features, their d and m per block at
// d + j * kt_count, m + j * kt_count (m: kMin only).
template <bool kMin, class Expand>
void exact_pass(float* y, const float* x, int rows, int out_features, int in_features, int num_threads, Expand& expand) {
  const int kt_count = in_features / kAmxBlock, chunks = (rows + kAmxChunk - 1) / kAmxChunk;
  uint32_t* xb = reinterpret_cast<uint32_t*>(exact_buffer(0, static_cast<int64_t>(kt_count) * chunks * kAmxParts * kAmxTile));
  float* sums = exact_buffer(1, static_cast<int64_t>(kt_count) * chunks * kAmxChunk);
  const int w_steps = (out_features + kAmxW - 1) / kAmxW;
#pragma omp parallel num_threads(num_threads)
  {
    amx_layout_x<kMin>(x, rows, in_features, chunks, xb, sums);  // (ends in the team's barrier)
    uint16_t* a = reinterpret_cast<uint16_t*>(exact_buffer(2, static_cast<int64_t>(kAmxW) * in_features / 2));
    float* acc = exact_buffer(3, chunks * kAmxW * kAmxChunk);
    float* d = exact_buffer(4, 2 * static_cast<int64_t>(kAmxW) * kt_count);
    float* mn = d + static_cast<int64_t>(kAmxW) * kt_count;
    alignas(64) float c[2 * kAmxTile];
    const TileScope tiles;  // 0-1: C (16 rows of W x 16 of x), 4-5: A (16 rows of W x 32 k), 6-7: B
#pragma omp for schedule(static)
    for (int step = 0; step < w_steps; ++step) {
      const int n0 = step * kAmxW, nw = out_features - n0 < kAmxW ? out_features - n0 : kAmxW;
      std::memset(acc, 0, sizeof(float) * chunks * kAmxW * kAmxChunk);
      if (nw < kAmxW) std::memset(a + nw * in_features, 0, sizeof(uint16_t) * (kAmxW - nw) * in_features);
      expand(n0, nw, a, d, mn);
      for (int kt = 0; kt < kt_count; ++kt) {
        _tile_loadd(4, a + kt * kAmxBlock, 2 * in_features);
        _tile_loadd(5, a + 16 * in_features + kt * kAmxBlock, 2 * in_features);
        for (int ch = 0; ch < chunks; ++ch) {
          const uint32_t* b = xb + static_cast<int64_t>(kt * chunks + ch) * kAmxParts * kAmxTile;
          _tile_zero(0);
          _tile_zero(1);
          _tile_loadd(6, b, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          _tile_loadd(7, b + kAmxTile, 64);
          _tile_dpbf16ps(0, 4, 7);
          _tile_dpbf16ps(1, 5, 7);
          _tile_loadd(6, b + 2 * kAmxTile, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          _tile_stored(0, c, 64);
          _tile_stored(1, c + kAmxTile, 64);
          float* __restrict accs = acc + ch * kAmxW * kAmxChunk;
          const float* __restrict dk = d + kt;
          const float* __restrict mk = mn + kt;
          const __m512 s = kMin ? _mm512_loadu_ps(sums + (kt * chunks + ch) * kAmxChunk) : _mm512_setzero_ps();
          for (int j = 0; j < nw; ++j) {
            __m512 t = _mm512_fmadd_ps(_mm512_load_ps(c + j * kAmxChunk), _mm512_set1_ps(dk[j * kt_count]),
                                       _mm512_load_ps(accs + j * kAmxChunk));
            if (kMin) t = _mm512_fmadd_ps(s, _mm512_set1_ps(mk[j * kt_count]), t);
            _mm512_store_ps(accs + j * kAmxChunk, t);
          }
        }
      }
      for (int m = 0; m < rows; ++m) {
        const float* am = acc + (m / kAmxChunk) * kAmxW * kAmxChunk + m % kAmxChunk;
        float* ym = y + static_cast<int64_t>(m) * out_features + n0;
        for (int j = 0; j < nw; ++j) ym[j] = am[j * kAmxChunk];
      }
    }
  }
}

template <bool kMin, class Expand>
void exact_matmul(float* y, const float* x, int num_rows, int out_features, int in_features, int num_threads,
                  Expand&& expand) {
  for (int r0 = 0; r0 < num_rows; r0 += kAmxPassRows) {
    const int rows = num_rows - r0 < kAmxPassRows ? num_rows - r0 : kAmxPassRows;
    exact_pass<kMin>(y + static_cast<int64_t>(r0) * out_features, x + static_cast<int64_t>(r0) * in_features, rows,
                     out_features, in_features, num_threads, expand);
  }
}

}  // namespace pagedllm_amx
#endif
