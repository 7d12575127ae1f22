// y = x W^T with W from a GGUF block quantization (Q4_1 or Q8_0), for any number of rows of x.
//
// Decoding a handful of sequences is bound by reading the weights: a float32 copy of a 135M
// parameter model is 540 MB per step. Per block of 32 weights, Q4_1 holds a scale d, a minimum
// m and 32 4-bit values q (w = d q + m); Q8_0 holds d and 32 int8 values (w = d q). At load
// time the blocks are unpacked once into their values (Q4_1: the file's 16 bytes of nibbles,
// value j in the low nibble of byte j and value j + 16 in the high one; Q8_0: one byte each) and
// float32 scales and minimums: 0.75 bytes per Q4_1 weight, against 4 for float32, and no
// float16 to convert. A few rows are bound by reading them, so the nibbles stay packed: an
// in-lane byte shuffle, a mask and a shift turn each half of a block into its 16 values.
// With AVX-512, products of up to 64 rows take a way of their own (QUANT_AVX512 below) and
// larger ones the tiled way; with AVX2, two ways by the number of rows of x:
// - a few rows (decoding a handful of sequences, below kTiledRows): each block's 32 weights are
//   expanded in registers (w = q d + m, one FMA per 8), and every row of x in a group of up to 8
//   takes them; for Q4_1, 1 to kPairRows rows of x take two rows of W at a time: two independent
//   streams of loads (at 2-4 rows, one row of W at a time took 1.3-1.9x the time, so verifying a
//   few speculative tokens cost nearly what as many decode steps do). Q8_0 keeps one row of W:
//   its four vectors a block for each of two rows left too few of the 16 registers for the
//   accumulators (the default model's Q8_0 LM head, 49152 x 576, 2 threads on a Zen 3 AVX2 VM:
//   2 rows 4.2 -> 2.2 ms, 3 rows 4.0 -> 2.6, 4 rows 4.4 -> 3.0; 1 thread, 2 rows 7.4 -> 4.0).
//   The weights are read once; the expansion is the arithmetic's overhead.
// - more rows: x is transposed into panels of 16 rows (x_i[k] for 16 i side by side), kTileW rows
//   of W at a time are expanded into a float buffer, and each expanded weight is broadcast to
//   multiply a panel's column: 12 accumulators of 8 rows of x each, no horizontal sums, and the
//   core's FMA rate (about 93 GFLOP/s of its 98 peak on one Zen 3 core, in cache). On the 2-core
//   AVX2 machine, all of a decode step's projections at 16-64 rows take about 0.8x the time of the
//   dot-product tiles (6 rows of W by 2 of x) this replaced.
// With AMX (where Linux grants the tiles), products of kAmxMinRows rows and more take its tiles
// instead, with exact operands and float32 sums (quant_amx.h). Rows of W are split across OpenMP
// threads. Math in float32.

#include <cstdint>
#include <cstring>

#include <omp.h>

#include "amx_exact.h"
#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#define QUANT_AVX2 1
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kRowGroup = 8;  // rows of x that share each expanded block (few rows)
constexpr int kPairRows = 4;  // 2 to this many rows of x (Q4_1: 1 too) take rows of W in pairs (few rows)
constexpr int kTiledRows = 8;  // from this many rows of x on, the tiled way
constexpr int kTileW = 12;  // rows of W expanded together (tiled way)
constexpr int kPanel = 16;  // rows of x per transposed panel (tiled way)
constexpr int kBlockRows = 64;  // rows of x transposed at a time (tiled way), a multiple of kPanel

// Bytes of values per row of W: Q4_1 (the type with minimums) keeps two per byte.
template <bool kNibbles>
constexpr int64_t row_bytes(int64_t in_features) {
  return kNibbles ? in_features / 2 : in_features;
}

#ifdef QUANT_AVX2
using namespace pagedllm_simd;

// A block's 32 values are expanded a part at a time: Q4_1 in two halves of 2 vectors of 8 (the
// low and high nibbles of 8 bytes), Q8_0 in one part of 4 vectors.
template <bool kNibbles>
constexpr int kPartVectors = kNibbles ? 2 : 4;

// Which 8 values of a block vector c of part h holds: Q4_1 the low (c = 0) and high (c = 1)
// nibbles of bytes 8h..8h+7, values 8h.. and 16+8h..; Q8_0 values 8c.., in order.
template <bool kNibbles>
constexpr int group_offset(int h, int c) {
  return kNibbles ? 8 * h + 16 * c : 8 * c;
}

// Part h of block b as vectors of 8 floats, vector c holding the values from group_offset(h, c)
// (see the top of the file for the layouts). Q4_1: the 8 bytes of the half are broadcast to both
// 128-bit lanes and one in-lane byte shuffle puts byte i in 32-bit lane i, whose low nibble is
// vector 0's value and high nibble vector 1's. On the AMD Zen 3 this was measured on, the
// lane-crossing zero-extension (VPMOVZXBD) this replaced took about a quarter of the 1-row
// product's time.
template <bool kSigned, bool kNibbles>
inline void load_part(__m256 q[kPartVectors<kNibbles>], const uint8_t* values, int b, int h) {
  if (kNibbles) {
    const __m256i select = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,  //
                                            4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    int64_t half;
    std::memcpy(&half, values + b * (kBlock / 2) + 8 * h, sizeof(half));
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi64x(half), select);
    q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0x0F)));
    q[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  } else {
    for (int c = 0; c < kPartVectors<kNibbles>; ++c) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(values + b * kBlock + group_offset<false>(h, c)));
      q[c] = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
    }
  }
}

// y[r * out_features + j] = x_r . w_j for R rows of x (R <= 8) and NW consecutive rows w_j of W
// (`values`, `scales`, `mins` point at the first). Each block's weights are expanded in
// registers (w = q d + m) once and taken by every row of x. With few rows each pair (r, j) keeps
// several accumulators, so that consecutive FMAs do not wait on each other; a few rows of x take
// two rows of W (`pair_group`), which gives the core two independent streams of work.
template <int R, int NW, bool kSigned, bool kMin>
inline void dot_rows(float* y, int64_t out_features, const float* x, int64_t in_features, const uint8_t* values,
                     const float* scales, const float* mins, int num_blocks) {
  constexpr int V = kPartVectors<kMin>;
  // Accumulators per pair, as the 16 vector registers allow beside the weights (the counts that
  // measured fastest on the Zen 3 test machine). The loops that set and sum them are unrolled:
  // left rolled (4 and 7 rows of x), GCC kept the accumulators in memory and stored every one of
  // them on every block, which took 1.1-1.3x the time.
  constexpr int A = R * NW == 1 || (!kMin && R == 2) ? 4 : R * NW <= 4 ? 2 : 1;
  const int64_t stride = row_bytes<kMin>(in_features);
  __m256 acc[R][NW][A];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NW; ++j)
#pragma GCC unroll 16
      for (int a = 0; a < A; ++a) acc[r][j][a] = _mm256_setzero_ps();
  for (int b = 0; b < num_blocks; ++b) {
    __m256 d[NW], m[NW];
    for (int j = 0; j < NW; ++j) {
      d[j] = _mm256_broadcast_ss(scales + j * num_blocks + b);
      m[j] = kMin ? _mm256_broadcast_ss(mins + j * num_blocks + b) : _mm256_setzero_ps();
    }
    for (int h = 0; h < 4 / V; ++h) {
      __m256 w[NW][V];
      for (int j = 0; j < NW; ++j) {
        load_part<kSigned, kMin>(w[j], values + j * stride, b, h);
        for (int c = 0; c < V; ++c) w[j][c] = kMin ? _mm256_fmadd_ps(w[j][c], d[j], m[j]) : _mm256_mul_ps(w[j][c], d[j]);
      }
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * in_features + b * kBlock;
        for (int c = 0; c < V; ++c) {
          const __m256 xv = _mm256_loadu_ps(xb + group_offset<kMin>(h, c));
          for (int j = 0; j < NW; ++j) acc[r][j][(V * h + c) % A] = _mm256_fmadd_ps(w[j][c], xv, acc[r][j][(V * h + c) % A]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < NW; ++j) {
      __m256 sum = acc[r][j][0];
#pragma GCC unroll 16
      for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[r][j][a]);
      y[r * out_features + j] = hsum(sum);
    }
}

// y[r * out_features] = x_r . w for `rows` rows of x (at most kRowGroup) and one row of W.
template <bool kSigned, bool kMin>
inline void row_group(float* y, int64_t out_features, const float* x, int64_t in_features, const uint8_t* values,
                      const float* scales, const float* mins, int num_blocks, int rows) {
  switch (rows) {
    case 1: return dot_rows<1, 1, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 2: return dot_rows<2, 1, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 3: return dot_rows<3, 1, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 4: return dot_rows<4, 1, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 5: return dot_rows<5, 1, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 6: return dot_rows<6, 1, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 7: return dot_rows<7, 1, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    default: return dot_rows<8, 1, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
  }
}


// y[r * out_features + j] = x_r . w_j for `rows` rows of x (1 to kPairRows) and two rows w_j of W
// (Q4_1 only: see the top of the file).
template <bool kSigned, bool kMin>
inline void pair_group(float* y, int64_t out_features, const float* x, int64_t in_features, const uint8_t* values,
                       const float* scales, const float* mins, int num_blocks, int rows) {
  switch (rows) {
    case 1: return dot_rows<1, 2, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 2: return dot_rows<2, 2, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    case 3: return dot_rows<3, 2, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
    default: return dot_rows<4, 2, kSigned, kMin>(y, out_features, x, in_features, values, scales, mins, num_blocks);
  }
}

// Expands one row of W (num_blocks blocks) into floats.
template <bool kSigned, bool kMin>
inline void expand_row(float* dst, const uint8_t* values, const float* scales, const float* mins, int num_blocks) {
  for (int b = 0; b < num_blocks; ++b) {
    const __m256 d = _mm256_broadcast_ss(scales + b);
    const __m256 m = kMin ? _mm256_broadcast_ss(mins + b) : _mm256_setzero_ps();
    for (int h = 0; h < 4 / kPartVectors<kMin>; ++h) {
      __m256 q[kPartVectors<kMin>];
      load_part<kSigned, kMin>(q, values, b, h);
      for (int c = 0; c < kPartVectors<kMin>; ++c)
        _mm256_store_ps(dst + b * kBlock + group_offset<kMin>(h, c), kMin ? _mm256_fmadd_ps(q[c], d, m) : _mm256_mul_ps(q[c], d));
    }
  }
}

// Rows [0, rows) of x (rows <= width) transposed into a panel: panel[k * width + i] = x_i[k],
// zero past `rows`; width 8 or 16. Eight rows of x at a time, in 8x8 blocks.
inline void transpose_panel(float* panel, const float* x, int64_t in_features, int rows, int width) {
  for (int i0 = 0; i0 < width; i0 += 8)
    for (int64_t k = 0; k < in_features; k += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = i0 + i < rows ? _mm256_loadu_ps(x + (i0 + i) * in_features + k) : _mm256_setzero_ps();
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 s[8] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                           _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE),
                           _mm256_shuffle_ps(t4, t6, 0x44), _mm256_shuffle_ps(t4, t6, 0xEE),
                           _mm256_shuffle_ps(t5, t7, 0x44), _mm256_shuffle_ps(t5, t7, 0xEE)};
      for (int c = 0; c < 4; ++c) {  // column c of the block from s[c] (rows 0-3) and s[c + 4] (rows 4-7)
        _mm256_store_ps(panel + (k + c) * width + i0, _mm256_permute2f128_ps(s[c], s[c + 4], 0x20));
        _mm256_store_ps(panel + (k + c + 4) * width + i0, _mm256_permute2f128_ps(s[c], s[c + 4], 0x31));
      }
    }
}

// c[j * 8 * XV + i] = w_j . x_i for J expanded rows w_j of W (w: rows of in_features floats) and
// the 8 * XV rows of x in a transposed panel: each w_j[k] is broadcast and multiplies XV vectors
// of the panel's column k. Every (j, i) is one FMA chain over k in order, so a row's result does
// not depend on which rows of x share its panel.
template <int J, int XV>
inline void broadcast_tile(float* c, const float* w, int64_t in_features, const float* panel) {
  __m256 acc[J][XV];
#pragma GCC unroll 12
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < XV; ++v) acc[j][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < in_features; ++k) {
    __m256 xv[XV];
    for (int v = 0; v < XV; ++v) xv[v] = _mm256_load_ps(panel + k * 8 * XV + 8 * v);
#pragma GCC unroll 12
    for (int j = 0; j < J; ++j) {
      const __m256 wj = _mm256_broadcast_ss(w + j * in_features + k);
      for (int v = 0; v < XV; ++v) acc[j][v] = _mm256_fmadd_ps(wj, xv[v], acc[j][v]);
    }
  }
#pragma GCC unroll 12
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < XV; ++v) _mm256_store_ps(c + j * 8 * XV + 8 * v, acc[j][v]);
}

// A 64-byte aligned buffer of at least `floats` floats that the calling thread keeps between
// calls (one per slot): allocating the tiled way's buffers on every call cost about a tenth of
// a 64-row step's projections (fresh pages fault in), measured on the 2-core AVX2 machine.
inline float* thread_buffer(int slot, int64_t floats) {
  struct Buffer {
    float* data = nullptr;
    int64_t size = 0;
    ~Buffer() { _mm_free(data); }
  };
  static thread_local Buffer buffers[2];
  Buffer& b = buffers[slot];
  if (b.size < floats) {
    _mm_free(b.data);
    b.data = static_cast<float*>(_mm_malloc(sizeof(float) * floats, 64));
    b.size = floats;
  }
  return b.data;
}

// The tiled way: y = x W^T. Blocks of kBlockRows rows of x are transposed into panels of 16 rows
// (the last of 8 when at most 8 remain), shared by the threads; each thread expands kTileW rows of
// W at a time into its buffer (the last tile zero-padded) and runs every panel over them: 16-row
// panels in two 6-row tiles (12 accumulators, 2 panel loads and 6 broadcasts per 12 FMAs), 8-row
// panels in one 12-row tile.
template <bool kSigned, bool kMin>
void tiled_matmul(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins,
                  int num_rows, int out_features, int in_features, int num_threads) {
  const int num_blocks = in_features / kBlock;
  const int num_tiles = (out_features + kTileW - 1) / kTileW;
  float* panels = thread_buffer(0, static_cast<int64_t>(kBlockRows) * in_features);
#pragma omp parallel num_threads(num_threads)
  {
    float* w = thread_buffer(1, static_cast<int64_t>(kTileW) * in_features);
    alignas(32) float c[kTileW * kPanel];
    for (int m0 = 0; m0 < num_rows; m0 += kBlockRows) {
      const int rows = num_rows - m0 < kBlockRows ? num_rows - m0 : kBlockRows;
      const int num_panels = (rows + kPanel - 1) / kPanel;
      const auto panel_rows = [&](int p) { return rows - kPanel * p < kPanel ? rows - kPanel * p : kPanel; };
      const auto panel_width = [&](int p) { return panel_rows(p) > 8 ? 16 : 8; };
#pragma omp for schedule(static)
      for (int p = 0; p < num_panels; ++p)
        transpose_panel(panels + static_cast<int64_t>(kPanel) * p * in_features,
                        x + static_cast<int64_t>(m0 + kPanel * p) * in_features, in_features, panel_rows(p),
                        panel_width(p));
#pragma omp for schedule(static)
      for (int t = 0; t < num_tiles; ++t) {
        const int64_t n0 = static_cast<int64_t>(t) * kTileW;
        const int tile_rows = out_features - n0 < kTileW ? static_cast<int>(out_features - n0) : kTileW;
        for (int j = 0; j < tile_rows; ++j)
          expand_row<kSigned, kMin>(w + j * in_features, values + (n0 + j) * row_bytes<kMin>(in_features),
                                    scales + (n0 + j) * num_blocks, kMin ? mins + (n0 + j) * num_blocks : nullptr,
                                    num_blocks);
        if (tile_rows < kTileW)  // the last tile, part empty
          std::memset(w + tile_rows * in_features, 0, sizeof(float) * (kTileW - tile_rows) * in_features);
        for (int p = 0; p < num_panels; ++p) {
          const float* panel = panels + static_cast<int64_t>(kPanel) * p * in_features;
          const int here = panel_rows(p), width = panel_width(p);
          if (width == 16) {
            broadcast_tile<kTileW / 2, 2>(c, w, in_features, panel);
            broadcast_tile<kTileW / 2, 2>(c + kTileW / 2 * 16, w + kTileW / 2 * in_features, in_features, panel);
          } else {
            broadcast_tile<kTileW, 1>(c, w, in_features, panel);
          }
          float* yp = y + static_cast<int64_t>(m0 + kPanel * p) * out_features + n0;
          for (int i = 0; i < here; ++i)
            for (int j = 0; j < tile_rows; ++j) yp[static_cast<int64_t>(i) * out_features + j] = c[j * width + i];
        }
      }
    }
  }
}
#define QUANT_TILED 1

#ifdef __AVX512F__
// With AVX-512 (32 registers of 16 floats), every product of up to kWideRows rows of x expands
// each block of W once in registers: a block is two vectors (values 0-15 and 16-31: Q4_1's low
// and high nibbles of its 16 bytes, in order), taken by up to kWideGroup rows of x, two loads and
// four FMAs each for two rows of W (16 accumulators at 8 rows). More rows of x run in balanced
// groups of at most kWideGroup over the same two rows of W, expanded once into an L1 buffer for
// all of them. On the 2-core AVX-512 Xeon (Sapphire Rapids), 1 thread, the default model's 121
// projections of a step (ms, this way against the AVX2 ways on the same machine): 1 row 15.4
// (17.8), 2 rows 16.8 (19.6), 4 rows 19.5 (24.4), 5 rows 20.8 (37.4), 8 rows 26.7 (41.1), 9 rows
// 29.8 (60.0), 12 rows 34.3 (60.4), 16 rows 41.2 (61.1), 64 rows 162 (tiled 198). From 5 rows on
// it is bound by the two vector ports: expanding a block takes about 7 of the 46 operations a
// pair of rows of W and 8 rows of x need per block (without it, 8 rows took 18.7 ms; looking the
// 16 Q4_1 values up with VPERMPS, 5 operations, measured no faster), and the horizontal sums
// at the end measured no slower than a transposed sum of 16 accumulators.
#define QUANT_AVX512 1
constexpr int kWideRows = 64;  // up to this many rows of x, the AVX-512 way (the tiled way above)
constexpr int kWideGroup = 8;  // rows of x that share each expanded block (at 10, accumulators spilled)
constexpr int kPrefetchBlocks = 8;  // blocks of W ahead that are prefetched

// Block b of a row of W as two vectors of 16 floats, values 0-15 and 16-31 (w = q d + m).
template <bool kSigned, bool kMin>
inline void load_block_wide(__m512 w[2], const uint8_t* values, const float* scales, const float* mins, int b) {
  __m512i q0, q1;
  if (kMin) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values + b * 16)));
    q0 = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F));
    q1 = _mm512_srli_epi32(bytes, 4);
  } else {
    const __m128i* v = reinterpret_cast<const __m128i*>(values + b * kBlock);
    q0 = kSigned ? _mm512_cvtepi8_epi32(_mm_loadu_si128(v)) : _mm512_cvtepu8_epi32(_mm_loadu_si128(v));
    q1 = kSigned ? _mm512_cvtepi8_epi32(_mm_loadu_si128(v + 1)) : _mm512_cvtepu8_epi32(_mm_loadu_si128(v + 1));
  }
  const __m512 d = _mm512_set1_ps(scales[b]);
  if (kMin) {
    const __m512 m = _mm512_set1_ps(mins[b]);
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), d, m);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d, m);
  } else {
    w[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d);
    w[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d);
  }
}

// y[r * out_features + j] = x_r . w_j for R rows of x (R <= kWideGroup) and NW consecutive rows
// w_j of W, each block of W expanded in registers once (or loaded, kExpanded). One accumulator
// per pair (r, j), so that each output is one FMA chain over the blocks in order and its result
// does not depend on the other rows of x (two per pair took about 2% less time at 1-4 rows).
template <int R, int NW, bool kSigned, bool kMin, bool kExpanded>
inline void dot_rows_wide(float* y, int64_t out_features, const float* x, int64_t in_features, const uint8_t* values,
                          const float* scales, const float* mins, int num_blocks, const float* expanded) {
  constexpr int kBlockBytes = kMin ? kBlock / 2 : kBlock;
  const int64_t stride = row_bytes<kMin>(in_features);
  __m512 acc[R][NW];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NW; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int b = 0; b < num_blocks; ++b) {
    __m512 w[NW][2];
#pragma GCC unroll 2
    for (int j = 0; j < NW; ++j) {
      if (kExpanded) {
        w[j][0] = _mm512_load_ps(expanded + j * in_features + b * kBlock);
        w[j][1] = _mm512_load_ps(expanded + j * in_features + b * kBlock + 16);
        continue;
      }
      if (b % (64 / kBlockBytes) == 0)  // once per cache line
        _mm_prefetch(reinterpret_cast<const char*>(values + j * stride + (b + kPrefetchBlocks) * kBlockBytes), _MM_HINT_T0);
      load_block_wide<kSigned, kMin>(w[j], values + j * stride, scales + j * num_blocks,
                                     kMin ? mins + j * num_blocks : nullptr, b);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * in_features + b * kBlock;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
#pragma GCC unroll 2
      for (int j = 0; j < NW; ++j) {
        acc[r][j] = _mm512_fmadd_ps(w[j][1], x1, _mm512_fmadd_ps(w[j][0], x0, acc[r][j]));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int j = 0; j < NW; ++j)
      y[r * out_features + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// dot_rows_wide for `rows` rows of x (1 to kWideGroup); `expanded`: the NW rows of W expanded
// (expand_rows_wide), else null.
template <int NW, bool kSigned, bool kMin>
inline void wide_group(float* y, int64_t out_features, const float* x, int64_t in_features, const uint8_t* values,
                       const float* scales, const float* mins, int num_blocks, int rows, const float* expanded) {
#define PAGEDLLM_WIDE_CASE(R)                                                                                   \
  case R:                                                                                                       \
    return expanded ? dot_rows_wide<R, NW, kSigned, kMin, true>(y, out_features, x, in_features, values, scales, \
                                                                 mins, num_blocks, expanded)                     \
                    : dot_rows_wide<R, NW, kSigned, kMin, false>(y, out_features, x, in_features, values, scales, \
                                                                  mins, num_blocks, nullptr);
  switch (rows) {
    PAGEDLLM_WIDE_CASE(1) PAGEDLLM_WIDE_CASE(2) PAGEDLLM_WIDE_CASE(3) PAGEDLLM_WIDE_CASE(4)
    PAGEDLLM_WIDE_CASE(5) PAGEDLLM_WIDE_CASE(6) PAGEDLLM_WIDE_CASE(7) default: PAGEDLLM_WIDE_CASE(8)
  }
#undef PAGEDLLM_WIDE_CASE
}
static_assert(kWideGroup == 8, "wide_group's cases");

// Rows [0, nw) of W (from `values`, `scales`, `mins`) expanded into w: nw rows of in_features floats.
template <bool kSigned, bool kMin>
inline void expand_rows_wide(float* w, int nw, int64_t in_features, const uint8_t* values, const float* scales,
                             const float* mins, int num_blocks) {
  for (int j = 0; j < nw; ++j)
    for (int b = 0; b < num_blocks; ++b) {
      __m512 v[2];
      load_block_wide<kSigned, kMin>(v, values + j * row_bytes<kMin>(in_features), scales + j * num_blocks,
                                     kMin ? mins + j * num_blocks : nullptr, b);
      _mm512_store_ps(w + j * in_features + b * kBlock, v[0]);
      _mm512_store_ps(w + j * in_features + b * kBlock + 16, v[1]);
    }
}

// The AVX-512 way for 1 to kWideRows rows of x: rows of W in pairs (the odd last one alone),
// split across the threads; rows of x in balanced groups of at most kWideGroup.
template <bool kSigned, bool kMin>
void wide_matmul(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins,
                 int num_rows, int out_features, int in_features, int num_threads) {
  const int num_blocks = in_features / kBlock;
  const int num_pairs = (out_features + 1) / 2;
  const int num_groups = (num_rows + kWideGroup - 1) / kWideGroup;
#pragma omp parallel num_threads(num_threads)
  {
    // With several groups, the two rows of W are expanded once, for all of them (in L1).
    float* expanded = num_groups > 1 ? thread_buffer(1, 2 * static_cast<int64_t>(in_features)) : nullptr;
#pragma omp for schedule(static)
    for (int p = 0; p < num_pairs; ++p) {
      const int64_t n = 2 * static_cast<int64_t>(p);
      const int nw = n + 1 < out_features ? 2 : 1;
      const uint8_t* v = values + n * row_bytes<kMin>(in_features);
      const float* d = scales + n * num_blocks;
      const float* m = kMin ? mins + n * num_blocks : nullptr;
      if (expanded) expand_rows_wide<kSigned, kMin>(expanded, nw, in_features, v, d, m, num_blocks);
      for (int g = 0, r0 = 0; g < num_groups; ++g) {
        const int rows = (num_rows - r0) / (num_groups - g);
        float* yg = y + r0 * static_cast<int64_t>(out_features) + n;
        const float* xg = x + r0 * static_cast<int64_t>(in_features);
        if (nw == 2)
          wide_group<2, kSigned, kMin>(yg, out_features, xg, in_features, v, d, m, num_blocks, rows, expanded);
        else
          wide_group<1, kSigned, kMin>(yg, out_features, xg, in_features, v, d, m, num_blocks, rows, expanded);
        r0 += rows;
      }
    }
  }
}
#endif

#include "quant_amx.h"

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
#ifdef QUANT_AMX
  if (num_rows >= kAmxMinRows && amx_on()) {
    amx_matmul<kSigned, kMin>(y, x, values, scales, mins, num_rows, out_features, in_features, num_threads);
    return;
  }
#endif
#ifdef QUANT_AVX512
  if (num_rows <= kWideRows) {
    wide_matmul<kSigned, kMin>(y, x, values, scales, mins, num_rows, out_features, in_features, num_threads);
    return;
  }
#endif
#ifdef QUANT_TILED
  if (num_rows >= kTiledRows) {
    tiled_matmul<kSigned, kMin>(y, x, values, scales, mins, num_rows, out_features, in_features, num_threads);
    return;
  }
  if (kMin && num_rows <= kPairRows) {  // rows of W in pairs (see dot_rows)
    const int num_blocks = in_features / kBlock;
    const int num_pairs = out_features / 2;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
      for (int p = 0; p < num_pairs; ++p) {
        const int64_t n = 2 * static_cast<int64_t>(p);
        pair_group<kSigned, kMin>(y + n, out_features, x, in_features, values + n * row_bytes<kMin>(in_features),
                                  scales + n * num_blocks, kMin ? mins + n * num_blocks : nullptr, num_blocks, num_rows);
      }
#pragma omp single
      if (out_features % 2 != 0)
        direct_row<kSigned, kMin>(y, x, values, scales, mins, num_rows, out_features, in_features, out_features - 1);
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

// Which way the products of a few rows take on this build: 0 portable C++, 1 AVX2 (few-rows way
// below kTiledRows, tiled from there), 2 AVX-512 (the wide way up to kWideRows, tiled above), 3
// AMX (quant_amx.h from kAmxMinRows rows on, the AVX-512 way below).
int quant_matmul_isa() {
#if defined(QUANT_AMX)
  if (amx_on()) return 3;
#endif
#if defined(QUANT_AVX512)
  return 2;
#elif defined(QUANT_AVX2)
  return 1;
#else
  return 0;
#endif
}

// The fewest rows of x whose products take the AMX way now; 0 if none do.
int quant_matmul_amx_min_rows() {
#if defined(QUANT_AMX)
  return amx_on() ? kAmxMinRows : 0;
#else
  return 0;
#endif
}

// Turns the AMX way on (1, where this build has it and Linux grants the tiles) or off (0: the
// AVX-512 way; tests, benchmarks). Returns 0, or -1 (unchanged) if it cannot be turned on.
int quant_matmul_set_amx(int on) {
#if defined(QUANT_AMX)
  if (on && !amx_permitted()) return -1;
  g_amx = on ? 1 : 0;
  return 0;
#else
  return on ? -1 : 0;
#endif
}

}  // extern "C"
