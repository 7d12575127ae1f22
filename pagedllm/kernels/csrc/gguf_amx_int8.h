// The int8 way's products of many rows of x on AMX (AMX-INT8: TDPBUSD, unsigned by signed bytes
// into int32 tiles), with gguf_amx.h's tile configuration and permission and the VNNI way's block
// decoding (gguf_vnni_int8.h's int8_chunks_avx512). Self-contained; in namespace gguf.
//
// The same numbers as the AVX-512 VNNI int8 way: a weight is s u - c over each group of G
// weights (u its unsigned value; s, c per group: G = 16 for Q6_K, whose scales change every 16,
// 32 for the others), x is quantized per block of 32 (qx, dx), so
//   y[r][n] = sum_g s[n][g] dx[r][g] sum_{k in g} u[n][k] qx[r][k] - sum_g c[n][g] xs[r][g].
// The integer sums are exact on either unit; only the float sums' order differs.
//
// The VNNI way spends four vector instructions per 64 products and row of x (the product, its
// conversion, the scale, the accumulation); here one TDPBUSD computes a group's 16 x 16 x G
// products for 16 rows of W and 16 rows of x, and the vector unit only scales and adds its
// 16 x 16 sums: four instructions per 16 G products. 16 rows of W are decoded at a time
// (int8_chunks_avx512, the VNNI way's registers stored as A's rows: natural order) and meet every
// tile of 16 rows of x; x is laid out once per call as the unit reads B (VNNI: per 16 rows of x,
// 4 bytes of k each, k / 4 rows). Rows of W are split across threads; each thread configures its
// tiles and gives back another library's. Q4_K and Q5_K take gguf_amx_q8k.h's way instead (x per
// 256, a super-block's sums kept in the tiles); this one serves the legacy types and Q6_K.

#pragma once

#include <cstdint>
#include <cstring>

#include <omp.h>

#include "gguf_amx.h"
#include "gguf_blocks.h"
#include "gguf_common.h"
#include "gguf_int8.h"
#include "gguf_vnni_int8.h"

namespace gguf {

#if defined(GGUF_AMX) && defined(__AMX_INT8__)
#define GGUF_AMX_INT8 1

// Tiles 0-3: C (16 rows of W x 16 rows of x, int32), 4-5: A (16 rows of W x G bytes of u),
// 6-7: B (G / 4 rows x 16 rows of x x 4 bytes of qx).
template <int G>
inline TileConfig amx_int8_tiles() {
  TileConfig config;
  for (int t = 0; t < 4; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  for (int t = 4; t < 6; ++t) {
    config.colsb[t] = G;
    config.rows[t] = 16;
  }
  for (int t = 6; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = G / 4;
  }
  return config;
}

// From this many rows of x on, the int8 way runs on the tiles: below, the tiles' fixed cost per
// group of W (a product, a store of its sums, their scaling) is more than VNNI's per row.
// Measured on one core of a 2-core Xeon VM, a Llama-3.2-1B layer's seven projections: Q4_K at 4,
// 5, 6, 12 rows 5.7, 7.1, 8.3, 17.0 ms by VNNI, 6.8, 7.1, 7.2, 8.2 on the tiles; Q6_K (groups of
// 16: twice the tile work) at 8, 10, 12 rows 10.4, 15.4, 17.8 by VNNI, 12.7, 13.4, 13.4.
inline int amx_int8_min_rows(int qtype) { return qtype == kQ6_K ? 10 : 5; }

constexpr int kAmxGroupsPerStep = 4;  // groups a step: two tiles' products while the other two's sums are scaled

// Groups g and g + 1 of 16 rows of W (u: [16][kp] bytes) by a tile of x (bt, B's layout) into
// tiles C0 and C1: a macro, as GCC's tile intrinsics take the tiles' numbers as literal text.
#define GGUF_AMX_INT8_PRODUCTS(C0, C1, u, bt, g, kp) \
  do {                                               \
    _tile_zero(C0);                                  \
    _tile_zero(C1);                                  \
    _tile_loadd(4, (u) + (g) * G, kp);               \
    _tile_loadd(6, (bt) + (g) * (G / 4) * 16, 64);   \
    _tile_dpbusd(C0, 4, 6);                          \
    _tile_loadd(5, (u) + ((g) + 1) * G, kp);         \
    _tile_loadd(7, (bt) + ((g) + 1) * (G / 4) * 16, 64); \
    _tile_dpbusd(C1, 5, 7);                          \
  } while (0)

template <int T, int G>
void amx_int8_matmul_type(float* y, const uint8_t* packed, int64_t num_rows, int64_t out_features, int64_t in_features,
                          const Int8Rows& a, int num_threads) {
  const TypeSize t = type_size(T);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const int64_t groups16 = a.padded / 16;
  // k padded to whole steps of groups (zeros in u, s, c and qx past in_features)
  const int64_t kp = round_up(a.padded, kAmxGroupsPerStep * G), gcount = kp / G;
  const int64_t x_tiles = (num_rows + 15) / 16, n_tiles = (out_features + 15) / 16;
  // x as B tiles: [x tile][k / 4][16 rows] int32 (4 bytes of k); per x tile and group, the rows'
  // dx and the group's xs (dx times the sum of its qx), 16 floats each.
  uint32_t* xb = static_cast<uint32_t*>(thread_buffer(7, sizeof(uint32_t) * x_tiles * (kp / 4) * 16));
  float* dxt = static_cast<float*>(thread_buffer(8, sizeof(float) * 2 * x_tiles * gcount * 16));
  float* xst = dxt + x_tiles * gcount * 16;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < x_tiles * 16; ++m) {
      const int64_t mt = m / 16, ml = m % 16;
      uint32_t* b = xb + mt * (kp / 4) * 16 + ml;
      float* d = dxt + mt * gcount * 16 + ml;
      float* s = xst + mt * gcount * 16 + ml;
      if (m < num_rows) {
        const uint32_t* q = reinterpret_cast<const uint32_t*>(a.qx + m * a.padded);
        for (int64_t k4 = 0; k4 < a.padded / 4; ++k4) b[16 * k4] = q[k4];
        for (int64_t k4 = a.padded / 4; k4 < kp / 4; ++k4) b[16 * k4] = 0;
        const float* d16 = a.dx16 + m * groups16;
        const float* s16 = a.xs16 + m * groups16;
        for (int64_t g = 0; g < gcount; ++g) {
          float dg = 0.0f, sg = 0.0f;
          for (int64_t h = g * (G / 16); h < (g + 1) * (G / 16) && h < groups16; ++h) {
            dg = d16[h];  // one scale per 32 of x: the same over the group
            sg += s16[h];
          }
          d[16 * g] = dg;
          s[16 * g] = sg;
        }
      } else {
        for (int64_t k4 = 0; k4 < kp / 4; ++k4) b[16 * k4] = 0;
        for (int64_t g = 0; g < gcount; ++g) d[16 * g] = s[16 * g] = 0.0f;
      }
    }  // (ends in the team's barrier)

    // 16 rows of W: u [16][kp] bytes, s [16][gcount], c16 [16][kp / 16] (the VNNI way's constants
    // per 16, equal within a group of 32)
    uint8_t* u = static_cast<uint8_t*>(thread_buffer(9, 16 * kp + sizeof(float) * 16 * (gcount + kp / 16)));
    float* sw = reinterpret_cast<float*>(u + 16 * kp);
    float* cw = sw + 16 * gcount;
    // Zero what no row's decoding writes: k from the row's end to kp (a call of another shape
    // may have left values there).
    const int64_t written_groups = a.padded / G, written_c16 = in_features / 16;
    for (int n = 0; n < 16; ++n) {
      std::memset(u + n * kp + a.padded, 0, kp - a.padded);
      std::memset(sw + n * gcount + written_groups, 0, sizeof(float) * (gcount - written_groups));
      std::memset(cw + n * (kp / 16) + written_c16, 0, sizeof(float) * (kp / 16 - written_c16));
    }
    alignas(64) int32_t c[kAmxGroupsPerStep][16 * 16];
    alignas(64) float out[16 * 16];
    const TileScope tiles(amx_int8_tiles<G>());
    const __m512i lanes_of_groups = G == 16 ? _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
                                            : _mm512_setr_epi32(0, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
#pragma omp for schedule(static)
    for (int64_t nt = 0; nt < n_tiles; ++nt) {
      const int64_t n0 = 16 * nt;
      const int n_here = out_features - n0 < 16 ? static_cast<int>(out_features - n0) : 16;
      for (int n = 0; n < n_here; ++n) {
        uint8_t* un = u + n * kp;
        float* sn = sw + n * gcount;
        int8_chunks_avx512<T>(packed + (n0 + n) * row_bytes, num_blocks, cw + n * (kp / 16),
                              [&](int64_t k, __m512i v, __m512 s) {
                                _mm512_storeu_si512(un + k, v);
                                const __m512 per_group = _mm512_permutexvar_ps(lanes_of_groups, s);
                                if constexpr (G == 16)
                                  _mm_storeu_ps(sn + k / 16, _mm512_castps512_ps128(per_group));
                                else
                                  _mm_storel_pi(reinterpret_cast<__m64*>(sn + k / 32), _mm512_castps512_ps128(per_group));
                              });
      }
      for (int n = n_here; n < 16; ++n) {  // a last partial tile: rows of zeros
        std::memset(u + n * kp, 0, kp);
        std::memset(sw + n * gcount, 0, sizeof(float) * gcount);
        std::memset(cw + n * (kp / 16), 0, sizeof(float) * (kp / 16));
      }
      for (int64_t mt = 0; mt < x_tiles; ++mt) {
        const uint32_t* bt = xb + mt * (kp / 4) * 16;
        const float* dt = dxt + mt * gcount * 16;
        const float* st = xst + mt * gcount * 16;
        __m512 acc[16];
        for (int n = 0; n < 16; ++n) acc[n] = _mm512_setzero_ps();
        // Two groups' products into tiles 0-1 while the sums of the two before them (tiles 2-3)
        // are scaled, and the other way round: the vector unit's work overlaps the tile unit's.
        const auto products01 = [&](int64_t g) { GGUF_AMX_INT8_PRODUCTS(0, 1, u, bt, g, kp); };
        const auto products23 = [&](int64_t g) { GGUF_AMX_INT8_PRODUCTS(2, 3, u, bt, g, kp); };
        // c[j][n][m]: group g + j, row n0 + n of W, row 16 mt + m of x
        const auto scale = [&](int64_t g, int32_t (*cj)[16 * 16]) {
#pragma GCC unroll 2
          for (int j = 0; j < 2; ++j) {
            const __m512 dx = _mm512_loadu_ps(dt + 16 * (g + j)), xs = _mm512_loadu_ps(st + 16 * (g + j));
#pragma GCC unroll 16
            for (int n = 0; n < 16; ++n) {
              const __m512 sums = _mm512_cvtepi32_ps(_mm512_load_si512(cj[j] + 16 * n));
              acc[n] = _mm512_fmadd_ps(sums, _mm512_mul_ps(dx, _mm512_set1_ps(sw[n * gcount + g + j])), acc[n]);
              acc[n] = _mm512_fnmadd_ps(_mm512_set1_ps(cw[n * (kp / 16) + (g + j) * (G / 16)]), xs, acc[n]);
            }
          }
        };
        products01(0);
        for (int64_t g0 = 0; g0 < gcount; g0 += kAmxGroupsPerStep) {
          products23(g0 + 2);
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          scale(g0, c);
          if (g0 + kAmxGroupsPerStep < gcount) products01(g0 + kAmxGroupsPerStep);
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
          scale(g0 + 2, c + 2);
        }
        for (int n = 0; n < 16; ++n) _mm512_store_ps(out + 16 * n, acc[n]);
        const int m_here = num_rows - 16 * mt < 16 ? static_cast<int>(num_rows - 16 * mt) : 16;
        for (int m = 0; m < m_here; ++m) {
          float* yr = y + (16 * mt + m) * out_features + n0;
          for (int n = 0; n < n_here; ++n) yr[n] = out[16 * n + m];
        }
      }
    }
  }
}

#undef GGUF_AMX_INT8_PRODUCTS

void amx_int8_matmul(int qtype, float* y, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                     int64_t in_features, const Int8Rows& a, int num_threads) {
  switch (qtype) {
    case kQ4_0: return amx_int8_matmul_type<kQ4_0, 32>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ4_1: return amx_int8_matmul_type<kQ4_1, 32>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ5_0: return amx_int8_matmul_type<kQ5_0, 32>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ5_1: return amx_int8_matmul_type<kQ5_1, 32>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ8_0: return amx_int8_matmul_type<kQ8_0, 32>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ4_K: return amx_int8_matmul_type<kQ4_K, 32>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ5_K: return amx_int8_matmul_type<kQ5_K, 32>(y, packed, num_rows, out_features, in_features, a, num_threads);
    case kQ6_K: return amx_int8_matmul_type<kQ6_K, 16>(y, packed, num_rows, out_features, in_features, a, num_threads);
    default: return;
  }
}
#endif

}  // namespace gguf
