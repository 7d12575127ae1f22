// The per-tile inner loops of paged_attention.cpp: element conversion, prefetching, and the
// score (q . k) and value-accumulation kernels for R query rows at a time, in AVX-512, AVX2 and
// portable forms. Kept apart so that paged_attention.cpp reads as the plan and its passes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#define PAGED_AVX2 1
#if defined(__AVX512F__)
#define PAGED_AVX512 1  // 16-wide value accumulation
#if defined(__AVX512BF16__)
#define PAGED_AVX512_BF16 1  // bfloat16 scores by vdpbf16ps
#endif
#endif
#endif

namespace paged_attention_tiles {

using namespace pagedllm_bf16;

// Whether bfloat16 queries (Q) meet bfloat16 keys (T) in score_keys_bf16: the queries' own
// values go in, so only the order of the float32 sums changes.
template <typename Q, typename T>
constexpr bool kBf16Scores =
#ifdef PAGED_AVX512_BF16
    std::is_same_v<Q, uint16_t> && std::is_same_v<T, uint16_t>;
#else
    false;
#endif

// How many blocks ahead to prefetch: enough to hide memory latency for blocks of 16 tokens.
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2
#endif
constexpr int kPrefetchAhead = PREFETCH_AHEAD;

// Prefetch a tile into L1 (`Locality` 3) or L2 (1).
template <int Locality = 3, typename T>
inline void prefetch_tile(const T* tile, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(tile);
  const int64_t bytes = elements * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, Locality);
}

// Query rows that share a KV head (the heads of a grouped-query group, the tokens of a tile)
// are processed R at a time: each key or value vector loaded from the pool feeds R rows.
constexpr int kRowsPerPass = 3;

// f(first row, std::integral_constant<int, R>) over `rows` rows from `first_row`, R <= 3 at a time.
template <typename F>
inline void for_row_groups(int first_row, int rows, F&& f) {
  for (int r0 = 0; r0 < rows; r0 += kRowsPerPass) {
    const int left = rows - r0;
    if (left >= 3) f(first_row + r0, std::integral_constant<int, 3>{});
    else if (left == 2) f(first_row + r0, std::integral_constant<int, 2>{});
    else f(first_row + r0, std::integral_constant<int, 1>{});
  }
}

#ifdef PAGED_AVX2
using namespace pagedllm_simd;

// The four horizontal sums of a, b, c, d, in one vector.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  __m256 abcd = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// The largest of s[0..n).
inline float max_of(const float* s, int n) {
  int i = 0;
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
  float max = hmax(vmax);
  for (; i < n; ++i) max = s[i] > max ? s[i] : max;
  return max;
}

// s[i] = exp(s[i] - max) for i < n; returns their sum.
inline float softmax_numerators(float* s, int n, float max) {
  const __m256 vm = _mm256_set1_ps(max);
  __m256 vsum = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - max);
    sum += s[i];
  }
  return sum;
}

// tanh of 8 floats (Cephes' single-precision tanhf, relative error ~1e-7): an odd polynomial
// below |x| = 0.625, 1 - 2 / (exp(2|x|) + 1) above it, with x's sign.
inline __m256 tanh8(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 poly = _mm256_set1_ps(-5.70498872745e-3f);
  poly = _mm256_fmadd_ps(poly, z, _mm256_set1_ps(2.06390887954e-2f));
  poly = _mm256_fmadd_ps(poly, z, _mm256_set1_ps(-5.37397155531e-2f));
  poly = _mm256_fmadd_ps(poly, z, _mm256_set1_ps(1.33314422036e-1f));
  poly = _mm256_fmadd_ps(poly, z, _mm256_set1_ps(-3.33332819422e-1f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(poly, z), x, x);
  const __m256 e = exp8(_mm256_add_ps(ax, ax));
  const __m256 large = _mm256_or_ps(
      _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f)))),
      sign);
  return _mm256_blendv_ps(large, small, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
}

// s[i] = cap * tanh(s[i] / cap) for i < n (logit soft-capping), 8 at a time; the last few go
// through the same vector code, so a score does not depend on where it falls in the row.
inline void soft_cap(float* s, int n, float cap) {
  const __m256 vcap = _mm256_set1_ps(cap), vinv = _mm256_set1_ps(1.0f / cap);
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(s + i, _mm256_mul_ps(vcap, tanh8(_mm256_mul_ps(_mm256_loadu_ps(s + i), vinv))));
  if (i < n) {
    float tail[8] = {};
    std::memcpy(tail, s + i, sizeof(float) * (n - i));
    _mm256_storeu_ps(tail, _mm256_mul_ps(vcap, tanh8(_mm256_mul_ps(_mm256_loadu_ps(tail), vinv))));
    std::memcpy(s + i, tail, sizeof(float) * (n - i));
  }
}

// scores[r * score_stride + j] = scale * q_r . keys[j], for R query rows (stride head_dim) and
// n keys of one tile (head_dim a multiple of 8). Four keys at a time: 4R accumulators.
template <int R, typename T>
inline void score_keys(const float* q, const T* keys, int n, int head_dim, float scale, float* scores,
                       int64_t score_stride) {
  const __m128 vscale = _mm_set1_ps(scale);
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* k0 = keys + static_cast<int64_t>(j) * head_dim;
    __m256 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
    for (int d = 0; d < head_dim; d += 8) {
      __m256 qd[R];
      for (int r = 0; r < R; ++r) qd[r] = _mm256_loadu_ps(q + r * head_dim + d);
      for (int c = 0; c < 4; ++c) {
        const __m256 k = load8(k0 + c * head_dim + d);
        for (int r = 0; r < R; ++r) a[r][c] = _mm256_fmadd_ps(qd[r], k, a[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(scores + r * score_stride + j, _mm_mul_ps(hsum4(a[r][0], a[r][1], a[r][2], a[r][3]), vscale));
  }
  // The last keys of a tile, one at a time, summed in the same order as hsum4 sums each of four
  // keys above: a key's score then does not depend on how many keys share its tile.
  for (; j < n; ++j) {
    const T* k = keys + static_cast<int64_t>(j) * head_dim;
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int d = 0; d < head_dim; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * head_dim + d), load8(k + d), a);
      scores[r * score_stride + j] = _mm_cvtss_f32(hsum4(a, a, a, a)) * scale;
    }
  }
}

#ifdef PAGED_AVX512_BF16
// The four horizontal sums of four 16-float vectors: each halved to 8, then hsum4 (a vector's
// sum does not depend on the other three).
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  auto half = [](__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  };
  return hsum4(half(a), half(b), half(c), half(d));
}

// score_keys for bfloat16 queries and keys (head_dim a multiple of 32): vdpbf16ps multiplies 32
// pairs of bfloat16 per instruction, exactly, into float32 sums, with no conversion of the keys.
template <int R>
inline void score_keys_bf16(const uint16_t* q, const uint16_t* keys, int n, int head_dim, float scale, float* scores,
                            int64_t score_stride) {
  const __m128 vscale = _mm_set1_ps(scale);
  auto load = [](const uint16_t* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); };
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const uint16_t* k0 = keys + static_cast<int64_t>(j) * head_dim;
    __m512 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d += 32) {
      __m512bh qd[R];
      for (int r = 0; r < R; ++r) qd[r] = load(q + r * head_dim + d);
      for (int c = 0; c < 4; ++c) {
        const __m512bh k = load(k0 + c * head_dim + d);
        for (int r = 0; r < R; ++r) a[r][c] = _mm512_dpbf16_ps(a[r][c], qd[r], k);
      }
    }
    for (int r = 0; r < R; ++r)
      _mm_storeu_ps(scores + r * score_stride + j, _mm_mul_ps(hsum4(a[r][0], a[r][1], a[r][2], a[r][3]), vscale));
  }
  for (; j < n; ++j) {  // as above, one key at a time
    const uint16_t* k = keys + static_cast<int64_t>(j) * head_dim;
    for (int r = 0; r < R; ++r) {
      __m512 a = _mm512_setzero_ps();
      for (int d = 0; d < head_dim; d += 32) a = _mm512_dpbf16_ps(a, load(q + r * head_dim + d), load(k + d));
      scores[r * score_stride + j] = _mm_cvtss_f32(hsum4(a, a, a, a)) * scale;
    }
  }
}
#endif

// The vector operations of accumulate_chunk, 8 floats to a vector (Lanes16 below: 16).
struct Lanes8 {
  using V = __m256;
  static constexpr int kWidth = 8;
  template <typename T>
  static V load(const T* p) { return load8(p); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
};

// acc_r[d0 : d0 + wW] += sum_j p_r[j] * values[j][d0 : d0 + wW] for R rows, w = L::kWidth floats
// to a vector: R x W accumulators. Each dimension's sum takes the same steps whatever w (one FMA
// per value, in order), so the 8- and 16-wide kernels agree bit for bit.
template <typename L, int R, int W, typename T>
inline void accumulate_chunk(const float* p, int64_t p_stride, const T* values, int n, int head_dim, int d0,
                             float* acc) {
  constexpr int w = L::kWidth;
  typename L::V a[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) a[r][c] = L::load(acc + r * head_dim + d0 + w * c);
  for (int j = 0; j < n; ++j) {
    typename L::V pj[R];
    for (int r = 0; r < R; ++r) pj[r] = L::set1(p[r * p_stride + j]);
    const T* v = values + static_cast<int64_t>(j) * head_dim + d0;
    for (int c = 0; c < W; ++c) {
      const typename L::V vc = L::load(v + w * c);
      for (int r = 0; r < R; ++r) a[r][c] = L::fmadd(pj[r], vc, a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) L::store(acc + r * head_dim + d0 + w * c, a[r][c]);
}

#ifdef PAGED_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Lanes8 at 16 floats to a vector.
struct Lanes16 {
  using V = __m512;
  static constexpr int kWidth = 16;
  template <typename T>
  static V load(const T* p) { return load16(p); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
#endif

// acc_r += sum_j p_r[j] * values[j] for R rows (acc stride head_dim, p stride p_stride) and n
// values of one tile: 64 dimensions at a time with AVX-512 (then 16), else 32, then 8.
template <int R, typename T>
inline void accumulate_values(const float* p, int64_t p_stride, const T* values, int n, int head_dim, float* acc) {
  int d0 = 0;
#ifdef PAGED_AVX512
  for (; d0 + 64 <= head_dim; d0 += 64) accumulate_chunk<Lanes16, R, 4>(p, p_stride, values, n, head_dim, d0, acc);
  for (; d0 + 16 <= head_dim; d0 += 16) accumulate_chunk<Lanes16, R, 1>(p, p_stride, values, n, head_dim, d0, acc);
#endif
  for (; d0 + 32 <= head_dim; d0 += 32) accumulate_chunk<Lanes8, R, 4>(p, p_stride, values, n, head_dim, d0, acc);
  for (; d0 < head_dim; d0 += 8) accumulate_chunk<Lanes8, R, 1>(p, p_stride, values, n, head_dim, d0, acc);
}
#else
// Portable twins of the AVX2 softmax helpers above, so the softmax pass reads the same either way.
inline float max_of(const float* s, int n) {
  float max = -INFINITY;
  for (int pos = 0; pos < n; ++pos) max = s[pos] > max ? s[pos] : max;
  return max;
}

inline float softmax_numerators(float* s, int n, float max) {
  float sum = 0.0f;
  for (int pos = 0; pos < n; ++pos) {
    s[pos] = std::exp(s[pos] - max);
    sum += s[pos];
  }
  return sum;
}

inline void soft_cap(float* s, int n, float cap) {
  for (int i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] / cap);
}
#endif

template <typename T>
inline void score_keys_portable(const float* q, const T* keys, int n, int head_dim, float scale, float* scores) {
  for (int j = 0; j < n; ++j) {
    const T* k = keys + static_cast<int64_t>(j) * head_dim;
    float dot = 0.0f;
    for (int d = 0; d < head_dim; ++d) dot += q[d] * to_float(k[d]);
    scores[j] = dot * scale;
  }
}

template <typename T>
inline void accumulate_values_portable(const float* p, const T* values, int n, int head_dim, float* acc) {
  for (int j = 0; j < n; ++j) {
    const T* v = values + static_cast<int64_t>(j) * head_dim;
    for (int d = 0; d < head_dim; ++d) acc[d] += p[j] * to_float(v[d]);
  }
}

// R query rows (stride head_dim) against n keys of one tile. The one place that picks between
// the AVX2 and the portable kernel, so the scores pass does not carry the #ifdef.
template <int R, typename T>
inline void score_rows([[maybe_unused]] bool vector, const float* q, const T* keys, int n, int head_dim, float scale,
                       float* scores, int64_t score_stride) {
#ifdef PAGED_AVX2
  if (vector) return score_keys<R>(q, keys, n, head_dim, scale, scores, score_stride);
#endif
  for (int i = 0; i < R; ++i)
    score_keys_portable(q + i * head_dim, keys, n, head_dim, scale, scores + static_cast<size_t>(i) * score_stride);
}

// The same choice for the values pass.
template <int R, typename T>
inline void accumulate_rows([[maybe_unused]] bool vector, const float* p, int64_t p_stride, const T* values, int n,
                            int head_dim, float* acc) {
#ifdef PAGED_AVX2
  if (vector) return accumulate_values<R>(p, p_stride, values, n, head_dim, acc);
#endif
  for (int i = 0; i < R; ++i)
    accumulate_values_portable(p + static_cast<size_t>(i) * p_stride, values, n, head_dim, acc + i * head_dim);
}

}  // namespace paged_attention_tiles
