// y = x W^T with W in a GGUF block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, layouts
// in gguf_blocks.h), for any number of rows of x. The packed weight is the file's rows of blocks
// as they are (kernels/gguf.py's PackedWeight.data): no float copy is kept.
//
// Three ways through, by the number of rows of x and the activations:
// - float, a few rows (below kTiledRows: decoding): each block of a row of W is expanded in
//   registers (w = d q - m, one FMA per vector) and multiplies up to 8 rows of x (4 on AVX2)
//   before the next is read; nothing is stored. Bound by reading the weights (software prefetch
//   keeps the stream ahead).
// - float, more rows (prompts): x is transposed into panels of 2 vectors of rows (32 rows on
//   AVX-512, 16 on AVX2); 12 rows of W at a time are expanded into a float buffer and each expanded
//   weight is broadcast to multiply a panel's column (24 or 12 accumulators), the core's FMA rate.
// - int8 (use_int8): each row of x is quantized per block of 32 for the legacy types and of 256
//   for the K-quants (llama.cpp's Q8_0 and Q8_K ways: a scale max|x| / 127 and int8); a weight is s u - c over each 16 (u its unsigned value, 0..63, or
//   Q8_0's int8 + 128), so a group's dot product is s dx sum(u qx) - c sum(x), sum(u qx) on 8-bit
//   integers. AVX-512 VNNI (gguf_vnni_int8.h) decodes each 64 weights in registers for up to 8 rows of x (VPDPBUSD,
//   64 products an instruction; the K-quants VPMADDUBSW and VPDPWSSD by their sub-block scales); AVX2 and the portable path decode a row into a buffer
//   (gguf_blocks.h's int8_values, Q8_0 signed) and multiply from it (AVX2: VPMADDUBSW). It pays at
//   decode sizes; from about 16 rows on the float way is faster.
// - float, 8 to 31 rows where the CPU has AMX (path 3), types with one scale per 32 weights: on
//   its tiles with exact operands, gguf_amx_exact.h (amx_exact.h).
// - float, 32 rows and more where the CPU has AMX (path 3): on its tiles, gguf_amx.h.
// - int8, 5 rows and more (10 for Q6_K) where the CPU has AMX-INT8 (path 3): on its tiles
//   (TDPBUSD), the same numbers as VNNI's, gguf_amx_int8.h; Q4_K and Q5_K with their sub-block
//   scales folded into W's operand so that a super-block's sums stay in the tiles,
//   gguf_amx_q8k.h: then int8 pays at every size.
// The ISA path (portable C++, AVX2, AVX-512, AMX) is chosen at run time (gguf_set_isa) among those
// this build has, so tests run every one the machine can. Rows of W are split across OpenMP
// threads. Math in float32.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <omp.h>

#include "amx_exact.h"
#include "gguf_blocks.h"
#include "gguf_common.h"
#include "gguf_int8_avx2.h"
#include "gguf_matmul.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GGUF_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define GGUF_AVX512 1
#endif
#endif

namespace {

using namespace gguf;

// kAvx512Amx: kAvx512, with prompt-sized products on AMX tiles (gguf_amx.h).
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Amx = 3 };

#if defined(GGUF_AVX512)
constexpr int kBestIsa = kAvx512;
#elif defined(GGUF_AVX2)
constexpr int kBestIsa = kAvx2;
#else
constexpr int kBestIsa = kPortable;
#endif

int g_isa = -1;  // best_isa() at first use

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

// The float16 at byte `at` of each of eight blocks of `stride` bytes from p, as eight int16 lanes
// (one conversion then gives the eight blocks' scales or minimums).
inline __m128i halves_of_8_blocks(const uint8_t* p, int64_t stride, int at) {
  __m128i h = _mm_setzero_si128();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
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

// The few-rows float way: each row of W expanded once, every row of x takes it.
template <int ISA>
void rows_matmul(int qtype, float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                 int64_t in_features, int num_threads) {
  const TypeSize t = type_size(qtype);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
#pragma omp parallel num_threads(num_threads)
  {
    float* w = static_cast<float*>(thread_buffer(2, sizeof(float) * in_features));
    for_rows_streamed(out_features, [&](int64_t n) {
      const uint8_t* row = packed + n * row_bytes;
      if constexpr (ISA == kPortable) {
        expand_row_portable(qtype, row, num_blocks, w);
      }
#ifdef GGUF_AVX2
      if constexpr (ISA == kAvx2) expand_row<V256>(qtype, row, num_blocks, w);
#endif
#ifdef GGUF_AVX512
      if constexpr (ISA >= kAvx512) expand_row<V512>(qtype, row, num_blocks, w);
#endif
      for (int64_t r0 = 0; r0 < num_rows; r0 += kRowGroup) {
        const int rows = num_rows - r0 < kRowGroup ? static_cast<int>(num_rows - r0) : kRowGroup;
        float* yr = y + r0 * out_features + n;
        const float* xr = x + r0 * in_features;
        if constexpr (ISA == kPortable) dot_rows_portable(yr, out_features, w, xr, in_features, rows);
#ifdef GGUF_AVX2
        if constexpr (ISA == kAvx2) dot_row_group<V256>(yr, out_features, w, xr, in_features, rows);
#endif
#ifdef GGUF_AVX512
        if constexpr (ISA >= kAvx512) dot_row_group<V512>(yr, out_features, w, xr, in_features, rows);
#endif
      }
    });
  }
}

// ---------------------------------------------------------------------------------------------
// int8 activations.

#ifdef GGUF_AVX512
// One row of quantize_activations, 16 values a vector: max |x| per block, then each value times
// the block's 1 / d rounded to nearest even (as std::nearbyint in the default rounding mode).
inline void quantize_row_avx512(const float* x, int64_t in_features, int block, int8_t* q, float* d16, float* s16) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t k0 = 0; k0 < in_features; k0 += block) {
    __m512 amax = _mm512_setzero_ps();
    for (int h = 0; h < block / 16; ++h) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, _mm512_loadu_ps(x + k0 + 16 * h)));
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    for (int h = 0; h < block / 16; ++h) {
      const __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k0 + 16 * h), inv),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16 * h), _mm512_cvtepi32_epi8(v));
      d16[k0 / 16 + h] = d;
      s16[k0 / 16 + h] = d * static_cast<float>(_mm512_reduce_add_epi32(v));
    }
  }
}
#endif

// Row r of x quantized per block of `block` (32, or 256 for the K-quants: llama.cpp's Q8_K, so that
// a super-block's sub-block scales apply to integer sums, gguf_amx_q8k.h) into qx (stride `padded`
// bytes, zero past in_features), with per group of 16 its block's scale dx16 and dx times the sum
// of the group's int8 values xs16 (stride padded / 16, zero past in_features / 16). in_features:
// a multiple of `block`.
void quantize_activations(const float* x, int64_t num_rows, int64_t in_features, int64_t padded, int8_t* qx,
                          float* dx16, float* xs16, int block = 32) {
  const int64_t groups = padded / 16;
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* xr = x + r * in_features;
    int8_t* q = qx + r * padded;
    float* d16 = dx16 + r * groups;
    float* s16 = xs16 + r * groups;
#ifdef GGUF_AVX512
    if (in_features % 32 == 0) {  // 16 at a time; the same numbers as the loop below
      quantize_row_avx512(xr, in_features, block, q, d16, s16);
      std::memset(q + in_features, 0, padded - in_features);
      for (int64_t g = in_features / 16; g < groups; ++g) d16[g] = s16[g] = 0.0f;
      continue;
    }
#endif
    for (int64_t k0 = 0; k0 < in_features; k0 += block) {
      float amax = 0.0f;
      for (int j = 0; j < block; ++j) amax = std::fmax(amax, std::fabs(xr[k0 + j]));
      const float d = amax / 127.0f;
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;
      for (int h = 0; h < block / 16; ++h) {
        int sum = 0;
        for (int j = 16 * h; j < 16 * h + 16; ++j) {
          const int v = static_cast<int>(std::nearbyint(xr[k0 + j] * inv));
          q[k0 + j] = static_cast<int8_t>(v);
          sum += v;
        }
        d16[k0 / 16 + h] = d;
        s16[k0 / 16 + h] = d * static_cast<float>(sum);
      }
    }
    std::memset(q + in_features, 0, padded - in_features);
    for (int64_t g = in_features / 16; g < groups; ++g) d16[g] = s16[g] = 0.0f;
  }
}

// The types the VNNI and AMX ways (gguf_vnni_int8.h, gguf_amx*.h) decode; the others (Q2_K, Q3_K,
// IQ4_NL, IQ4_XS) take the AVX2 ways on AVX-512 machines too.
inline bool vnni_type(int qtype) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
    default: return false;
  }
}

// The block x is quantized in for a product with W of type qtype: 256 for the K-quants (as
// llama.cpp's Q8_K), 32 for the legacy types (Q8_0's, Q8_1's).
inline int activation_block(int qtype) { return type_size(qtype).weights == 256 ? 256 : 32; }

// Activations and a row of W as the int8 dot products read them.
struct Int8Rows {
  const int8_t* qx;
  const float* dx16;
  const float* xs16;
  int64_t padded;  // bytes per row of qx: in_features rounded up to 64
};

float offset_term(const float* c16, const float* xs16, int64_t groups) {
  float sum = 0.0f;
  for (int64_t g = 0; g < groups; ++g) sum += c16[g] * xs16[g];
  return sum;
}

void int8_dot_portable(float* y, int64_t y_stride, const uint8_t* u, const float* s16, const float* c16, bool is_signed,
                       const Int8Rows& a, int64_t r0, int rows) {
  const int64_t groups = a.padded / 16;
  for (int r = 0; r < rows; ++r) {
    const int8_t* q = a.qx + (r0 + r) * a.padded;
    const float* d16 = a.dx16 + (r0 + r) * groups;
    float sum = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int dot = 0;
      for (int j = 0; j < 16; ++j) {
        const int w = is_signed ? static_cast<int8_t>(u[16 * g + j]) : u[16 * g + j];
        dot += w * q[16 * g + j];
      }
      sum += s16[g] * d16[g] * static_cast<float>(dot);
    }
    y[r * y_stride] = sum - offset_term(c16, a.xs16 + (r0 + r) * groups, groups);
  }
}


#ifdef GGUF_AVX512
// AVX-512 VNNI: 64 products at a time, VPDPBUSD (unsigned by signed bytes into int32; Q8_0's
// signed weights give their sign to x).
template <int R, bool kSigned>
inline void int8_dot_avx512(float* y, int64_t y_stride, const uint8_t* u, const float* s16, const float* c16,
                            const Int8Rows& a, int64_t r0) {
  const int64_t groups = a.padded / 16;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);  // group of each lane
  for (int64_t k = 0; k < a.padded; k += 64) {
    const __m512i w = _mm512_loadu_si512(u + k);
    const __mmask64 negative = kSigned ? _mm512_movepi8_mask(w) : 0;
    const __m512i wu = kSigned ? _mm512_abs_epi8(w) : w;
    const __m128 sw = _mm_loadu_ps(s16 + k / 16);
    for (int r = 0; r < R; ++r) {
      __m512i q = _mm512_loadu_si512(a.qx + (r0 + r) * a.padded + k);
      if (kSigned) q = _mm512_mask_sub_epi8(q, negative, _mm512_setzero_si512(), q);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, q);
      const __m128 s4 = _mm_mul_ps(sw, _mm_loadu_ps(a.dx16 + (r0 + r) * groups + k / 16));
      const __m512 scale = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(s4));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    y[r * y_stride] = _mm512_reduce_add_ps(acc[r]) - offset_term(c16, a.xs16 + (r0 + r) * groups, groups);
}
#endif

template <int ISA, bool kSigned>
inline void int8_dot_group(float* y, int64_t y_stride, const uint8_t* u, const float* s16, const float* c16,
                           const Int8Rows& a, int64_t r0, int rows) {
  if constexpr (ISA == kPortable) int8_dot_portable(y, y_stride, u, s16, c16, kSigned, a, r0, rows);
#ifdef GGUF_AVX512
  if constexpr (ISA >= kAvx512) {
    switch (rows) {
      case 1: return int8_dot_avx512<1, kSigned>(y, y_stride, u, s16, c16, a, r0);
      case 2: return int8_dot_avx512<2, kSigned>(y, y_stride, u, s16, c16, a, r0);
      case 3: return int8_dot_avx512<3, kSigned>(y, y_stride, u, s16, c16, a, r0);
      default: return int8_dot_avx512<4, kSigned>(y, y_stride, u, s16, c16, a, r0);
    }
  }
#endif
}

#include "gguf_vnni_int8.h"

#include "gguf_amx.h"
#include "gguf_amx_int8.h"
#include "gguf_amx_q8k.h"
#ifdef GGUF_AMX
constexpr int kAmxMinRows = 32;  // from this many rows of x on, AMX's way (float32)
#endif

#include "gguf_amx_exact.h"

template <int ISA, bool kSigned>
void int8_matmul(int qtype, float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                 int64_t in_features, int num_threads) {
#ifdef GGUF_INT8_AVX2
  // (the types the VNNI and AMX ways have no decoder for take the AVX2 way on every SIMD path)
  if (ISA == kAvx2 || !vnni_type(qtype))
    return int8_avx2::matmul(qtype, y, x, packed, num_rows, out_features, in_features, num_threads);
#endif
  const TypeSize t = type_size(qtype);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const int64_t padded = round_up(in_features, 64), groups = padded / 16;
  int8_t* qx = static_cast<int8_t*>(thread_buffer(3, num_rows * padded));
  float* dx16 = static_cast<float*>(thread_buffer(4, sizeof(float) * num_rows * groups));
  float* xs16 = static_cast<float*>(thread_buffer(5, sizeof(float) * num_rows * groups));
  quantize_activations(x, num_rows, in_features, padded, qx, dx16, xs16, activation_block(qtype));
  const Int8Rows a{qx, dx16, xs16, padded};
#ifdef GGUF_AMX_INT8
  if constexpr (ISA == kAvx512Amx) {
    if (num_rows >= amx_int8_min_rows(qtype)) {
      if (q8k_type(qtype)) return amx_q8k_matmul(qtype, y, packed, num_rows, out_features, in_features, a, num_threads);
      return amx_int8_matmul(qtype, y, packed, num_rows, out_features, in_features, a, num_threads);
    }
  }
#endif
#ifdef GGUF_AVX512
  if constexpr (ISA >= kAvx512) return int8_matmul_avx512(qtype, y, packed, num_rows, out_features, in_features, a, num_threads);
#endif
#pragma omp parallel num_threads(num_threads)
  {
    uint8_t* u = static_cast<uint8_t*>(thread_buffer(0, padded + sizeof(float) * 2 * groups));
    float* s16 = reinterpret_cast<float*>(u + padded);
    float* c16 = s16 + groups;
    std::memset(u, 0, padded + sizeof(float) * 2 * groups);
    for_rows_streamed(out_features, [&](int64_t n) {
      const uint8_t* row = packed + n * row_bytes;
      for (int64_t b = 0; b < num_blocks; ++b) {
        int8_values(qtype, row + b * t.bytes, u + b * t.weights);
        int8_scales(qtype, row + b * t.bytes, s16 + b * (t.weights / 16), c16 + b * (t.weights / 16));
      }
      for (int64_t r0 = 0; r0 < num_rows; r0 += kRowGroup) {
        const int rows = num_rows - r0 < kRowGroup ? static_cast<int>(num_rows - r0) : kRowGroup;
        int8_dot_group<ISA, kSigned>(y + r0 * out_features + n, out_features, u, s16, c16, a, r0, rows);
      }
    });
  }
}


// The best path this build and this process can run (AMX: where Linux grants the tiles).
int best_isa() {
#ifdef GGUF_AMX
  if (amx_permitted()) return kAvx512Amx;
#endif
  return kBestIsa;
}

template <int ISA>
void run(int qtype, float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
         int64_t in_features, int num_threads, bool use_int8) {
  if (use_int8) {
    if (signed_values(qtype))
      int8_matmul<ISA, true>(qtype, y, x, packed, num_rows, out_features, in_features, num_threads);
    else
      int8_matmul<ISA, false>(qtype, y, x, packed, num_rows, out_features, in_features, num_threads);
    return;
  }
#ifdef GGUF_AVX2
  if constexpr (ISA == kAvx2) {
    if (num_rows >= kTiledRows)
      return tiled_matmul<V256>(qtype, y, x, packed, num_rows, out_features, in_features, num_threads);
    return fused_matmul<V256>(qtype, y, x, packed, num_rows, out_features, in_features, num_threads);
  }
#endif
#ifdef GGUF_AMX_EXACT
  if constexpr (ISA == kAvx512Amx) {
    if (num_rows >= kExactMinRows && num_rows < kAmxMinRows && exact_type(qtype))
      return amx_exact_matmul(qtype, y, x, packed, num_rows, out_features, in_features, num_threads);
  }
#endif
#ifdef GGUF_AMX
  if constexpr (ISA == kAvx512Amx) {
    if (num_rows >= kAmxMinRows) return amx_matmul(qtype, y, x, packed, num_rows, out_features, in_features, num_threads);
  }
#endif
#ifdef GGUF_AVX512
  if constexpr (ISA >= kAvx512) {
    if (num_rows >= kTiledRows)
      return tiled_matmul<V512>(qtype, y, x, packed, num_rows, out_features, in_features, num_threads);
    return fused_matmul<V512>(qtype, y, x, packed, num_rows, out_features, in_features, num_threads);
  }
#endif
  rows_matmul<ISA>(qtype, y, x, packed, num_rows, out_features, in_features, num_threads);
}

}  // namespace

extern "C" {

// y: [rows, out_features] float32 = x [rows, in_features] float32 times W^T, W the GGUF blocks of
// type qtype_id (ggml's id) in `packed`: out_features rows of in_features / weights-per-block
// blocks. in_features: a multiple of the type's block. use_int8: x quantized per block of 32.
void gguf_matmul(int qtype_id, float* y, const float* x, const uint8_t* packed, int64_t rows, int64_t out_features,
                 int64_t in_features, int num_threads, int use_int8) {
  if (type_size(qtype_id).weights == 0 || rows <= 0 || out_features <= 0) return;
  if (g_isa < 0) g_isa = best_isa();
  switch (g_isa) {
#ifdef GGUF_AMX
    case kAvx512Amx: return run<kAvx512Amx>(qtype_id, y, x, packed, rows, out_features, in_features, num_threads, use_int8);
#endif
#ifdef GGUF_AVX512
    case kAvx512: return run<kAvx512>(qtype_id, y, x, packed, rows, out_features, in_features, num_threads, use_int8);
#endif
#ifdef GGUF_AVX2
    case kAvx2: return run<kAvx2>(qtype_id, y, x, packed, rows, out_features, in_features, num_threads, use_int8);
#endif
    default: return run<kPortable>(qtype_id, y, x, packed, rows, out_features, in_features, num_threads, use_int8);
  }
}

// out: [num_indices, in_features] float32, the rows `indices` of W dequantized exactly as gguf-py
// does (embedding lookups, tests).
void gguf_dequantize_rows(int qtype_id, float* out, const uint8_t* packed, const int64_t* indices, int64_t num_indices,
                          int64_t in_features, int num_threads) {
  const TypeSize t = type_size(qtype_id);
  if (t.weights == 0) return;
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t i = 0; i < num_indices; ++i)
    expand_row_portable(qtype_id, packed + indices[i] * row_bytes, num_blocks, out + i * in_features);
}

// x quantized as the int8 path does for a product with W of type qtype_id (tests): qx [rows,
// in_features] int8, dx [rows, in_features / 32] (each block's scale, repeated over its 32s).
void gguf_quantize_activations(int qtype_id, int8_t* qx, float* dx, const float* x, int64_t rows, int64_t in_features) {
  const int64_t padded = round_up(in_features, 64), groups = padded / 16;
  int8_t* q = static_cast<int8_t*>(std::malloc(rows * padded));
  float* d16 = static_cast<float*>(std::malloc(sizeof(float) * rows * groups * 2));
  quantize_activations(x, rows, in_features, padded, q, d16, d16 + rows * groups, activation_block(qtype_id));
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(qx + r * in_features, q + r * padded, in_features);
    for (int64_t b = 0; b < in_features / 32; ++b) dx[r * (in_features / 32) + b] = d16[r * groups + 2 * b];
  }
  std::free(q);
  std::free(d16);
}

// Reads `bytes` at p (a multiple of 256) as the products read a weight: each of num_threads
// threads its share in kStreams interleaved runs with software prefetch, 256 bytes a step (on AVX2:
// 32-byte loads summed as bytes). Returns a checksum, so that nothing is left out; a benchmark times
// it for the machine's read bandwidth.
uint64_t gguf_read_sum(const uint8_t* p, int64_t bytes, int num_threads) {
  const int64_t steps = bytes / 256;
  uint64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
  {
#ifdef GGUF_AVX2
    __m256i acc = _mm256_setzero_si256();
    for_rows_streamed(steps, [&](int64_t i) {
      const uint8_t* q = p + 256 * i;
      prefetch_ahead(q, 256);
      __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      for (int k = 32; k < 256; k += 32) v = _mm256_xor_si256(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k)));
      acc = _mm256_add_epi64(acc, _mm256_sad_epu8(v, _mm256_setzero_si256()));
    });
    alignas(32) uint64_t lanes[4];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
    total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
    for_rows_streamed(steps, [&](int64_t i) {
      for (int k = 0; k < 256; k += 8) {
        uint64_t v;
        std::memcpy(&v, p + 256 * i + k, 8);
        total += v;
      }
    });
#endif
  }
  return total;
}

// The int8 multiply-adds done by `iterations` of the current path's peak loop (8 independent
// chains of its widest int8 instruction: VPDPBUSD on AVX-512 VNNI, VPMADDUBSW on AVX2) on each of
// num_threads threads, summed: a benchmark times it for the machine's int8 peak. 0 on the portable path.
int64_t gguf_int8_peak(int64_t iterations, int num_threads) {
  if (g_isa < 0) g_isa = best_isa();
  int64_t total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
  {
#ifdef GGUF_AVX512
    if (g_isa >= kAvx512) total += vnni_peak_loop(iterations);
#endif
#ifdef GGUF_INT8_AVX2
    if (g_isa == kAvx2) total += int8_avx2::peak_loop(iterations);
#endif
  }
  return total;
}

// The ISA path gguf_matmul runs: 0 portable C++, 1 AVX2, 2 AVX-512 (VNNI), 3 AVX-512 and AMX.
int gguf_isa() { return g_isa < 0 ? best_isa() : g_isa; }
int gguf_best_isa() { return best_isa(); }
// Selects the path (tests, benchmarks); returns 0, or -1 (unchanged) if this build lacks it.
int gguf_set_isa(int isa) {
  if (isa < 0 || isa > best_isa()) return -1;
  g_isa = isa;
  return 0;
}

}  // extern "C"
