// Q4_K and Q5_K int8 products of many rows of x on AMX-INT8, llama.cpp's Q8_K way: x quantized
// per super-block of 256 (quantize_activations with activation_block), so each sub-block's 6-bit
// scale applies to an integer sum and a super-block's 256 products stay in the tiles. With
// gguf_amx_int8.h's tile permission and B layout and the K-quants' decoding (gguf_vnni_blocks.h's
// k4_scales_mins, k4_chunk). Self-contained; in namespace gguf.
//
// A weight of sub-block j is d sc_j u - dmin m_j (u its unsigned value, sc_j and m_j 6 bits),
// x = dx qx over the super-block, so
//   y[r][n] = sum_sb d[n] dx[r] sum_j sc_j sum_{k in j} u qx - sum_g dmin m_g xs[r][g]
// (xs: dx times the sum of a sub-block's qx). sc_j u is at most 63 x 31: not a byte, so W's
// operand is split: A1 = u (sc_j & 7) and A2 = u (sc_j >> 3), each at most 7 x 31 = 217, and
// sum_j sc_j sum u qx = C1 + 8 C2, C1 and C2 the TDPBUSD sums of A1 and A2 over the super-block
// (four products of depth 64 each, into two int32 tiles). The integer sums are exact, so the
// numbers are the VNNI way's on the same activations up to the float sums' order.
//
// Against gguf_amx_int8.h's way (one product of depth 32 per group, its 16 x 16 sums stored and
// scaled per group: about seven vector operations per row of W and 32 weights), the tile work is
// the same, the stores a quarter, and the vector work per row of W and super-block: C1 + 8 C2,
// its conversion and one FMA, and the minimums' eight FMAs, about a third.
// Rows of W are split across threads; each thread configures its tiles and gives back another
// library's.

#pragma once

#include <cstdint>
#include <cstring>

#include <omp.h>

#include "gguf_amx_int8.h"
#include "gguf_blocks.h"
#include "gguf_common.h"
#include "gguf_int8.h"
#include "gguf_vnni_int8.h"

namespace gguf {

#if defined(GGUF_AMX_INT8)
#define GGUF_AMX_Q8K 1

inline bool q8k_type(int qtype) { return qtype == kQ4_K || qtype == kQ5_K; }

// Tiles 0-3: C (16 rows of W x 16 rows of x, int32), two super-blocks' C1, C2 in turn;
// 4-5: A1, A2 (16 rows of W x 64 bytes); 6: B (16 rows of k / 4 x 16 rows of x x 4 bytes).
inline TileConfig amx_q8k_tiles() {
  TileConfig config;
  for (int t = 0; t < 7; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  return config;
}

// Super-block sb's C1 and C2 into tiles C1T and C2T (a macro: the tiles' numbers are literal).
#define GGUF_AMX_Q8K_PRODUCTS(C1T, C2T, a1, a2, bt, sb)             \
  do {                                                            \
    _tile_zero(C1T);                                              \
    _tile_zero(C2T);                                              \
    for (int part = 0; part < 4; ++part) {                       \
      const int64_t k0 = 256 * (sb) + 64 * part;                  \
      _tile_loadd(6, (bt) + (k0 / 4) * 16, 64);                   \
      _tile_loadd(4, (a1) + k0 * 16, 64);                         \
      _tile_dpbusd(C1T, 4, 6);                                    \
      _tile_loadd(5, (a2) + k0 * 16, 64);                         \
      _tile_dpbusd(C2T, 5, 6);                                    \
    }                                                             \
  } while (0)

template <int T>
void amx_q8k_matmul_type(float* y, const uint8_t* packed, int64_t num_rows, int64_t out_features, int64_t in_features,
                         const Int8Rows& a, int num_threads) {
  const TypeSize t = type_size(T);
  const int64_t nsb = in_features / 256, row_bytes = nsb * t.bytes, kp = in_features, ng = kp / 32;
  const int64_t groups16 = a.padded / 16;
  const int64_t x_tiles = (num_rows + 15) / 16, n_tiles = (out_features + 15) / 16;
  // x as B tiles: [x tile][k / 4][16 rows] int32 (4 bytes of k); per x tile, each super-block's
  // dx and each sub-block's xs, 16 floats (one per row of x) each.
  uint32_t* xb = static_cast<uint32_t*>(thread_buffer(7, sizeof(uint32_t) * x_tiles * (kp / 4) * 16));
  float* dxt = static_cast<float*>(thread_buffer(8, sizeof(float) * x_tiles * (nsb + ng) * 16));
  float* xst = dxt + x_tiles * nsb * 16;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < x_tiles * 16; ++m) {
      const int64_t mt = m / 16, ml = m % 16;
      uint32_t* b = xb + mt * (kp / 4) * 16 + ml;
      float* d = dxt + mt * nsb * 16 + ml;
      float* s = xst + mt * ng * 16 + ml;
      if (m < num_rows) {
        const uint32_t* q = reinterpret_cast<const uint32_t*>(a.qx + m * a.padded);
        for (int64_t k4 = 0; k4 < kp / 4; ++k4) b[16 * k4] = q[k4];
        const float* d16 = a.dx16 + m * groups16;
        const float* s16 = a.xs16 + m * groups16;
        for (int64_t sb = 0; sb < nsb; ++sb) d[16 * sb] = d16[16 * sb];  // one scale per 256 of x
        for (int64_t g = 0; g < ng; ++g) s[16 * g] = s16[2 * g] + s16[2 * g + 1];
      } else {
        for (int64_t k4 = 0; k4 < kp / 4; ++k4) b[16 * k4] = 0;
        for (int64_t sb = 0; sb < nsb; ++sb) d[16 * sb] = 0.0f;
        for (int64_t g = 0; g < ng; ++g) s[16 * g] = 0.0f;
      }
    }  // (ends in the team's barrier)

    // 16 rows of W: A1, A2 [kp / 64][16][64] bytes (each tile load 1 KiB in a row), d [16][nsb],
    // dmin m [16][ng]
    uint8_t* a1 = static_cast<uint8_t*>(thread_buffer(9, 2 * 16 * kp + sizeof(float) * 16 * (nsb + ng)));
    uint8_t* a2 = a1 + 16 * kp;
    float* dw = reinterpret_cast<float*>(a2 + 16 * kp);
    float* mw = dw + 16 * nsb;
    alignas(64) int32_t c[4][16 * 16];
    alignas(64) float out[16 * 16];
    const TileScope tiles(amx_q8k_tiles());
#pragma omp for schedule(static)
    for (int64_t nt = 0; nt < n_tiles; ++nt) {
      const int64_t n0 = 16 * nt;
      const int n_here = out_features - n0 < 16 ? static_cast<int>(out_features - n0) : 16;
      for (int n = 0; n < n_here; ++n) {
        const uint8_t* row = packed + (n0 + n) * row_bytes;
        for (int64_t sb = 0; sb < nsb; ++sb) {
          const uint8_t* p = row + sb * t.bytes;
          prefetch_ahead(p, t.bytes);
          const K4Scales k = k4_scales_mins(p);
          dw[n * nsb + sb] = half_to_float(p);
          _mm256_storeu_ps(mw + n * ng + 8 * sb, _mm256_mul_ps(_mm256_set1_ps(half_to_float(p + 2)), k4_bytes_as_floats(k.mins)));
          // the eight scales as 16-bit words, split into their low 3 bits and the rest
          const __m512i words = _mm512_castsi128_si512(_mm_cvtepu8_epi16(k.scales));
          const __m512i low8 = _mm512_and_si512(words, _mm512_set1_epi16(7)), high8 = _mm512_srli_epi16(words, 3);
#pragma GCC unroll 4
          for (int ch = 0; ch < 4; ++ch) {
            const __m512i u = k4_chunk<T>(p, ch);
            // u times a sub-block's factor, 16 bits at a time: each byte's product is below 256,
            // so the low byte's never carries into the high one's. Words 0-15: sub-block 2 ch,
            // 16-31: 2 ch + 1.
            const __m512i which = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<short>(2 * ch)),
                                                     _mm256_set1_epi16(static_cast<short>(2 * ch + 1)), 1);
            const __m512i low = _mm512_permutexvar_epi16(which, low8);
            const __m512i high = _mm512_permutexvar_epi16(which, high8);
            const int64_t at = (4 * sb + ch) * 1024 + 64 * n;
            _mm512_store_si512(a1 + at, _mm512_mullo_epi16(u, low));
            _mm512_store_si512(a2 + at, _mm512_mullo_epi16(u, high));
          }
        }
      }
      for (int n = n_here; n < 16; ++n) {  // a last partial tile: rows of zeros
        for (int64_t ch = 0; ch < kp / 64; ++ch) {
          _mm512_store_si512(a1 + ch * 1024 + 64 * n, _mm512_setzero_si512());
          _mm512_store_si512(a2 + ch * 1024 + 64 * n, _mm512_setzero_si512());
        }
        std::memset(dw + n * nsb, 0, sizeof(float) * nsb);
        std::memset(mw + n * ng, 0, sizeof(float) * ng);
      }
      for (int64_t mt = 0; mt < x_tiles; ++mt) {
        const uint32_t* bt = xb + mt * (kp / 4) * 16;
        const float* dt = dxt + mt * nsb * 16;
        const float* st = xst + mt * ng * 16;
        __m512 acc[16];
        for (int n = 0; n < 16; ++n) acc[n] = _mm512_setzero_ps();
        // c[0], c[1]: C1, C2 of one super-block; n's row of 16 rows of x each. Its minimums'
        // eight sub-blocks are taken here too, while the tiles compute the next super-block.
        const auto scale = [&](int64_t sb, int32_t (*cs)[16 * 16]) {
          const __m512 dx = _mm512_loadu_ps(dt + 16 * sb);
#pragma GCC unroll 16
          for (int n = 0; n < 16; ++n) {
            const __m512i sums = _mm512_add_epi32(_mm512_load_si512(cs[0] + 16 * n),
                                                  _mm512_slli_epi32(_mm512_load_si512(cs[1] + 16 * n), 3));
            acc[n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(dx, _mm512_set1_ps(dw[n * nsb + sb])), acc[n]);
          }
#pragma GCC unroll 8
          for (int j = 0; j < 8; ++j) {
            const __m512 xs = _mm512_loadu_ps(st + 16 * (8 * sb + j));
#pragma GCC unroll 16
            for (int n = 0; n < 16; ++n) acc[n] = _mm512_fnmadd_ps(_mm512_set1_ps(mw[n * ng + 8 * sb + j]), xs, acc[n]);
          }
        };
        GGUF_AMX_Q8K_PRODUCTS(0, 1, a1, a2, bt, 0);
        for (int64_t sb = 0; sb < nsb; sb += 2) {
          if (sb + 1 < nsb) GGUF_AMX_Q8K_PRODUCTS(2, 3, a1, a2, bt, sb + 1);
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          scale(sb, c);
          if (sb + 1 >= nsb) break;
          if (sb + 2 < nsb) GGUF_AMX_Q8K_PRODUCTS(0, 1, a1, a2, bt, sb + 2);
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
          scale(sb + 1, c + 2);
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

#undef GGUF_AMX_Q8K_PRODUCTS

void amx_q8k_matmul(int qtype, float* y, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                    int64_t in_features, const Int8Rows& a, int num_threads) {
  if (qtype == kQ4_K) return amx_q8k_matmul_type<kQ4_K>(y, packed, num_rows, out_features, in_features, a, num_threads);
  return amx_q8k_matmul_type<kQ5_K>(y, packed, num_rows, out_features, in_features, a, num_threads);
}
#endif

}  // namespace gguf
