// The float ways of the GGUF products (float32 activations), for gguf_matmul.cpp and the AMX
// ways that expand W as they do: each block expanded to floats (w = d q - m, one FMA a vector;
// not bitwise gguf-py's) by vector width (V256, V512), the few-rows way that multiplies each
// expanded block with up to 8 rows of x in registers (fused_matmul), and the tiled way of prompts
// (tiled_matmul: panels of x transposed, 12 rows of W expanded into a buffer, each weight
// broadcast against a panel's column). The portable C++ reference: expand_row_portable,
// dot_rows_portable. Self-contained; in namespace gguf.
#pragma once

#include <cstdint>
#include <cstring>

#include <omp.h>

#include "gguf_blocks.h"
#include "gguf_common.h"

namespace gguf {

constexpr int kTiledRows = 16;  // from this many rows of x on, the tiled float way
constexpr int kTileW = 12;     // rows of W expanded together (tiled way)
constexpr int kBlockRows = 128;  // rows of x transposed at a time (tiled way)
constexpr int kSliceK = 1024;   // weights of k per pass of the tiled way (its slices in L1)
constexpr int kRowGroup = 4;   // rows of x sharing each load of an expanded row of W

// ---------------------------------------------------------------------------------------------
// Portable C++: the exact dequantization of each block, plain loops.

void expand_row_portable(int qtype, const uint8_t* row, int64_t num_blocks, float* w) {
  const TypeSize t = type_size(qtype);
  for (int64_t b = 0; b < num_blocks; ++b) dequantize_block(qtype, row + b * t.bytes, w + b * t.weights);
}

void dot_rows_portable(float* y, int64_t y_stride, const float* w, const float* x, int64_t in_features, int rows) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + r * in_features;
    float sum = 0.0f;
    for (int64_t k = 0; k < in_features; ++k) sum += w[k] * xr[k];
    y[r * y_stride] = sum;
  }
}

#ifdef GGUF_AVX2
// ---------------------------------------------------------------------------------------------
// Vectors of floats and int32 for the float way, one struct per ISA: the block expansion and the
// products below are written once over them.

struct V256 {
  using F = __m256;
  using I = __m256i;
  static constexpr int W = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F zero() { return _mm256_setzero_ps(); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static I u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I mask(I v, int m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
  static I shr(I v, int n) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(n)); }
  static I shl(I v, int n) { return _mm256_sll_epi32(v, _mm_cvtsi32_si128(n)); }
  static I shrv(I v, I n) { return _mm256_srlv_epi32(v, n); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I set1i(int v) { return _mm256_set1_epi32(v); }
  static I iota(int first) { return _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first)); }
  static float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
  }
};

#ifdef GGUF_AVX512
struct V512 {
  using F = __m512;
  using I = __m512i;
  static constexpr int W = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F zero() { return _mm512_setzero_ps(); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I s8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I mask(I v, int m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
  static I shr(I v, int n) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(n)); }
  static I shl(I v, int n) { return _mm512_sll_epi32(v, _mm_cvtsi32_si128(n)); }
  static I shrv(I v, I n) { return _mm512_srlv_epi32(v, n); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I set1i(int v) { return _mm512_set1_epi32(v); }
  static I iota(int first) {
    return _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(first));
  }
  static float hsum(F v) { return _mm512_reduce_add_ps(v); }
};
#endif

// One block's weights as floats, W at a time (not bitwise gguf's: d q + m is one FMA here), each
// vector handed to sink(k, w) with k its first weight's index in the block. The loops are
// unrolled, so k is a constant where a sink keeps accumulators by it.
// A legacy block's scale and minimum may come converted already (d, m: see expand_row_blocks).
template <class V, int T, class Sink>
inline void expand_block(const uint8_t* b, Sink&& sink, const float* d_in = nullptr, const float* m_in = nullptr) {
  constexpr int W = V::W;
  using F = typename V::F;
  using I = typename V::I;
  if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1) {
    constexpr bool has_min = T == kQ4_1 || T == kQ5_1, five = T == kQ5_0 || T == kQ5_1;
    const float d = d_in ? *d_in : half_to_float(b);
    const F vd = V::set1(d);
    const F vm = V::set1(has_min ? (m_in ? *m_in : half_to_float(b + 2)) : (five ? -16.0f : -8.0f) * d);
    uint32_t qh = 0;
    if (five) std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
    const uint8_t* qs = b + (has_min ? 4 : 2) + (five ? 4 : 0);
    const I vqh = V::set1i(static_cast<int>(qh));
    _Pragma("GCC unroll 16") for (int c = 0; c < 16; c += W) {
      const I q = V::u8(qs + c);
      I lo = V::mask(q, 0xF), hi = V::shr(q, 4);
      if (five) {
        lo = V::or_(lo, V::shl(V::mask(V::shrv(vqh, V::iota(c)), 1), 4));
        hi = V::or_(hi, V::shl(V::mask(V::shrv(vqh, V::iota(c + 16)), 1), 4));
      }
      sink(c, V::fma(V::cvt(lo), vd, vm));
      sink(16 + c, V::fma(V::cvt(hi), vd, vm));
    }
  } else if constexpr (T == kQ8_0) {
    const F vd = V::set1(d_in ? *d_in : half_to_float(b));
    _Pragma("GCC unroll 16") for (int c = 0; c < 32; c += W) sink(c, V::mul(V::cvt(V::s8(b + 2 + c)), vd));
  } else if constexpr (T == kQ4_K && W == 16) {
    // 16-entry tables: the pair of sub-blocks of each 32 bytes (low nibbles, then high) looks its
    // weights up (VPERMPS reads an index's low 4 bits: the low nibble needs no mask) from d sc q -
    // dmin m for q = 0..15, one FMA per table: the same floats as a conversion and an FMA per vector.
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {
      int sc0, m0, sc1, m1;
      scale_min_k4(2 * c, b + 4, &sc0, &m0);
      scale_min_k4(2 * c + 1, b + 4, &sc1, &m1);
      const F t0 = V::fma(iota, V::set1(d * static_cast<float>(sc0)), V::set1(-dmin * static_cast<float>(m0)));
      const F t1 = V::fma(iota, V::set1(d * static_cast<float>(sc1)), V::set1(-dmin * static_cast<float>(m1)));
      const uint8_t* qs = b + 16 + 32 * c;
      const I q0 = V::u8(qs), q1 = V::u8(qs + 16);
      sink(64 * c, _mm512_permutexvar_ps(q0, t0));
      sink(64 * c + 16, _mm512_permutexvar_ps(q1, t0));
      sink(64 * c + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(q0, 4), t1));
      sink(64 * c + 48, _mm512_permutexvar_ps(_mm512_srli_epi32(q1, 4), t1));
    }
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const float d = half_to_float(b), dmin = half_to_float(b + 2);
    _Pragma("GCC unroll 16") for (int i = 0; i < 8; ++i) {
      int sc, m;
      scale_min_k4(i, b + 4, &sc, &m);
      const F vd = V::set1(d * static_cast<float>(sc)), vm = V::set1(-dmin * static_cast<float>(m));
      const uint8_t* qs = b + (T == kQ4_K ? 16 : 48) + 32 * (i / 2);
      _Pragma("GCC unroll 16") for (int c = 0; c < 32; c += W) {
        const I q = V::u8(qs + c);
        I v = i & 1 ? V::shr(q, 4) : V::mask(q, 0xF);
        if (T == kQ5_K) v = V::or_(v, V::shl(V::mask(V::shr(V::u8(b + 16 + c), i), 1), 4));
        sink(32 * i + c, V::fma(V::cvt(v), vd, vm));
      }
    }
  } else if constexpr (T == kQ2_K || T == kQ3_K) {
    // weights 128 n + 32 j + c ...: 2-bit values (qs[32n + c] >> 2j) & 3, and Q3_K's third bit
    const uint8_t* qs = b + (T == kQ2_K ? 16 : 32);
    const float d = half_to_float(b + (T == kQ2_K ? 80 : 108)), dmin = T == kQ2_K ? half_to_float(b + 82) : 0.0f;
    for (int n = 0; n < 2; ++n)
      for (int j = 0; j < 4; ++j)
        _Pragma("GCC unroll 16") for (int c = 0; c < 32; c += W) {
          const int k = 128 * n + 32 * j + c, g = k / 16;
          I v = V::mask(V::shr(V::u8(qs + 32 * n + c), 2 * j), 3);
          float dl, ml;  // w = dl v + ml
          if constexpr (T == kQ2_K) {
            dl = d * static_cast<float>(b[g] & 0xF);
            ml = -dmin * static_cast<float>(b[g] >> 4);
          } else {
            v = V::or_(v, V::shl(V::mask(V::shr(V::u8(b + c), 4 * n + j), 1), 2));
            dl = d * static_cast<float>(q3k_scale(b, g) - 32);
            ml = -4.0f * dl;
          }
          sink(k, V::fma(V::cvt(v), V::set1(dl), V::set1(ml)));
        }
  } else if constexpr (T == kIQ4_NL || T == kIQ4_XS) {
    // each 32 weights: the table's values of 16 bytes of nibbles (low: weights 0-15, high: 16-31)
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values));
    const float d = half_to_float(b);
    constexpr int parts = T == kIQ4_NL ? 1 : 8;
    for (int i = 0; i < parts; ++i) {
      const uint8_t* qs = T == kIQ4_NL ? b + 2 : b + 8 + 16 * i;
      const F vd = V::set1(T == kIQ4_NL ? d : d * static_cast<float>(iq4xs_scale(b, i) - 32));
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      alignas(16) int8_t values[32];
      _mm_store_si128(reinterpret_cast<__m128i*>(values), _mm_shuffle_epi8(table, _mm_and_si128(raw, _mm_set1_epi8(0x0F))));
      _mm_store_si128(reinterpret_cast<__m128i*>(values + 16),
                      _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F))));
      _Pragma("GCC unroll 16") for (int c = 0; c < 32; c += W)
        sink(32 * i + c, V::mul(V::cvt(V::s8(reinterpret_cast<const uint8_t*>(values) + c)), vd));
    }
  } else if constexpr (T == kQ6_K) {
    const float d = half_to_float(b + 208);
    for (int h = 0; h < 2; ++h)
      for (int s = 0; s < 4; ++s)
        _Pragma("GCC unroll 16") for (int c = 0; c < 32; c += W) {
          const int g = 2 * (4 * h + s) + c / 16;
          const float dg = d * static_cast<float>(static_cast<int8_t>(b[192 + g]));
          const I q = V::u8(b + 64 * h + 32 * (s & 1) + c);
          const I nibble = s < 2 ? V::mask(q, 0xF) : V::shr(q, 4);
          const I v = V::or_(nibble, V::shl(V::mask(V::shr(V::u8(b + 128 + 32 * h + c), 2 * s), 3), 4));
          sink(32 * (4 * h + s) + c, V::fma(V::cvt(v), V::set1(dg), V::set1(-32.0f * dg)));
        }
  }
}

// The float16 at byte `at` of each of eight blocks (or the first `count`) of `stride` bytes from p,
// as eight int16 lanes, zero past `count` (one conversion then gives the blocks' scales or minimums).
inline __m128i halves_of_8_blocks(const uint8_t* p, int64_t stride, int at, int count = 8) {
  __m128i h = _mm_setzero_si128();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    if (j >= count) break;
    uint16_t v;
    std::memcpy(&v, p + j * stride + at, 2);
    h = _mm_insert_epi16(h, v, j);
  }
  return h;
}

// Every block of a row through expand_block, sink(b, k, w); the legacy types' float16 scales
// (and minimums) converted eight blocks at a time (one VCVTPH2PS, not eight).
template <class V, int T, class Sink>
inline void expand_row_blocks(const uint8_t* row, int64_t num_blocks, Sink&& sink) {
  const TypeSize t = type_size(T);
  int64_t b = 0;
  if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1 || T == kQ8_0) {
    constexpr bool has_min = T == kQ4_1 || T == kQ5_1;
    for (; b + 8 <= num_blocks; b += 8) {
      const uint8_t* p = row + b * t.bytes;
      prefetch_ahead(p, 8 * t.bytes);
      const __m128i dh = halves_of_8_blocks(p, t.bytes, 0);
      const __m128i mh = has_min ? halves_of_8_blocks(p, t.bytes, 2) : _mm_setzero_si128();
      alignas(32) float d[8], m[8];
      _mm256_store_ps(d, _mm256_cvtph_ps(dh));
      _mm256_store_ps(m, _mm256_cvtph_ps(mh));
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
        expand_block<V, T>(p + j * t.bytes, [&](int k, typename V::F v) { sink(b + j, k, v); }, d + j, m + j);
    }
  }
  for (; b < num_blocks; ++b) {
    if (t.weights == 256 || b % 4 == 0) prefetch_ahead(row + b * t.bytes, t.weights == 256 ? t.bytes : 4 * t.bytes);
    expand_block<V, T>(row + b * t.bytes, [&](int k, typename V::F v) { sink(b, k, v); });
  }
}

template <class V, int T>
inline void expand_blocks(const uint8_t* row, int64_t num_blocks, float* w) {
  const TypeSize t = type_size(T);
  expand_row_blocks<V, T>(row, num_blocks, [&](int64_t b, int k, typename V::F v) { V::store(w + b * t.weights + k, v); });
}

template <class V>
inline void expand_row(int qtype, const uint8_t* row, int64_t num_blocks, float* w) {
  switch (qtype) {
    case kQ4_0: return expand_blocks<V, kQ4_0>(row, num_blocks, w);
    case kQ4_1: return expand_blocks<V, kQ4_1>(row, num_blocks, w);
    case kQ5_0: return expand_blocks<V, kQ5_0>(row, num_blocks, w);
    case kQ5_1: return expand_blocks<V, kQ5_1>(row, num_blocks, w);
    case kQ8_0: return expand_blocks<V, kQ8_0>(row, num_blocks, w);
    case kQ4_K: return expand_blocks<V, kQ4_K>(row, num_blocks, w);
    case kQ5_K: return expand_blocks<V, kQ5_K>(row, num_blocks, w);
    case kQ6_K: return expand_blocks<V, kQ6_K>(row, num_blocks, w);
    case kQ2_K: return expand_blocks<V, kQ2_K>(row, num_blocks, w);
    case kQ3_K: return expand_blocks<V, kQ3_K>(row, num_blocks, w);
    case kIQ4_NL: return expand_blocks<V, kIQ4_NL>(row, num_blocks, w);
    case kIQ4_XS: return expand_blocks<V, kIQ4_XS>(row, num_blocks, w);
    default: return;
  }
}

// y[r * y_stride] = w . x_r for R rows of x and one row of W whose blocks are expanded in
// registers, never stored: two accumulators per row of x (by the vector's place in the block).
template <class V, int T, int R>
inline void fused_dot_rows(float* y, int64_t y_stride, const uint8_t* row, int64_t num_blocks, const float* x,
                           int64_t in_features) {
  using F = typename V::F;
  constexpr int A = R == 1 ? 4 : 2;
  const TypeSize t = type_size(T);
  F acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = V::zero();
  expand_row_blocks<V, T>(row, num_blocks, [&](int64_t b, int k, F w) {
    // the accumulators rotate (constant indices: GCC keeps them in registers, where an index
    // computed from k kept them in memory wherever a loop of expand_block stayed rolled)
    const float* xb = x + b * t.weights;
    for (int r = 0; r < R; ++r) {
      const F sum = V::fma(w, V::load(xb + r * in_features + k), acc[r][0]);
      for (int a = 0; a + 1 < A; ++a) acc[r][a] = acc[r][a + 1];
      acc[r][A - 1] = sum;
    }
  });
  for (int r = 0; r < R; ++r) {
    F sum = acc[r][0];
    for (int a = 1; a < A; ++a) sum = V::add(sum, acc[r][a]);
    y[r * y_stride] = V::hsum(sum);
  }
}

template <class V, int T>
inline void fused_row_group(float* y, int64_t y_stride, const uint8_t* row, int64_t num_blocks, const float* x,
                            int64_t in_features, int rows) {
  switch (rows) {
    case 1: return fused_dot_rows<V, T, 1>(y, y_stride, row, num_blocks, x, in_features);
    case 2: return fused_dot_rows<V, T, 2>(y, y_stride, row, num_blocks, x, in_features);
    case 3: return fused_dot_rows<V, T, 3>(y, y_stride, row, num_blocks, x, in_features);
    case 4: return fused_dot_rows<V, T, 4>(y, y_stride, row, num_blocks, x, in_features);
    default: break;
  }
  if constexpr (V::W == 16) {  // 32 vector registers: up to 8 rows of x (16 accumulators)
    switch (rows) {
      case 5: return fused_dot_rows<V, T, 5>(y, y_stride, row, num_blocks, x, in_features);
      case 6: return fused_dot_rows<V, T, 6>(y, y_stride, row, num_blocks, x, in_features);
      case 7: return fused_dot_rows<V, T, 7>(y, y_stride, row, num_blocks, x, in_features);
      default: return fused_dot_rows<V, T, 8>(y, y_stride, row, num_blocks, x, in_features);
    }
  }
}

template <class V>
constexpr int kFusedGroup = V::W == 16 ? 8 : 4;  // rows of x sharing each expanded block

template <class V, int T>
void fused_matmul(float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                  int64_t in_features, int num_threads) {
  const TypeSize t = type_size(T);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
#pragma omp parallel num_threads(num_threads)
  for_rows_streamed(out_features, [&](int64_t n) {
    for (int64_t r0 = 0; r0 < num_rows; r0 += kFusedGroup<V>) {
      const int rows = num_rows - r0 < kFusedGroup<V> ? static_cast<int>(num_rows - r0) : kFusedGroup<V>;
      fused_row_group<V, T>(y + r0 * out_features + n, out_features, packed + n * row_bytes, num_blocks,
                            x + r0 * in_features, in_features, rows);
    }
  });
}

template <class V>
void fused_matmul(int qtype, float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                  int64_t in_features, int num_threads) {
  switch (qtype) {
    case kQ4_0: return fused_matmul<V, kQ4_0>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ4_1: return fused_matmul<V, kQ4_1>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ5_0: return fused_matmul<V, kQ5_0>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ5_1: return fused_matmul<V, kQ5_1>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ8_0: return fused_matmul<V, kQ8_0>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ4_K: return fused_matmul<V, kQ4_K>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ5_K: return fused_matmul<V, kQ5_K>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ6_K: return fused_matmul<V, kQ6_K>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ2_K: return fused_matmul<V, kQ2_K>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ3_K: return fused_matmul<V, kQ3_K>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kIQ4_NL: return fused_matmul<V, kIQ4_NL>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kIQ4_XS: return fused_matmul<V, kIQ4_XS>(y, x, packed, num_rows, out_features, in_features, num_threads);
    default: return;
  }
}

// y[r * y_stride] = w . x_r for R rows of x (in_features a multiple of 2 W).
template <class V, int R>
inline void dot_rows(float* y, int64_t y_stride, const float* w, const float* x, int64_t in_features) {
  using F = typename V::F;
  F acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V::zero();
  for (int64_t k = 0; k < in_features; k += 2 * V::W) {
    const F w0 = V::load(w + k), w1 = V::load(w + k + V::W);
    for (int r = 0; r < R; ++r) {
      acc[r][0] = V::fma(w0, V::load(x + r * in_features + k), acc[r][0]);
      acc[r][1] = V::fma(w1, V::load(x + r * in_features + k + V::W), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * y_stride] = V::hsum(V::add(acc[r][0], acc[r][1]));
}

template <class V>
inline void dot_row_group(float* y, int64_t y_stride, const float* w, const float* x, int64_t in_features, int rows) {
  switch (rows) {
    case 1: return dot_rows<V, 1>(y, y_stride, w, x, in_features);
    case 2: return dot_rows<V, 2>(y, y_stride, w, x, in_features);
    case 3: return dot_rows<V, 3>(y, y_stride, w, x, in_features);
    default: return dot_rows<V, 4>(y, y_stride, w, x, in_features);
  }
}

// c[j * P + i] = w_j . x_i for J expanded rows of W and the P = 2 W rows of x of a transposed
// panel (panel[k * P + i] = x_i[k]): each w_j[k] is broadcast to multiply the panel's column k.
// XV: vectors of rows per panel column (2, or 1 for a narrow last panel: P = XV W). Over
// k in [k0, k1) only, adding to c where k0 > 0 (the k range is split so that the panel's and the
// tile's slices stay in L1).
template <class V, int J, int XV>
inline void broadcast_tile(float* c, const float* w, int64_t w_stride, const float* panel, int64_t k0, int64_t k1) {
  using F = typename V::F;
  constexpr int P = XV * V::W;
  F acc[J][XV];
#pragma GCC unroll 12
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < XV; ++v) acc[j][v] = k0 == 0 ? V::zero() : V::load(c + j * P + v * V::W);
  for (int64_t k = k0; k < k1; ++k) {
    F xv[XV];
    for (int v = 0; v < XV; ++v) xv[v] = V::load(panel + k * P + v * V::W);
#pragma GCC unroll 12
    for (int j = 0; j < J; ++j) {
      const F wj = V::set1(w[j * w_stride + k]);
      for (int v = 0; v < XV; ++v) acc[j][v] = V::fma(wj, xv[v], acc[j][v]);
    }
  }
#pragma GCC unroll 12
  for (int j = 0; j < J; ++j)
    for (int v = 0; v < XV; ++v) V::store(c + j * P + v * V::W, acc[j][v]);
}

// The tiled float way (see the top of the file).
template <class V>
void tiled_matmul(int qtype, float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                  int64_t in_features, int num_threads) {
  constexpr int P = 2 * V::W;
  constexpr int J = V::W == 16 ? kTileW : kTileW / 2;  // rows of W per broadcast tile: 24 or 12 accumulators
  const TypeSize t = type_size(qtype);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const int64_t num_tiles = (out_features + kTileW - 1) / kTileW;
  float* panels = static_cast<float*>(thread_buffer(0, sizeof(float) * kBlockRows * in_features));
#pragma omp parallel num_threads(num_threads)
  {
    // rows of the tile 64 bytes more than in_features apart: at a multiple of 4 KiB, the 12 rows the
    // broadcasts read at once would all fall in one set of the L1 cache
    const int64_t w_stride = in_features + 16;
    float* w = static_cast<float*>(thread_buffer(1, sizeof(float) * kTileW * w_stride));
    alignas(64) float c[kBlockRows / P][kTileW * P];
    for (int64_t m0 = 0; m0 < num_rows; m0 += kBlockRows) {
      const int rows = num_rows - m0 < kBlockRows ? static_cast<int>(num_rows - m0) : kBlockRows;
      const int num_panels = (rows + P - 1) / P;
#pragma omp for schedule(static)
      for (int p = 0; p < num_panels; ++p) {
        float* panel = panels + static_cast<int64_t>(P) * p * in_features;
        const int here = rows - P * p < P ? rows - P * p : P;
        const int width = here > V::W ? P : V::W;
        for (int i = 0; i < width; ++i) {
          const float* xi = x + (m0 + P * p + i) * in_features;
          if (i < here)
            for (int64_t k = 0; k < in_features; ++k) panel[k * width + i] = xi[k];
          else
            for (int64_t k = 0; k < in_features; ++k) panel[k * width + i] = 0.0f;
        }
      }
#pragma omp for schedule(static)
      for (int64_t tile = 0; tile < num_tiles; ++tile) {
        const int64_t n0 = tile * kTileW;
        const int tile_rows = out_features - n0 < kTileW ? static_cast<int>(out_features - n0) : kTileW;
        for (int j = 0; j < tile_rows; ++j) expand_row<V>(qtype, packed + (n0 + j) * row_bytes, num_blocks, w + j * w_stride);
        if (tile_rows < kTileW) std::memset(w + tile_rows * w_stride, 0, sizeof(float) * (kTileW - tile_rows) * w_stride);
        for (int64_t k0 = 0; k0 < in_features; k0 += kSliceK) {
          const int64_t k1 = k0 + kSliceK < in_features ? k0 + kSliceK : in_features;
          for (int p = 0; p < num_panels; ++p) {
            const float* panel = panels + static_cast<int64_t>(P) * p * in_features;
            const int here = rows - P * p < P ? rows - P * p : P;
            if (here > V::W)
              for (int j0 = 0; j0 < kTileW; j0 += J)
                broadcast_tile<V, J, 2>(c[p] + j0 * P, w + j0 * w_stride, w_stride, panel, k0, k1);
            else
              broadcast_tile<V, kTileW, 1>(c[p], w, w_stride, panel, k0, k1);
          }
        }
        for (int p = 0; p < num_panels; ++p) {
          const int here = rows - P * p < P ? rows - P * p : P;
          const int width = here > V::W ? P : V::W;
          float* yp = y + (m0 + P * p) * out_features + n0;
          for (int i = 0; i < here; ++i)
            for (int j = 0; j < tile_rows; ++j) yp[i * out_features + j] = c[p][j * width + i];
        }
      }
    }
  }
}
#endif  // GGUF_AVX2

}  // namespace gguf
