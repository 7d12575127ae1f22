// The per-tile inner loops of paged_attention.cpp: element conversion, prefetching, and the
// score (q . k) and value-accumulation kernels for R query rows at a time, in AVX2 and portable
// forms. Kept apart so that paged_attention.cpp reads as the plan and its passes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#define PAGED_AVX2 1
#endif

namespace paged_attention_tiles {

using namespace pagedllm_bf16;

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

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return widen8(p); }
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

// acc_r[d0 : d0 + 8W] += sum_j p_r[j] * values[j][d0 : d0 + 8W] for R rows: R x W accumulators.
template <int R, int W, typename T>
inline void accumulate_chunk(const float* p, int64_t p_stride, const T* values, int n, int head_dim, int d0,
                             float* acc) {
  __m256 a[R][W];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) a[r][c] = _mm256_loadu_ps(acc + r * head_dim + d0 + 8 * c);
  for (int j = 0; j < n; ++j) {
    __m256 pj[R];
    for (int r = 0; r < R; ++r) pj[r] = _mm256_set1_ps(p[r * p_stride + j]);
    const T* v = values + static_cast<int64_t>(j) * head_dim + d0;
    for (int c = 0; c < W; ++c) {
      const __m256 vc = load8(v + 8 * c);
      for (int r = 0; r < R; ++r) a[r][c] = _mm256_fmadd_ps(pj[r], vc, a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc + r * head_dim + d0 + 8 * c, a[r][c]);
}

// acc_r += sum_j p_r[j] * values[j] for R rows (acc stride head_dim, p stride p_stride) and n
// values of one tile: 32 dimensions at a time, then 8.
template <int R, typename T>
inline void accumulate_values(const float* p, int64_t p_stride, const T* values, int n, int head_dim, float* acc) {
  int d0 = 0;
  for (; d0 + 32 <= head_dim; d0 += 32) accumulate_chunk<R, 4>(p, p_stride, values, n, head_dim, d0, acc);
  for (; d0 < head_dim; d0 += 8) accumulate_chunk<R, 1>(p, p_stride, values, n, head_dim, d0, acc);
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
