// Sampling over the vocabulary, one row of logits per sequence, rows spread over threads:
//   logsumexp_rows: log sum_j exp(x_j) (the normaliser of the reported log-probabilities) and,
//                   if asked, the greedy token: the first j where x_j is the row's maximum (a
//                   single long row split among the threads)
//   sample_rows: the token whose interval of the cumulative distribution softmax(x / T) holds
//                u * total, for a uniform u drawn by the caller
// Each replaces a chain of torch operators (divide, softmax, cumsum, search) that each stream
// the whole [rows, vocab] tensor through memory; here a row is read three times from cache.
// Masked tokens (x = -inf) have probability exactly zero and are never drawn.

#include <cmath>
#include <cstdint>

#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#define SAMPLING_AVX2 1
#endif

namespace {

#ifdef SAMPLING_AVX2
using namespace pagedllm_simd;

// exp((x - max) * inv_t) for 8 logits, exactly 0 where x is -inf.
inline __m256 weights8(const float* x, __m256 max, __m256 inv_t) {
  const __m256 v = _mm256_loadu_ps(x);
  const __m256 finite = _mm256_cmp_ps(v, _mm256_set1_ps(-INFINITY), _CMP_GT_OQ);
  return _mm256_and_ps(exp8(_mm256_mul_ps(_mm256_sub_ps(v, max), inv_t)), finite);
}
#endif

inline float weight1(float x, float max, float inv_t) { return x == -INFINITY ? 0.0f : std::exp((x - max) * inv_t); }

// The row's maximum; NaN if the row holds a NaN (as torch's max and logsumexp give).
float row_max(const float* x, int64_t n) {
  float max = -INFINITY;
  bool nan = false;
  int64_t j = 0;
#ifdef SAMPLING_AVX2
  __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    vmax = _mm256_max_ps(vmax, v);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  max = hmax(vmax);
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; j < n; ++j) {
    max = x[j] > max ? x[j] : max;
    nan = nan || x[j] != x[j];
  }
  return nan ? NAN : max;
}

// The first j with x[j] == max (torch.argmax's tie rule); -1 if there is none (max is NaN).
int64_t first_index_of(const float* x, int64_t n, float max) {
  int64_t j = 0;
#ifdef SAMPLING_AVX2
  const __m256 vmax = _mm256_set1_ps(max);
  for (; j + 8 <= n; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), vmax, _CMP_EQ_OQ));
    if (hits != 0) return j + __builtin_ctz(hits);
  }
#endif
  for (; j < n; ++j)
    if (x[j] == max) return j;
  return -1;
}

// Sum of the weights, in blocks of 8 added in order: `draw` walks the same blocks in the same
// order, so its running sum reaches exactly this total.
float row_total(const float* x, int64_t n, float max, float inv_t) {
  float total = 0.0f;
  int64_t j = 0;
#ifdef SAMPLING_AVX2
  const __m256 vmax = _mm256_set1_ps(max), vinv = _mm256_set1_ps(inv_t);
  for (; j + 8 <= n; j += 8) total += hsum(weights8(x + j, vmax, vinv));
#endif
  for (; j < n; ++j) total += weight1(x[j], max, inv_t);
  return total;
}

// Sum of exp(x - max) for the normaliser, which needs no particular order: the vector lanes are
// added up at the end (row_total adds each block in turn, for `draw`).
float exp_sum(const float* x, int64_t n, float max) {
  float total = 0.0f;
  int64_t j = 0;
#ifdef SAMPLING_AVX2
  const __m256 vmax = _mm256_set1_ps(max), one = _mm256_set1_ps(1.0f);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    a0 = _mm256_add_ps(a0, weights8(x + j, vmax, one));
    a1 = _mm256_add_ps(a1, weights8(x + j + 8, vmax, one));
  }
  for (; j + 8 <= n; j += 8) a0 = _mm256_add_ps(a0, weights8(x + j, vmax, one));
  total = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; j < n; ++j) total += weight1(x[j], max, 1.0f);
  return total;
}

// Columns below which a single row's normaliser stays on one thread.
constexpr int64_t kSplitColumns = 1 << 15;

// The first token whose running sum of weights exceeds target (the cumulative distribution
// inverted at target); if rounding leaves the sum just short, the last token of positive weight.
int64_t draw(const float* x, int64_t n, float max, float inv_t, float target) {
  float running = 0.0f;
  int64_t j = 0, last_positive = 0;
#ifdef SAMPLING_AVX2
  const __m256 vmax = _mm256_set1_ps(max), vinv = _mm256_set1_ps(inv_t);
  alignas(32) float lanes[8];
  for (; j + 8 <= n; j += 8) {
    const __m256 w = weights8(x + j, vmax, vinv);
    const float block = hsum(w);
    if (block <= 0.0f) continue;
    _mm256_store_ps(lanes, w);
    if (running + block > target) {  // the draw lies in this block
      for (int i = 0; i < 8; ++i) {
        if (lanes[i] <= 0.0f) continue;
        running += lanes[i];
        last_positive = j + i;
        if (running > target) return j + i;
      }
      return last_positive;
    }
    running += block;
    for (int i = 7; i >= 0; --i)
      if (lanes[i] > 0.0f) {
        last_positive = j + i;
        break;
      }
  }
#endif
  for (; j < n; ++j) {
    const float w = weight1(x[j], max, inv_t);
    if (w <= 0.0f) continue;
    running += w;
    last_positive = j;
    if (running > target) return j;
  }
  return last_positive;
}

}  // namespace

extern "C" {

// x: [rows, row_stride] float32; out: [rows]; argmax: [rows] or null (not wanted). The row is
// read from memory once: the later passes find it in the core's cache. Fewer rows than threads
// (a decode step of one sequence over a vocabulary of 150k-260k): each row's columns are split
// among the threads, each part's maximum, sum and first maximum combined after.
void logsumexp_rows_f32(float* out, int64_t* argmax, const float* x, int rows, int64_t cols, int64_t row_stride,
                        int num_threads) {
  if (rows < num_threads && cols >= kSplitColumns) {
    constexpr int kMaxParts = 64;
    const int parts = num_threads < kMaxParts ? num_threads : kMaxParts;
    for (int r = 0; r < rows; ++r) {
      const float* row = x + r * row_stride;
      float part_max[kMaxParts], part_sum[kMaxParts];
      int64_t part_first[kMaxParts];
#pragma omp parallel for schedule(static) num_threads(parts)
      for (int p = 0; p < parts; ++p) {
        const int64_t lo = cols * p / parts, hi = cols * (p + 1) / parts;
        part_max[p] = row_max(row + lo, hi - lo);
        part_sum[p] = part_max[p] == -INFINITY || part_max[p] != part_max[p] ? 0.0f
                                                                             : exp_sum(row + lo, hi - lo, part_max[p]);
        const int64_t first = argmax != nullptr ? first_index_of(row + lo, hi - lo, part_max[p]) : -1;
        part_first[p] = first < 0 ? -1 : lo + first;
      }
      float max = -INFINITY;
      bool nan = false;
      for (int p = 0; p < parts; ++p) {
        nan = nan || part_max[p] != part_max[p];
        max = part_max[p] > max ? part_max[p] : max;
      }
      if (nan) max = NAN;
      float total = 0.0f;
      int64_t first = -1;
      for (int p = 0; p < parts; ++p) {
        if (part_max[p] == -INFINITY || nan) continue;
        total += part_sum[p] * std::exp(part_max[p] - max);
        if (first < 0 && part_max[p] == max) first = part_first[p];
      }
      out[r] = max == -INFINITY ? -INFINITY : nan ? NAN : max + std::log(total);
      if (argmax != nullptr) argmax[r] = nan ? -1 : first;
    }
    return;
  }
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int r = 0; r < rows; ++r) {
    const float* row = x + r * row_stride;
    const float max = row_max(row, cols);
    out[r] = max == -INFINITY ? -INFINITY : max + std::log(exp_sum(row, cols, max));
    if (argmax != nullptr) argmax[r] = first_index_of(row, cols, max);
  }
}

// tokens[r]: the draw from softmax(x[r] * inv_temperature[r]) at uniform[r] in [0, 1).
void sample_rows_f32(int64_t* tokens, const float* x, int rows, int64_t cols, int64_t row_stride,
                     const float* inv_temperature, const float* uniform, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int r = 0; r < rows; ++r) {
    const float* row = x + r * row_stride;
    const float max = row_max(row, cols);
    const float total = row_total(row, cols, max, inv_temperature[r]);
    tokens[r] = draw(row, cols, max, inv_temperature[r], uniform[r] * total);
  }
}

}  // extern "C"
