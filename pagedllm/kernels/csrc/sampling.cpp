// Sampling over the vocabulary, one row of logits per sequence, rows spread over threads:
//   logsumexp_rows: log sum_j exp(x_j) (the normaliser of the reported log-probabilities) and,
//                   if asked, the greedy token: the first j where x_j is the row's maximum (a
//                   single long row split among the threads)
//   sample_rows: the token whose interval of the cumulative distribution softmax(x / T) holds
//                u * total, for a uniform u drawn by the caller (rows cut into parts, as the
//                normaliser's)
//   gguf_matmul_sample: an LM head's GGUF product with each row's greedy token (logsumexp_rows')
//                or top-k draw (sample_filtered_rows'), each part reduced as the product writes it
// Each replaces a chain of torch operators (divide, softmax, cumsum, search) that each stream
// the whole [rows, vocab] tensor through memory; here a row is read three times from cache.
// Masked tokens (x = -inf) have probability exactly zero and are never drawn.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#define SAMPLING_AVX2 1
#endif
#include "gguf_matmul.h"
#include "sampling_rows.h"

namespace {

using pagedllm_sampling::before;
using pagedllm_sampling::cut_top_p;
using pagedllm_sampling::draw_kept;
using pagedllm_sampling::kth_largest_z;
using pagedllm_sampling::row_max;
using pagedllm_sampling::Token;
using pagedllm_sampling::tokens_from;

#ifdef SAMPLING_AVX2
using namespace pagedllm_simd;
#endif
using pagedllm_sampling::exp_sum;
using pagedllm_sampling::weight1;
using pagedllm_sampling::weights8;

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

// The first NaN of the row (one is known to be there).
int64_t first_nan(const float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j)
    if (x[j] != x[j]) return j;
  return 0;
}


// The columns of one part of a row's normaliser (`logsumexp_rows_f32`).
constexpr int64_t kPartColumns = 1 << 13;

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

// A part's maximum and its sum of weights exp(x - max) (the normaliser's pass over one part).
inline void reduce_part(const float* part, int64_t n, float* max_out, float* sum_out) {
  const float max = row_max(part, n);
  *max_out = max;
  *sum_out = max == -INFINITY || max != max ? 0.0f : exp_sum(part, n, max, 1.0f);
}

// One row's normaliser from its parts' maxima and sums, combined in part order (exactly the sum
// with one part); with argmax, its greedy token (torch.argmax's answer: the first maximum, looked
// up in the first part holding it; the first NaN; 0 where every token is masked), and with
// chosen_logprob that token's log-probability row[argmax] - normaliser.
void finish_row(const float* row, int64_t cols, const float* maxes, const float* sums, int64_t parts, float* out,
                int64_t* argmax, float* chosen_logprob, float* row_max_out = nullptr) {
  float max = -INFINITY;
  bool nan = false;
  for (int64_t p = 0; p < parts; ++p) {
    nan = nan || maxes[p] != maxes[p];
    max = maxes[p] > max ? maxes[p] : max;
  }
  if (row_max_out != nullptr) *row_max_out = nan ? NAN : max;  // (row_max's answer)
  float total = 0.0f;
  int64_t winner = -1;  // the first part holding the maximum
  for (int64_t p = 0; p < parts && !nan; ++p) {
    if (maxes[p] == -INFINITY) continue;
    total += sums[p] * std::exp(maxes[p] - max);
    if (winner < 0 && maxes[p] == max) winner = p;
  }
  *out = nan ? NAN : max == -INFINITY ? -INFINITY : max + std::log(total);
  if (argmax == nullptr) return;
  if (nan) {
    *argmax = first_nan(row, cols);
  } else if (winner < 0) {
    *argmax = 0;  // (every token masked: all equal)
  } else {
    const int64_t lo = winner * kPartColumns, hi = lo + kPartColumns < cols ? lo + kPartColumns : cols;
    *argmax = lo + first_index_of(row + lo, hi - lo, max);
  }
  if (chosen_logprob != nullptr) *chosen_logprob = row[*argmax] - *out;
}

// Keeps the tokens of `kept` whose z is at least its k-th largest, counting repeats (every one
// where it holds fewer than k), in their order; returns that k-th largest (-inf for fewer than k).
float keep_k_largest(std::vector<Token>& kept, int64_t k, std::vector<float>& zs) {
  if (static_cast<int64_t>(kept.size()) < k) return -INFINITY;
  zs.clear();
  for (const Token& c : kept) zs.push_back(c.z);
  std::nth_element(zs.begin(), zs.begin() + (k - 1), zs.end(), std::greater<float>());
  const float kth = zs[k - 1];
  kept.erase(std::remove_if(kept.begin(), kept.end(), [&](const Token& c) { return c.z < kth; }), kept.end());
  return kth;
}

// A part's candidates for its row's top k: its tokens with z at or above its own k-th largest
// (ties kept), in vocabulary order. A part's k-th largest z is never above its row's, so it is a
// lower bound of the row's, which `bound` keeps (the highest seen, shared by the threads): tokens
// below it are not looked at again, and only the row's first parts take a heap's pass. The union
// of the parts' candidates holds every token of the row's top k with its ties.
void part_candidates(const float* part, int64_t n, float inv_t, int64_t k, std::atomic<float>& bound,
                     std::vector<Token>& kept) {
  static thread_local std::vector<Token> heap;
  static thread_local std::vector<float> zs;
  float floor = bound.load(std::memory_order_relaxed);
  if (floor == -INFINITY) floor = kth_largest_z(part, n, inv_t, k, heap);  // (-inf: a part shorter than k)
  tokens_from(part, n, inv_t, floor, kept);  // (never a -inf z)
  floor = keep_k_largest(kept, k, zs);  // (-inf: its k-th largest lies below the bound, nothing learnt)
  float seen = bound.load(std::memory_order_relaxed);
  while (floor > seen && !bound.compare_exchange_weak(seen, floor, std::memory_order_relaxed)) {
  }
}

}  // namespace

extern "C" {

// x: [rows, row_stride] float32; out: [rows]; argmax: [rows] or null (not wanted), torch.argmax's
// answer on every row (the first maximum; the first NaN of a row holding one; 0 where every token
// is masked); chosen_logprob: [rows] or null, x[argmax] - out (the greedy token's log-probability,
// as the sampler reports it; needs argmax). Each row is cut into parts of kPartColumns columns
// (one part below that), each part's maximum and sum of
// weights found, and the parts combined in order: the same sums in the same order whatever the
// number of rows and threads, so a row's result does not depend on its batch (batch-invariant
// mode relies on it). The parts of all rows are shared among the threads: a decode step of one
// sequence over a vocabulary of 150k-260k keeps every thread busy. The greedy token is then
// looked up in the first part that holds the maximum. Each part is read from memory once: its
// later passes find it in the core's cache.
void logsumexp_rows_f32(float* out, int64_t* argmax, float* chosen_logprob, const float* x, int rows, int64_t cols,
                        int64_t row_stride, int num_threads) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t parts = (cols + kPartColumns - 1) / kPartColumns;
  const int64_t items = rows * parts;
  std::vector<float> part_max(items), part_sum(items);
#pragma omp parallel for schedule(static) num_threads(items < num_threads ? static_cast<int>(items) : num_threads)
  for (int64_t i = 0; i < items; ++i) {
    const int64_t lo = i % parts * kPartColumns, hi = lo + kPartColumns < cols ? lo + kPartColumns : cols;
    reduce_part(x + i / parts * row_stride + lo, hi - lo, &part_max[i], &part_sum[i]);
  }
#pragma omp parallel for schedule(static) num_threads(rows < num_threads ? rows : num_threads)
  for (int r = 0; r < rows; ++r)
    finish_row(x + r * row_stride, cols, part_max.data() + r * parts, part_sum.data() + r * parts, parts, out + r,
               argmax != nullptr ? argmax + r : nullptr, chosen_logprob != nullptr ? chosen_logprob + r : nullptr);
}

// y [rows, out_features] = x W^T as gguf_matmul computes it (W: GGUF blocks of type qtype_id,
// row_bytes a row; each column's dot product is the same whatever columns share a call), and each
// row's token from it, each part of the rows reduced right after the product wrote it, while it is
// in cache, instead of in passes that read the logits back from memory (an LM head's decode step).
// out[r]: the row's normaliser, bitwise logsumexp_rows_f32's. tokens[r], chosen_logprob[r]: with
// temperature null or top_k[r] == 0, the greedy token and its log-probability, bitwise
// logsumexp_rows_f32's argmax and chosen_logprob; else the draw sample_filtered_rows_f32 gives at
// temperature[r], top_k[r] (0 < k < out_features), top_p[r], min_p[r] and uniform[r] (each part's
// tokens with z at or above its own k-th largest are kept as candidates, a superset of the row's
// top k with every tie: the same kept tokens, in the same order, for the same draw) and its
// log-probability y[token] - out. The columns are shared among the threads in pieces taken in
// turn: whole parts, then the last num_threads parts in pieces of kPieceColumns, so the threads
// finish together; the thread that completes a part reduces it.
void gguf_matmul_sample(int qtype_id, float* y, const float* x, const uint8_t* packed, int64_t row_bytes, int rows,
                        int64_t out_features, int64_t in_features, int num_threads, int use_int8, float* out,
                        int64_t* tokens, float* chosen_logprob, const float* temperature, const int64_t* top_k,
                        const float* top_p, const float* min_p, const float* uniform) {
  if (rows <= 0 || out_features <= 0) return;
  constexpr int64_t kPieceColumns = 1024;
  const int64_t parts = (out_features + kPartColumns - 1) / kPartColumns;
  std::vector<int64_t> pieces;  // each piece's first column (a piece ends where the next begins, or at its part's end)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t lo = p * kPartColumns, hi = std::min(lo + kPartColumns, out_features);
    for (int64_t c = lo; c < hi; c += p < parts - num_threads ? kPartColumns : kPieceColumns) pieces.push_back(c);
  }
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  std::vector<std::atomic<int64_t>> remaining(parts);  // each part's columns not yet computed
  for (int64_t p = 0; p < parts; ++p) remaining[p] = std::min(kPartColumns, out_features - p * kPartColumns);
  std::vector<float> part_max(rows * parts), part_sum(rows * parts);
  const auto filtered = [&](int r) { return temperature != nullptr && top_k[r] != 0; };
  std::vector<std::vector<Token>> candidates(temperature != nullptr ? rows * parts : 0);  // [row][part]
  std::vector<std::atomic<float>> bounds(rows);  // a lower bound of each row's k-th largest z
  for (auto& b : bounds) b.store(-INFINITY);
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_pieces < num_threads ? static_cast<int>(num_pieces) : num_threads)
  for (int64_t i = 0; i < num_pieces; ++i) {
    const int64_t lo = pieces[i], p = lo / kPartColumns;
    const int64_t part_end = std::min((p + 1) * kPartColumns, out_features);
    const int64_t hi = i + 1 < num_pieces && pieces[i + 1] < part_end ? pieces[i + 1] : part_end, width = hi - lo;
    if (rows == 1) {
      gguf_matmul(qtype_id, y + lo, x, packed + lo * row_bytes, 1, width, in_features, 1, use_int8);
    } else {  // the piece's [rows, width] product, then into y's rows
      static thread_local std::vector<float> piece;
      piece.resize(static_cast<size_t>(rows) * width);
      gguf_matmul(qtype_id, piece.data(), x, packed + lo * row_bytes, rows, width, in_features, 1, use_int8);
      for (int r = 0; r < rows; ++r)
        std::copy(piece.data() + r * width, piece.data() + (r + 1) * width, y + r * out_features + lo);
    }
    if (remaining[p].fetch_sub(width) != width) continue;  // (another piece of the part is still to come)
    const int64_t part_lo = p * kPartColumns, n = part_end - part_lo;
    for (int r = 0; r < rows; ++r) {
      const float* part = y + r * out_features + part_lo;
      reduce_part(part, n, &part_max[r * parts + p], &part_sum[r * parts + p]);
      if (!filtered(r)) continue;
      std::vector<Token>& kept = candidates[r * parts + p];
      part_candidates(part, n, 1.0f / temperature[r], top_k[r], bounds[r], kept);
      for (Token& c : kept) c.j += part_lo;
    }
  }
  std::vector<Token> kept;
  std::vector<float> zs;
  for (int r = 0; r < rows; ++r) {
    const float* row = y + r * out_features;
    const float *maxes = part_max.data() + r * parts, *sums = part_sum.data() + r * parts;
    if (!filtered(r)) {
      finish_row(row, out_features, maxes, sums, parts, out + r, tokens + r, chosen_logprob + r);
      continue;
    }
    float max_x;
    finish_row(row, out_features, maxes, sums, parts, out + r, nullptr, nullptr, &max_x);
    const float inv_t = 1.0f / temperature[r], max = max_x * inv_t;
    tokens[r] = 0;  // (as the filtered draw gives for a row holding NaN or nothing but -inf)
    if (max == max && max != -INFINITY) {
      kept.clear();
      for (int64_t p = 0; p < parts; ++p) kept.insert(kept.end(), candidates[r * parts + p].begin(), candidates[r * parts + p].end());
      keep_k_largest(kept, top_k[r], zs);  // (the union holds every token of the row's top k, ties too)
      if (top_p[r] < 1.0f) cut_top_p(kept, max, top_p[r]);
      tokens[r] = draw_kept(kept, max, min_p[r], uniform[r]);
    }
    chosen_logprob[r] = row[tokens[r]] - out[r];
  }
}

// tokens[r]: the draw from softmax(x[r] * inv_temperature[r]) at uniform[r] in [0, 1). As the
// normaliser, each row is cut into parts of kPartColumns columns, the parts of all rows shared
// among the threads: each part's maximum, then its sum of weights under the row's maximum; the
// part where the running total of the parts, in order, passes u times the row's total is then
// walked token by token (`draw`, from the parts before it). The same draw at any batch size and
// thread count; a lone row of a 262k vocabulary is not left to one thread. A row holding NaN, or
// nothing but -inf, gives token 0.
void sample_rows_f32(int64_t* tokens, const float* x, int rows, int64_t cols, int64_t row_stride,
                     const float* inv_temperature, const float* uniform, int num_threads) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t parts = (cols + kPartColumns - 1) / kPartColumns;
  const int64_t items = rows * parts;
  const int team = items < num_threads ? static_cast<int>(items) : num_threads;
  std::vector<float> part_max(items), part_sum(items), row_max_of(rows);
  const auto part_of = [&](int64_t i, int64_t* n) {
    const int64_t lo = i % parts * kPartColumns;
    *n = lo + kPartColumns < cols ? kPartColumns : cols - lo;
    return x + i / parts * row_stride + lo;
  };
#pragma omp parallel num_threads(team)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; ++i) {
      int64_t n;
      const float* part = part_of(i, &n);
      part_max[i] = row_max(part, n);
    }
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
      float max = -INFINITY;
      bool nan = false;
      for (int64_t p = 0; p < parts; ++p) {
        const float m = part_max[r * parts + p];
        nan = nan || m != m;
        max = m > max ? m : max;
      }
      row_max_of[r] = nan ? NAN : max;
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; ++i) {
      int64_t n;
      const float* part = part_of(i, &n);
      const float max = row_max_of[i / parts];
      part_sum[i] = max == -INFINITY || max != max || part_max[i] == -INFINITY
                        ? 0.0f : exp_sum(part, n, max, inv_temperature[i / parts]);
    }
#pragma omp for schedule(static)
    for (int r = 0; r < rows; ++r) {
      const float max = row_max_of[r];
      const float* sums = part_sum.data() + r * parts;
      float total = 0.0f;
      for (int64_t p = 0; p < parts; ++p) total += sums[p];
      if (max != max || max == -INFINITY || !(total > 0.0f)) {
        tokens[r] = 0;
        continue;
      }
      const float target = uniform[r] * total;
      float before = 0.0f, rest = INFINITY;  // (past every part by rounding: the last token of weight)
      int64_t chosen = -1, last = 0;
      for (int64_t p = 0; p < parts && chosen < 0; ++p) {
        if (sums[p] <= 0.0f) continue;
        if (before + sums[p] > target) {
          chosen = p;
          rest = target - before;
        }
        before += sums[p];
        last = p;
      }
      chosen = chosen < 0 ? last : chosen;
      int64_t n;
      const float* part = part_of(r * parts + chosen, &n);
      tokens[r] = chosen * kPartColumns + draw(part, n, max, inv_temperature[r], rest);
    }
  }
}

// The log-probabilities a request asks for, per row r: the k most likely tokens (ids[r * k + i],
// values[r * k + i] = x - log_norm[r], from the most likely; ties: the lower id first) and the
// rank of the chosen token chosen[r] (1 + how many tokens have a larger log-probability). The
// values are the float32 differences torch's `row - log_norm` gives.
void top_logprobs_rows_f32(float* values, int64_t* ids, int64_t* ranks, const float* x, int rows, int64_t cols,
                           int64_t row_stride, const float* log_norm, const int64_t* chosen, int k, int num_threads) {
#pragma omp parallel num_threads(rows < num_threads ? rows : num_threads)
  {
    std::vector<Token> heap;
#pragma omp for schedule(dynamic, 1)
    for (int r = 0; r < rows; ++r) {
      const float* row = x + r * row_stride;
      const float ln = log_norm[r];
      if (k > 0) {
        kth_largest_z(row, cols, 1.0f, k, heap);  // (the order of x is the order of x - ln)
        std::sort(heap.begin(), heap.end(), before);
        for (int i = 0; i < k; ++i) {
          const bool have = i < static_cast<int>(heap.size());
          ids[r * k + i] = have ? heap[i].j : -1;
          values[r * k + i] = have ? row[heap[i].j] - ln : -INFINITY;
        }
      }
      const float mine = row[chosen[r]] - ln;
      int64_t above = 0, j = 0;
#ifdef SAMPLING_AVX2
      const __m256 vln = _mm256_set1_ps(ln), vmine = _mm256_set1_ps(mine);
      for (; j + 8 <= cols; j += 8)
        above += __builtin_popcount(
            _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(_mm256_loadu_ps(row + j), vln), vmine, _CMP_GT_OQ)));
#endif
      for (; j < cols; ++j) above += row[j] - ln > mine;
      ranks[r] = above + 1;
    }
  }
}

}  // extern "C"
