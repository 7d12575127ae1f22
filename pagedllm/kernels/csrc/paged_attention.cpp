// PagedAttention for CPUs: attention computed by walking each sequence's block table, reading
// keys and values where they lie in the block pools (no gather into a contiguous copy).
//
// Pools hold one contiguous block_size x head_dim tile per (block, KV head); where the tiles
// lie is given by two strides (elements between blocks and between heads), so the layout is the
// backend's choice. Work is split into units of (tile of query tokens of one sequence) x (KV
// heads) x (partition of its context), spread over OpenMP threads. A unit computes every query
// row that shares its KV heads (the heads of a grouped-query group, for each token of the tile)
// against each key and value it reads, so keys and values are read once per unit and never
// repeated per head. Two passes over the context: scores (q . k), then the softmax-weighted sum
// of values; the next block is prefetched while one is processed (blocks lie anywhere). A
// context is split into partitions only when there are too few sequences to keep every thread
// busy (a few long decodes); their partial softmax sums are merged at the end.
//
// Plain C++ with no torch headers (it compiles in about a second); called through ctypes with
// raw pointers. Element types: float32, and bfloat16 stored as uint16 (math in float32). With
// AVX2 and head_dim a multiple of 8 the inner loops use intrinsics, else portable loops.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#define PAGED_AVX2 1
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even
  *out = static_cast<uint16_t>(bits >> 16);
}

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
inline __m256 load8(const uint16_t* p) {
  __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
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
  for (; j < n; ++j) {
    const T* k = keys + static_cast<int64_t>(j) * head_dim;
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int d = 0; d < head_dim; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * head_dim + d), load8(k + d), a);
      scores[r * score_stride + j] = hsum(a) * scale;
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

// A context shorter than this is never split across work units.
constexpr int kMinPartitionTokens = 128;
// Work units wanted per thread, for the dynamic schedule to balance uneven items.
constexpr int kUnitsPerThread = 4;

// One work unit: the query rows of an item (a tile of one sequence's query tokens) for a group
// of KV heads, against the keys of blocks [block_begin, block_end) of its context.
struct Unit {
  int item, first_head, block_begin, block_end;
  int64_t partial;  // where its partial result goes (in rows), or -1: the unit is the whole context
};

// Q: the type of queries and outputs; T: the type of the pools (the KV cache may be stored in
// a narrower type than the model computes in).
template <typename Q, typename T>
void attention(Q* out, const Q* query, const T* key_cache, const T* value_cache,
               int64_t block_stride, int64_t head_stride,
               const int32_t* block_tables, int64_t block_table_stride,
               const int32_t* item_seq, const int32_t* item_first_token, const int32_t* item_num_tokens,
               int num_items, const int32_t* token_context,
               int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
               int num_threads) {
  const int group = num_heads / num_kv_heads;
  const int64_t tile_elements = static_cast<int64_t>(block_size) * head_dim;
  const bool adjacent_heads = head_stride == tile_elements;
#ifdef PAGED_AVX2
  const bool vector = head_dim % 8 == 0;
#else
  const bool vector = false;
#endif
  auto item_context = [&](int item) {  // keys seen by the item's last token (the most)
    int context = 0;
    for (int t = 0; t < item_num_tokens[item]; ++t) {
      const int c = token_context[item_first_token[item] + t];
      context = context > c ? context : c;
    }
    return context;
  };

  // Units. An item takes all KV heads (a block's heads lie side by side: one contiguous read)
  // and, when there are too few items to keep every thread busy, its context is split into
  // partitions whose partial softmax results are merged afterwards (as flash-decoding does).
  // Only when even that leaves threads idle (short contexts) are items split by head instead.
  const int wanted_units = kUnitsPerThread * num_threads;
  const int min_partition_blocks = (kMinPartitionTokens + block_size - 1) / block_size;
  const int partitions_wanted = (wanted_units + num_items - 1) / num_items;
  std::vector<int> item_blocks(num_items), item_partitions(num_items);
  int64_t num_units = 0;
  for (int item = 0; item < num_items; ++item) {
    item_blocks[item] = (item_context(item) + block_size - 1) / block_size;
    int parts = item_blocks[item] / min_partition_blocks;
    parts = parts < 1 ? 1 : parts > partitions_wanted ? partitions_wanted : parts;
    // Whole blocks per partition; rounding up may leave fewer partitions than asked for.
    const int per_part = (item_blocks[item] + parts - 1) / parts;
    item_partitions[item] = (item_blocks[item] + per_part - 1) / per_part;
    num_units += item_partitions[item];
  }
  const int heads_per_unit = num_units >= 2 * num_threads ? num_kv_heads : 1;
  std::vector<Unit> units;
  units.reserve(static_cast<size_t>(num_units) * (num_kv_heads / heads_per_unit));
  int64_t partial_rows = 0;
  for (int item = 0; item < num_items; ++item) {
    const int parts = item_partitions[item], blocks = item_blocks[item];
    const int per_part = (blocks + parts - 1) / parts;
    const int rows = item_num_tokens[item] * group * heads_per_unit;
    for (int first_head = 0; first_head < num_kv_heads; first_head += heads_per_unit)
      for (int b = 0; b < blocks; b += per_part) {  // every token sees itself: blocks >= 1
        units.push_back({item, first_head, b, std::min(b + per_part, blocks), parts > 1 ? partial_rows : -1});
        if (parts > 1) partial_rows += rows;
      }
  }
  // Per row of a partial result: the unnormalised output, the running max, the sum of exps.
  const int partial_width = head_dim + 2;
  std::vector<float> partials(static_cast<size_t>(partial_rows) * partial_width);

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q, scores, acc, inv_sum, row_max;
#pragma omp for schedule(dynamic, 1)
    for (size_t u = 0; u < units.size(); ++u) {
      const Unit& unit = units[u];
      const int item = unit.item, first_head = unit.first_head;
      const int first = item_first_token[item];
      const int count = item_num_tokens[item];
      const int rows_per_head = count * group;  // the group's query heads for each token of the tile
      const int rows = rows_per_head * heads_per_unit;
      const int begin = unit.block_begin * block_size;  // the partition's first key position
      const int length = std::min(item_context(item), unit.block_end * block_size) - begin;  // keys in it
      const int32_t* table = block_tables + item_seq[item] * block_table_stride;
      auto tile = [&](const T* pool, int b, int h) { return pool + table[b] * block_stride + h * head_stride; };
      auto prefetch = [&](const T* pool, int b, auto locality) {
        constexpr int L = decltype(locality)::value;
        if (adjacent_heads) {
          prefetch_tile<L>(tile(pool, b, first_head), tile_elements * heads_per_unit);
        } else {
          for (int h = 0; h < heads_per_unit; ++h) prefetch_tile<L>(tile(pool, b, first_head + h), tile_elements);
        }
      };
      using ToL1 = std::integral_constant<int, 3>;
      using ToL2 = std::integral_constant<int, 1>;

      // Query rows in (head, token, head of the group) order, as float32.
      q.resize(static_cast<size_t>(rows) * head_dim);
      scores.resize(static_cast<size_t>(rows) * length);
      acc.assign(static_cast<size_t>(rows) * head_dim, 0.0f);
      inv_sum.resize(rows);
      row_max.resize(rows);
      for (int h = 0; h < heads_per_unit; ++h)
        for (int t = 0; t < count; ++t)
          for (int g = 0; g < group; ++g) {
            const Q* src = query + (static_cast<int64_t>(first + t) * num_heads + (first_head + h) * group + g) * head_dim;
            float* dst = q.data() + static_cast<size_t>((h * count + t) * group + g) * head_dim;
            for (int d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]);
          }

      // Pass 1: scores of every query row against every key, block by block; the values are
      // brought toward L2 meanwhile, so the second pass does not wait on memory.
      const int b0 = unit.block_begin, b1 = unit.block_end;
      for (int b = b0 + 1; b < b1 && b < b0 + kPrefetchAhead; ++b) prefetch(key_cache, b, ToL1{});
      for (int b = b0; b < b1; ++b) {
        if (b + kPrefetchAhead < b1) prefetch(key_cache, b + kPrefetchAhead, ToL1{});
        prefetch(value_cache, b, ToL2{});
        const int offset = (b - b0) * block_size;
        const int n = length - offset < block_size ? length - offset : block_size;
        for (int h = 0; h < heads_per_unit; ++h) {
          const T* keys = tile(key_cache, b, first_head + h);
          for_row_groups(h * rows_per_head, rows_per_head, [&](int r, auto rows_here) {
            constexpr int R = decltype(rows_here)::value;
            float* s = scores.data() + static_cast<size_t>(r) * length + offset;
            const float* qr = q.data() + static_cast<size_t>(r) * head_dim;
#ifdef PAGED_AVX2
            if (vector) return score_keys<R>(qr, keys, n, head_dim, scale, s, length);
#endif
            for (int i = 0; i < R; ++i)
              score_keys_portable(qr + i * head_dim, keys, n, head_dim, scale, s + static_cast<size_t>(i) * length);
          });
        }
      }
      // Softmax numerators of each row over the keys of the partition it may see (causal: token
      // t sees token_context[t] keys; a partition may hold none of them).
      for (int r = 0; r < rows; ++r) {
        const int seen = token_context[first + (r % rows_per_head) / group] - begin;
        const int visible = seen < 0 ? 0 : seen > length ? length : seen;
        float* s = scores.data() + static_cast<size_t>(r) * length;
#ifdef PAGED_AVX2
        const float max = max_of(s, visible);
        const float sum = visible > 0 ? softmax_numerators(s, visible, max) : 0.0f;
#else
        float max = -INFINITY;
        for (int pos = 0; pos < visible; ++pos) max = s[pos] > max ? s[pos] : max;
        float sum = 0.0f;
        for (int pos = 0; pos < visible; ++pos) {
          s[pos] = std::exp(s[pos] - max);
          sum += s[pos];
        }
#endif
        for (int pos = visible; pos < length; ++pos) s[pos] = 0.0f;
        row_max[r] = max;
        inv_sum[r] = sum;
      }
      // Pass 2: the weighted sum of values.
      for (int b = b0; b < b1; ++b) {
        if (b + kPrefetchAhead < b1) prefetch(value_cache, b + kPrefetchAhead, ToL1{});
        const int offset = (b - b0) * block_size;
        const int n = length - offset < block_size ? length - offset : block_size;
        for (int h = 0; h < heads_per_unit; ++h) {
          const T* values = tile(value_cache, b, first_head + h);
          for_row_groups(h * rows_per_head, rows_per_head, [&](int r, auto rows_here) {
            constexpr int R = decltype(rows_here)::value;
            const float* p = scores.data() + static_cast<size_t>(r) * length + offset;
            float* a = acc.data() + static_cast<size_t>(r) * head_dim;
#ifdef PAGED_AVX2
            if (vector) return accumulate_values<R>(p, length, values, n, head_dim, a);
#endif
            for (int i = 0; i < R; ++i)
              accumulate_values_portable(p + static_cast<size_t>(i) * length, values, n, head_dim, a + i * head_dim);
          });
        }
      }
      if (unit.partial >= 0) {  // keep the unnormalised sums for the merge
        for (int r = 0; r < rows; ++r) {
          float* dst = partials.data() + static_cast<size_t>(unit.partial + r) * partial_width;
          std::memcpy(dst, acc.data() + static_cast<size_t>(r) * head_dim, sizeof(float) * head_dim);
          dst[head_dim] = row_max[r];
          dst[head_dim + 1] = inv_sum[r];
        }
        continue;
      }
      for (int h = 0; h < heads_per_unit; ++h)
        for (int t = 0; t < count; ++t)
          for (int g = 0; g < group; ++g) {
            const int r = (h * count + t) * group + g;
            Q* o = out + (static_cast<int64_t>(first + t) * num_heads + (first_head + h) * group + g) * head_dim;
            const float inv = 1.0f / inv_sum[r];
            for (int d = 0; d < head_dim; ++d) from_float(acc[static_cast<size_t>(r) * head_dim + d] * inv, o + d);
          }
    }

    // Merge the partitions of each split item: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
#pragma omp for schedule(dynamic, 1)
    for (size_t u = 0; u < units.size(); ++u) {
      const Unit& unit = units[u];
      if (unit.partial < 0 || unit.block_begin != 0) continue;  // one merge per split item and head group
      const int item = unit.item, first = item_first_token[item], count = item_num_tokens[item];
      const int rows = count * group * heads_per_unit;
      const int parts = item_partitions[item];
      std::vector<float> merged(head_dim);
      for (int r = 0; r < rows; ++r) {
        float max = -INFINITY;
        for (int p = 0; p < parts; ++p) {
          const float* part = partials.data() + static_cast<size_t>(units[u + p].partial + r) * partial_width;
          if (part[head_dim + 1] > 0.0f) max = part[head_dim] > max ? part[head_dim] : max;
        }
        float sum = 0.0f;
        std::fill(merged.begin(), merged.end(), 0.0f);
        for (int p = 0; p < parts; ++p) {
          const float* part = partials.data() + static_cast<size_t>(units[u + p].partial + r) * partial_width;
          if (part[head_dim + 1] <= 0.0f) continue;  // saw no keys
          const float w = std::exp(part[head_dim] - max);
          sum += w * part[head_dim + 1];
          for (int d = 0; d < head_dim; ++d) merged[d] += w * part[d];
        }
        const int h = r / (count * group), t = (r / group) % count, g = r % group;
        Q* o = out + (static_cast<int64_t>(first + t) * num_heads + (unit.first_head + h) * group + g) * head_dim;
        const float inv = 1.0f / sum;
        for (int d = 0; d < head_dim; ++d) from_float(merged[d] * inv, o + d);
      }
    }
  }
}

template <typename S, typename T>
inline void store_row(const S* src, T* dst, int n) {
  if constexpr (std::is_same_v<S, T>) {
    std::memcpy(dst, src, sizeof(T) * n);
  } else {
    for (int i = 0; i < n; ++i) from_float(to_float(src[i]), dst + i);
  }
}

// S: the type of the new keys and values; T: the type of the pools.
template <typename S, typename T>
void write_kv(const S* key, const S* value, T* key_cache, T* value_cache, int64_t block_stride, int64_t head_stride,
              const int64_t* slot_mapping, int num_tokens, int num_kv_heads, int head_dim, int block_size) {
  for (int t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    const int64_t base = (slot / block_size) * block_stride + (slot % block_size) * head_dim;
    for (int h = 0; h < num_kv_heads; ++h) {
      const int64_t src = (static_cast<int64_t>(t) * num_kv_heads + h) * head_dim;
      store_row(key + src, key_cache + base + h * head_stride, head_dim);
      store_row(value + src, value_cache + base + h * head_stride, head_dim);
    }
  }
}

}  // namespace

extern "C" {

// Entry points, named by (compute type)_(cache type): f32_f32, bf16_bf16, and f32_bf16 for a
// float32 model with a bfloat16 KV cache.
#define PAGED_ATTENTION_ENTRY(NAME, Q, T)                                                           \
  void NAME(void* out, const void* query, const void* key_cache, const void* value_cache,          \
            int64_t block_stride, int64_t head_stride, const int32_t* block_tables,                \
            int64_t block_table_stride, const int32_t* item_seq, const int32_t* item_first_token,  \
            const int32_t* item_num_tokens, int num_items, const int32_t* token_context,           \
            int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,            \
            int num_threads) {                                                                     \
    attention<Q, T>(static_cast<Q*>(out), static_cast<const Q*>(query),                            \
                    static_cast<const T*>(key_cache), static_cast<const T*>(value_cache),          \
                    block_stride, head_stride, block_tables, block_table_stride, item_seq,         \
                    item_first_token, item_num_tokens, num_items, token_context, num_heads,        \
                    num_kv_heads, head_dim, block_size, scale, num_threads);                       \
  }

PAGED_ATTENTION_ENTRY(paged_attention_f32_f32, float, float)
PAGED_ATTENTION_ENTRY(paged_attention_bf16_bf16, uint16_t, uint16_t)
PAGED_ATTENTION_ENTRY(paged_attention_f32_bf16, float, uint16_t)

#define WRITE_KV_ENTRY(NAME, S, T)                                                                  \
  void NAME(const void* key, const void* value, void* key_cache, void* value_cache,                \
            int64_t block_stride, int64_t head_stride, const int64_t* slot_mapping,                \
            int num_tokens, int num_kv_heads, int head_dim, int block_size) {                      \
    write_kv<S, T>(static_cast<const S*>(key), static_cast<const S*>(value),                       \
                   static_cast<T*>(key_cache), static_cast<T*>(value_cache), block_stride,         \
                   head_stride, slot_mapping, num_tokens, num_kv_heads, head_dim, block_size);     \
  }

WRITE_KV_ENTRY(write_kv_f32_f32, float, float)
WRITE_KV_ENTRY(write_kv_bf16_bf16, uint16_t, uint16_t)
WRITE_KV_ENTRY(write_kv_f32_bf16, float, uint16_t)

}  // extern "C"
