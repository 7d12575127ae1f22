// Passes over a row of logits shared by the sampling kernels (sampling.cpp, sampling_filtered.cpp):
// its maximum, its sum of weights, its K largest values, and the filtered draw among the tokens
// the filters keep.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace pagedllm_sampling {

// The row's maximum; NaN if the row holds a NaN (as torch's max and logsumexp give).
inline float row_max(const float* x, int64_t n) {
  float max = -INFINITY;
  bool nan = false;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 wmax = _mm512_set1_ps(-INFINITY);
  __mmask16 wnan = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    wmax = _mm512_max_ps(wmax, v);
    wnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  max = _mm512_reduce_max_ps(wmax);
  nan = wnan != 0;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vmax = _mm256_set1_ps(max), vnan = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    vmax = _mm256_max_ps(vmax, v);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  max = pagedllm_simd::hmax(vmax);
  nan = nan || _mm256_movemask_ps(vnan) != 0;
#endif
  for (; j < n; ++j) {
    max = x[j] > max ? x[j] : max;
    nan = nan || x[j] != x[j];
  }
  return nan ? NAN : max;
}

#if defined(__AVX2__) && defined(__FMA__)
// exp((x - max) * inv_t) for 8 logits, exactly 0 where x is -inf.
inline __m256 weights8(const float* x, __m256 max, __m256 inv_t) {
  const __m256 v = _mm256_loadu_ps(x);
  const __m256 finite = _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_GT_OQ);
  return _mm256_and_ps(pagedllm_simd::exp8(_mm256_mul_ps(_mm256_sub_ps(v, max), inv_t)), finite);
}
#endif

inline float weight1(float x, float max, float inv_t) { return x == -INFINITY ? 0.0f : std::exp((x - max) * inv_t); }

// Sum of the weights exp((x - max) * inv_t), the vector lanes added up at the end (a part's sum:
// the same order at any thread count).
inline float exp_sum(const float* x, int64_t n, float max, float inv_t) {
  float total = 0.0f;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vmax = _mm256_set1_ps(max), vinv = _mm256_set1_ps(inv_t);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
#if defined(__AVX512F__)
  {  // lanes 0-7 are a0's columns, 8-15 a1's: the same sums as the 8-wide loop below
    const __m512 wmax = _mm512_set1_ps(max), winv = _mm512_set1_ps(inv_t), ninf = _mm512_set1_ps(-INFINITY);
    __m512 a = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      const __mmask16 finite = _mm512_cmp_ps_mask(v, ninf, _CMP_GT_OQ);
      a = _mm512_add_ps(a, _mm512_maskz_mov_ps(finite, pagedllm_simd::exp16(_mm512_mul_ps(_mm512_sub_ps(v, wmax), winv))));
    }
    a0 = _mm512_castps512_ps256(a);
    a1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
  }
#endif
  for (; j + 16 <= n; j += 16) {
    a0 = _mm256_add_ps(a0, weights8(x + j, vmax, vinv));
    a1 = _mm256_add_ps(a1, weights8(x + j + 8, vmax, vinv));
  }
  for (; j + 8 <= n; j += 8) a0 = _mm256_add_ps(a0, weights8(x + j, vmax, vinv));
  total = pagedllm_simd::hsum(_mm256_add_ps(a0, a1));
#endif
  for (; j < n; ++j) total += weight1(x[j], max, inv_t);
  return total;
}

// A token and its value z.
struct Token {
  float z;
  int64_t j;
};

// The largest z first; among equal z, the lower token id.
inline bool before(const Token& a, const Token& b) { return a.z > b.z || (a.z == b.z && a.j < b.j); }

// The K largest z = x * inv_t of the row in `heap` (a min-heap: a column enters only where it beats
// the least kept, so of tokens tied at the K-th the first seen stay); returns the K-th largest z
// (counting repeats; -inf where the row is shorter than K).
inline float kth_largest_z(const float* x, int64_t n, float inv_t, int64_t k, std::vector<Token>& heap) {
  heap.clear();
  const auto min_first = [](const Token& a, const Token& b) { return a.z > b.z; };
  int64_t j = 0;
  for (; j < n && static_cast<int64_t>(heap.size()) < k; ++j) {
    heap.push_back({x[j] * inv_t, j});
    std::push_heap(heap.begin(), heap.end(), min_first);
  }
  if (static_cast<int64_t>(heap.size()) < k) return -INFINITY;
  float least = heap.front().z;
  const auto enter = [&](float v, int64_t at) {
    if (v <= least) return;
    std::pop_heap(heap.begin(), heap.end(), min_first);
    heap.back() = {v, at};
    std::push_heap(heap.begin(), heap.end(), min_first);
    least = heap.front().z;
  };
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vt = _mm256_set1_ps(inv_t);
  for (; j + 8 <= n; j += 8) {
    const __m256 z = _mm256_mul_ps(_mm256_loadu_ps(x + j), vt);
    int above = _mm256_movemask_ps(_mm256_cmp_ps(z, _mm256_set1_ps(least), _CMP_GT_OQ));
    if (above == 0) continue;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, z);
    for (; above != 0; above &= above - 1) enter(lanes[__builtin_ctz(above)], j + __builtin_ctz(above));
  }
#endif
  for (; j < n; ++j) enter(x[j] * inv_t, j);
  return least;
}

// The tokens with z >= floor, in vocabulary order (finite z only).
inline void tokens_from(const float* x, int64_t n, float inv_t, float floor, std::vector<Token>& out) {
  out.clear();
  floor = std::max(floor, -std::numeric_limits<float>::max());  // (a -inf z is never kept)
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 vt = _mm256_set1_ps(inv_t), vfloor = _mm256_set1_ps(floor);
  for (; j + 8 <= n; j += 8) {
    const __m256 z = _mm256_mul_ps(_mm256_loadu_ps(x + j), vt);
    int kept = _mm256_movemask_ps(_mm256_cmp_ps(z, vfloor, _CMP_GE_OQ));
    if (kept == 0) continue;
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, z);
    for (; kept != 0; kept &= kept - 1) out.push_back({lanes[__builtin_ctz(kept)], j + __builtin_ctz(kept)});
  }
#endif
  for (; j < n; ++j) {
    const float z = x[j] * inv_t;
    if (z >= floor) out.push_back({z, j});
  }
}

// Top-p over `kept`, every token top-k left: drops, in order of z, each token from the first
// whose predecessors' probability reaches p.
inline void cut_top_p(std::vector<Token>& kept, float max, float p) {
  double total = 0.0;
  for (const Token& c : kept) total += std::exp(static_cast<double>(c.z) - max);
  std::sort(kept.begin(), kept.end(), before);
  double mass = 0.0;
  for (size_t i = 0; i < kept.size(); ++i) {
    if (mass / total >= p) {
      kept.resize(i);
      return;
    }
    mass += std::exp(static_cast<double>(kept[i].z) - max);
  }
}

// The draw among `kept` (the tokens the filters before min-p left; z in place): min-p drops those
// whose weight exp(z - max) is below min_p, and the draw walks the rest in vocabulary order to
// where the running sum of their weights passes u times their total.
inline int64_t draw_kept(std::vector<Token>& kept, float max, float min_p, float u) {
  const auto by_id = [](const Token& a, const Token& b) { return a.j < b.j; };
  if (!std::is_sorted(kept.begin(), kept.end(), by_id)) std::sort(kept.begin(), kept.end(), by_id);
  double total = 0.0;
  size_t m = 0;
  for (const Token& c : kept) {  // min-p, and each kept token's weight (in z's place)
    const float w = std::exp(c.z - max);
    if (min_p > 0.0f && w < min_p) continue;
    kept[m++] = {w, c.j};
    total += w;
  }
  kept.resize(m);
  const double target = static_cast<double>(u) * total;
  double running = 0.0;
  for (const Token& c : kept) {
    running += c.z;
    if (running > target) return c.j;
  }
  return kept.empty() ? 0 : kept.back().j;
}

}  // namespace pagedllm_sampling
