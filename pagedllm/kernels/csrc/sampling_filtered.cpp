// A draw from softmax(x / T) restricted by top-k, top-p and min-p, one row of logits per sequence,
// rows spread over threads: the filters of vLLM's sampler (the sampling package's
// `filter_top_k_top_p_min_p`, kept for other devices) without sorting the vocabulary.
//
// z = x / T (computed as x * (1 / T): a vector multiply, where a divide takes ten times as long;
// the same z to an ulp). Of a row's tokens:
//   top-k (0 < k < n): those with z >= the k-th largest z (ties at it kept, as torch's mask does);
//   top-p (p < 1): of those, in order of z from the largest, each token while the probability of
//     the tokens before it (softmax over the tokens top-k kept) is below p;
//   min-p (> 0): of those, the tokens whose probability is at least min-p times the largest's,
//     that is exp(z - max z) >= min-p;
// and the draw walks the tokens kept in vocabulary order to where the running sum of their
// weights exp(z - max z) passes u times their total, u uniform in [0, 1) from the caller.
//
// torch sorts the whole row for top-p (20 ms a token at a vocabulary of 262,144 on a 2-core EPYC).
// Here top-k finds its k-th largest z with a heap over one pass of the row, and top-p among the
// tokens top-k kept sorts those few; top-p alone sums the weights in buckets of z (1/64 wide, those
// within 8 below the largest first, then down to 32), keeps every token of the buckets before the
// one where the mass reaches p, and sorts only that bucket's tokens. Min-p alone is a threshold.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#define FILTERED_AVX2 1
#endif
#include "sampling_rows.h"

namespace {

#ifdef FILTERED_AVX2
using namespace pagedllm_simd;
#endif

using pagedllm_sampling::before;
using pagedllm_sampling::cut_top_p;
using pagedllm_sampling::draw_kept;
using pagedllm_sampling::exp_sum;
using pagedllm_sampling::kth_largest_z;
using pagedllm_sampling::row_max;
using pagedllm_sampling::Token;
using pagedllm_sampling::tokens_from;

// Top-p without top-k places its cut by the weights' mass in buckets of z below the largest,
// 1/kBucketsPerNat wide, kBuckets of them (the last holding everything further down: weights
// below e^-32 of the largest's). A token's bucket is floor((max - z) * kBucketsPerNat): a larger
// z never lies in a later bucket.
constexpr int kBuckets = 2048;
constexpr float kBucketsPerNat = 64.0f;

inline int bucket_of(float z, float max) {
  const float b = (max - z) * kBucketsPerNat;
  return b < static_cast<float>(kBuckets - 1) ? static_cast<int>(b) : kBuckets - 1;
}

// mass[b]: the weights exp(z - max) of the tokens in bucket b (double sums), for the first
// `buckets` buckets (tokens further down are left out; at most kBuckets - 1: the last bucket's
// weights, below e^-32 of the largest's, are in no sum).
void bucket_masses(const float* x, int64_t n, float inv_t, float max, int buckets, std::vector<double>& mass) {
  mass.assign(kBuckets, 0.0);
  int64_t j = 0;
#ifdef FILTERED_AVX2
  const __m256 vt = _mm256_set1_ps(inv_t), vmax = _mm256_set1_ps(max), per_nat = _mm256_set1_ps(kBucketsPerNat);
  const __m256 bound = _mm256_set1_ps(static_cast<float>(buckets));
  for (; j + 8 <= n; j += 8) {
    const __m256 z = _mm256_mul_ps(_mm256_loadu_ps(x + j), vt);
    const __m256 below = _mm256_mul_ps(_mm256_sub_ps(vmax, z), per_nat);
    int near = _mm256_movemask_ps(_mm256_cmp_ps(below, bound, _CMP_LT_OQ));  // (-inf z: never)
    if (near == 0) continue;
    alignas(32) float zs[8], ws[8];
    _mm256_store_ps(zs, z);
    _mm256_store_ps(ws, exp8(_mm256_sub_ps(z, vmax)));
    for (; near != 0; near &= near - 1) mass[bucket_of(zs[__builtin_ctz(near)], max)] += ws[__builtin_ctz(near)];
  }
#endif
  for (; j < n; ++j) {
    const float z = x[j] * inv_t;
    if ((max - z) * kBucketsPerNat < static_cast<float>(buckets)) mass[bucket_of(z, max)] += std::exp(static_cast<double>(z) - max);
  }
}

// The bucket where the mass of the buckets before it reaches p * total, and that mass: looked for
// among the buckets within 8 nats of the largest first (a model's top-p cut lies there; only
// those tokens are summed by bucket), then among all.
int cut_bucket(const float* x, int64_t n, float inv_t, float max, float p, double total, std::vector<double>& mass,
               double* before_cut) {
  for (const int buckets : {static_cast<int>(8 * kBucketsPerNat), kBuckets - 1}) {
    bucket_masses(x, n, inv_t, max, buckets, mass);
    double before = 0.0;
    for (int cut = 0; cut < buckets; ++cut) {
      if (before + mass[cut] >= p * total) {
        *before_cut = before;
        return cut;
      }
      before += mass[cut];
    }
    *before_cut = before;
  }
  return kBuckets - 1;  // (the rest, by rounding: every token is then a candidate)
}

// One row's draw; scratch per thread.
int64_t draw_filtered(const float* x, int64_t n, float inv_t, int64_t k, float p, float min_p, float u,
                      std::vector<Token>& heap, std::vector<double>& mass, std::vector<Token>& kept,
                      std::vector<Token>& edge) {
  const float max_x = row_max(x, n), max = max_x * inv_t;  // (a factor > 0 keeps the order)
  if (max != max || max == -INFINITY) return 0;  // (as the unfiltered draw does for such a row)
  const bool top_k = 0 < k && k < n, top_p = p < 1.0f;
  if (top_k) {
    tokens_from(x, n, inv_t, kth_largest_z(x, n, inv_t, k, heap), kept);
    if (top_p) cut_top_p(kept, max, p);
  } else if (top_p) {  // every token of the buckets before the cut's, and the cut's bucket sorted
    const double total = exp_sum(x, n, max_x, inv_t);  // (every weight of the row)
    double before_cut = 0.0;
    const int cut = cut_bucket(x, n, inv_t, max, p, total, mass, &before_cut);
    // The tokens of buckets up to the cut's (from a bucket further down: a z within rounding of a
    // bucket's edge is placed by bucket_of, as its weight was), the cut's own set aside to sort.
    const float floor = cut == kBuckets - 1 ? -INFINITY : max - static_cast<float>(cut + 2) / kBucketsPerNat;
    tokens_from(x, n, inv_t, floor, kept);
    edge.clear();
    size_t m = 0;
    for (const Token& c : kept) {
      const int b = bucket_of(c.z, max);
      if (b == cut) edge.push_back(c);
      if (b <= cut) kept[m++] = c;
    }
    kept.resize(m);
    std::sort(edge.begin(), edge.end(), before);
    double mass_before = before_cut;
    for (const Token& c : edge) {
      if (mass_before / total >= p) {  // c and every token after it go
        kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const Token& o) { return !before(o, c); }), kept.end());
        break;
      }
      mass_before += std::exp(static_cast<double>(c.z) - max);
    }
  } else {  // min-p alone: the tokens it can keep, exp(z - max) >= min_p, lie at z >= max + log(min_p)
    tokens_from(x, n, inv_t, max + std::log(min_p) - 1e-3f, kept);
  }
  return draw_kept(kept, max, min_p, u);
}

}  // namespace

extern "C" {

// tokens[r]: the draw from softmax(x[r] / temperature[r]) restricted by top_k[r] (0 or >= cols:
// none), top_p[r] (1: none) and min_p[r] (0: none) at uniform[r] in [0, 1). x: [rows, cols] with
// rows `row_stride` apart.
void sample_filtered_rows_f32(int64_t* tokens, const float* x, int rows, int64_t cols, int64_t row_stride,
                              const float* temperature, const int64_t* top_k, const float* top_p,
                              const float* min_p, const float* uniform, int num_threads) {
#pragma omp parallel num_threads(rows < num_threads ? rows : num_threads)
  {
    std::vector<Token> heap;
    std::vector<double> mass;
    std::vector<Token> kept, edge;
#pragma omp for schedule(dynamic, 1)
    for (int r = 0; r < rows; ++r)
      tokens[r] = draw_filtered(x + r * row_stride, cols, 1.0f / temperature[r], top_k[r], top_p[r], min_p[r], uniform[r],
                                heap, mass, kept, edge);
  }
}

}  // extern "C"
