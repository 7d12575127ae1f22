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
// busy (a few long decodes, or one decode of a model with one KV head); their partial softmax
// sums are merged at the end.
//
// Sliding windows (`sliding_window` W > 0): a token at position p sees keys p - W + 1 .. p, so an
// item's work starts at the block holding its first token's first visible key; blocks before it
// are never read (in a sliding-window layer they may already hold other sequences' keys). Logit
// soft-capping (`logits_soft_cap` c > 0, Gemma 2): scores become c * tanh(score / c) before the
// softmax. Zero for either: not applied, the loops as without them.
//
// Plain C++ with no torch headers (it compiles in about a second); called through ctypes with
// raw pointers. Element types: float32, and bfloat16 stored as uint16 (math in float32). With
// AVX2 and head_dim a multiple of 8 the inner loops use intrinsics (AVX-512 where the CPU has it:
// attention_tiles.h), else portable loops.
//
// One kernel, read top to bottom: its plan, its passes and the merge (a little over 400 lines);
// the per-tile inner loops are in attention_tiles.h, the cache writes in cache_write.cpp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>
#include "attention_tiles.h"

namespace {

using namespace paged_attention_tiles;

// A context shorter than this is split across work units only where one (sequence, KV head) pair
// would leave a thread idle (Gemma 3 270M's one KV head, one decode at 136 tokens on a 2-core
// Xeon VM: 25 -> 17 us a layer with hot caches, 46 -> 28 in its decode step).
constexpr int kMinPartitionTokens = 128;
// Work units wanted per thread, for the dynamic schedule to balance uneven items.
constexpr int kUnitsPerThread = 4;

// The arguments of one call (in the order of the C entry points) and what follows from them,
// gathered once so that each pass takes one parameter rather than twenty.
template <typename Q, typename T>
struct Problem {
  Q* out;
  const Q* query;
  const T* key_cache;
  const T* value_cache;
  int64_t block_stride, head_stride;
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* item_seq;
  const int32_t* item_first_token;
  const int32_t* item_num_tokens;
  int num_items;
  const int64_t* token_context;
  int num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  int group;              // query heads per KV head
  int64_t tile_elements;  // of one (block, KV head) tile
  bool adjacent_heads;    // a block's KV heads lie side by side: one prefetch covers them all
  bool vector;            // the AVX2 kernels apply (head_dim a multiple of 8)
  bool bf16_scores;       // score_keys_bf16 applies (kBf16Scores, head_dim a multiple of 32)
  // > 0: every context is cut into partitions of exactly this many blocks from its start, the
  // same whatever else is in the batch (batch-invariant mode); 0: as many as keep threads busy.
  int fixed_partition_blocks;
  int sliding_window;     // > 0: keys each token sees, itself included; 0: its whole context
  float logits_soft_cap;  // > 0: scores are soft-capped at it; 0: not
};

// One work unit: the query rows of an item (a tile of one sequence's query tokens) for a group
// of KV heads, against the keys of blocks [block_begin, block_end) of its context.
struct Unit {
  int item, first_head, block_begin, block_end;
  int64_t partial;  // where its partial result goes (in rows), or -1: the unit is the whole context
};

// The work of one call. A split item's partitions are consecutive in `units`, the first one at
// the item's first block: the merge finds them from there.
struct Plan {
  std::vector<Unit> units;
  std::vector<int> item_partitions;
  int heads_per_unit;
  int64_t partial_rows;  // rows of partial results, over all split items
};

// Keys seen by the item's last token (the most): how many blocks the item must read.
template <typename Q, typename T>
inline int item_context(const Problem<Q, T>& pb, int item) {
  int context = 0;
  for (int t = 0; t < pb.item_num_tokens[item]; ++t) {
    const int c = static_cast<int>(pb.token_context[pb.item_first_token[item] + t]);
    context = context > c ? context : c;
  }
  return context;
}

// The first key a token seeing `context` keys may see: 0, or the start of its window.
template <typename Q, typename T>
inline int first_visible_key(const Problem<Q, T>& pb, int context) {
  return pb.sliding_window > 0 && context > pb.sliding_window ? context - pb.sliding_window : 0;
}

// The first block the item reads: its first token sees the earliest keys.
template <typename Q, typename T>
inline int item_first_block(const Problem<Q, T>& pb, int item) {
  return first_visible_key(pb, static_cast<int>(pb.token_context[pb.item_first_token[item]])) / pb.block_size;
}

// Where the item's first partition starts: at its first block, or with fixed partitions at a
// multiple of their size from block 0 (wherever a window starts, so that a token sees each key
// in the same partition whatever item it comes in).
template <typename Q, typename T>
inline int partition_start(const Problem<Q, T>& pb, int first_block, int per_part) {
  return pb.fixed_partition_blocks > 0 ? first_block - first_block % per_part : first_block;
}

// An item takes all KV heads (a block's heads lie side by side: one contiguous read) and, when
// there are too few items to keep every thread busy, its context is split into partitions whose
// partial softmax results are merged afterwards (as flash-decoding does). Only when even that
// leaves threads idle (short contexts) are items split by head instead.
template <typename Q, typename T>
Plan plan_units(const Problem<Q, T>& pb, int num_threads) {
  const int num_items = pb.num_items, block_size = pb.block_size, num_kv_heads = pb.num_kv_heads;
  const int wanted_units = kUnitsPerThread * num_threads;
  const int min_partition_blocks = (kMinPartitionTokens + block_size - 1) / block_size;
  const int partitions_wanted = (wanted_units + num_items - 1) / num_items;
  // One (item, KV head) pair (one decode of a model with one KV head: Gemma 3 270M): even a short
  // context is split in two, so that two threads share it. Two whatever the thread count: the
  // worker's thread governor changes that count with the machine's load, and a short context's
  // sums (and a near-tie's greedy token) would change with it.
  const int spread = num_items * num_kv_heads == 1 ? 2 : 1;
  Plan plan;
  std::vector<int> item_end_block(num_items), item_partition_blocks(num_items);
  std::vector<int>& item_partitions = plan.item_partitions;
  item_partitions.resize(num_items);
  int64_t num_units = 0;
  for (int item = 0; item < num_items; ++item) {
    const int first = item_first_block(pb, item);
    const int end = (item_context(pb, item) + block_size - 1) / block_size;
    item_end_block[item] = end;
    int per_part = pb.fixed_partition_blocks;
    if (per_part <= 0) {
      int parts = (end - first) / min_partition_blocks;
      if (parts < spread) parts = std::min(spread, end - first);
      parts = parts < 1 ? 1 : parts > partitions_wanted ? partitions_wanted : parts;
      // Whole blocks per partition; rounding up may leave fewer partitions than asked for.
      per_part = (end - first + parts - 1) / parts;
    }
    item_partition_blocks[item] = per_part;
    item_partitions[item] = (end - partition_start(pb, first, per_part) + per_part - 1) / per_part;
    num_units += item_partitions[item];
  }
  const int heads_per_unit = num_units >= 2 * num_threads ? num_kv_heads : 1;
  plan.heads_per_unit = heads_per_unit;
  plan.units.reserve(static_cast<size_t>(num_units) * (num_kv_heads / heads_per_unit));
  int64_t partial_rows = 0;
  for (int item = 0; item < num_items; ++item) {
    const int parts = item_partitions[item], end = item_end_block[item], per_part = item_partition_blocks[item];
    const int rows = pb.item_num_tokens[item] * pb.group * heads_per_unit;
    // The first fixed partition may start before the window: its unit reads from the window on.
    const int first = item_first_block(pb, item);
    for (int first_head = 0; first_head < num_kv_heads; first_head += heads_per_unit)
      for (int b = partition_start(pb, first, per_part); b < end; b += per_part) {  // every token sees itself
        plan.units.push_back({item, first_head, std::max(b, first), std::min(b + per_part, end), parts > 1 ? partial_rows : -1});
        if (parts > 1) partial_rows += rows;
      }
  }
  plan.partial_rows = partial_rows;
  return plan;
}

// Where a unit reads and writes, worked out once before its passes.
struct UnitView {
  int first_head, heads;    // its KV heads
  int first, count;         // its query tokens
  int rows_per_head, rows;  // query rows: the group's heads for each token, per KV head and in all
  int b0, b1;               // its blocks, [b0, b1)
  int begin, length;        // its keys: the partition's first key position and how many
  const int32_t* table;     // the sequence's block table
};

template <typename Q, typename T>
inline UnitView unit_view(const Problem<Q, T>& pb, const Unit& unit, int heads_per_unit) {
  const int item = unit.item;
  UnitView v;
  v.first_head = unit.first_head;
  v.heads = heads_per_unit;
  v.first = pb.item_first_token[item];
  v.count = pb.item_num_tokens[item];
  v.rows_per_head = v.count * pb.group;
  v.rows = v.rows_per_head * heads_per_unit;
  v.b0 = unit.block_begin;
  v.b1 = unit.block_end;
  v.begin = unit.block_begin * pb.block_size;
  v.length = std::min(item_context(pb, item), unit.block_end * pb.block_size) - v.begin;
  v.table = pb.block_tables + pb.item_seq[item] * pb.block_table_stride;
  return v;
}

// The tile of KV head h in block b (of the unit's sequence) in `pool`.
template <typename Q, typename T>
inline const T* tile(const Problem<Q, T>& pb, const UnitView& v, const T* pool, int b, int h) {
  return pool + v.table[b] * pb.block_stride + h * pb.head_stride;
}

// Blocks lie anywhere in the pool, so the hardware prefetcher cannot guess the next one.
template <int Locality, typename Q, typename T>
inline void prefetch_block(const Problem<Q, T>& pb, const UnitView& v, const T* pool, int b) {
  if (pb.adjacent_heads) {
    prefetch_tile<Locality>(tile(pb, v, pool, b, v.first_head), pb.tile_elements * v.heads);
  } else {
    for (int h = 0; h < v.heads; ++h) prefetch_tile<Locality>(tile(pb, v, pool, b, v.first_head + h), pb.tile_elements);
  }
}

// A unit's query rows are numbered in (KV head, token, head of the group) order: the heads that
// share a KV head are adjacent, as for_row_groups wants. Query loading, output and merge all walk
// them this way: f(row, KV head in the unit, token in the item, head of the group).
template <typename F>
inline void for_unit_rows(int heads, int count, int group, F&& f) {
  for (int h = 0; h < heads; ++h)
    for (int t = 0; t < count; ++t)
      for (int g = 0; g < group; ++g) f((h * count + t) * group + g, h, t, g);
}

// Offset of a (token, query head) row in the query and output tensors; the query head is head g
// of KV head kv_head's group.
template <typename Q, typename T>
inline int64_t head_row(const Problem<Q, T>& pb, int token, int kv_head, int g) {
  return (static_cast<int64_t>(token) * pb.num_heads + kv_head * pb.group + g) * pb.head_dim;
}

// A row of a partial result: the unnormalised output, the running max, the sum of exps; the
// merge needs all three to rescale partitions that saw different maxima.
inline int partial_width(int head_dim) { return head_dim + 2; }

template <typename F>
inline F* partial_row(F* partials, int64_t row, int head_dim) {
  return partials + static_cast<size_t>(row) * partial_width(head_dim);
}

// out = acc / sum, through one reciprocal per row rather than a division per element.
template <typename Q>
inline void store_normalised(const float* acc, float sum, Q* o, int head_dim) {
  const float inv = 1.0f / sum;
  for (int d = 0; d < head_dim; ++d) from_float(acc[d] * inv, o + d);
}

// A thread's buffers, kept across its units so the unit loop does not allocate.
struct Scratch {
  std::vector<float> q, scores, acc, row_sum, row_max;
  std::vector<uint16_t> q_bf16;  // the rows as they came, for score_keys_bf16
};

// The kernels compute in float32 whatever Q is, and read each query row many times (once per
// key tile): convert the unit's rows once, into (row) order (score_keys_bf16: copy them as they are).
template <typename Q, typename T>
inline void load_queries(const Problem<Q, T>& pb, const UnitView& v, Scratch& s) {
  const size_t head_dim = pb.head_dim;
  if (pb.bf16_scores) s.q_bf16.resize(v.rows * head_dim);
  else s.q.resize(v.rows * head_dim);
  s.scores.resize(static_cast<size_t>(v.rows) * v.length);
  s.acc.assign(v.rows * head_dim, 0.0f);
  s.row_sum.resize(v.rows);
  s.row_max.resize(v.rows);
  for_unit_rows(v.heads, v.count, pb.group, [&](int r, int h, int t, int g) {
    const Q* src = pb.query + head_row(pb, v.first + t, v.first_head + h, g);
    if constexpr (kBf16Scores<Q, T>)
      if (pb.bf16_scores) return (void)std::memcpy(&s.q_bf16[r * head_dim], src, sizeof(Q) * head_dim);
    for (size_t d = 0; d < head_dim; ++d) s.q[r * head_dim + d] = to_float(src[d]);
  });
}

// Both passes walk the unit's blocks in order, each block's KV heads, and their rows a few at a
// time (each key or value loaded feeds several rows), so keys and values are read once per unit.
// on_block(b) runs first in each block (the prefetches); then f(first row, rows as an
// integral_constant, the tile, the block's first key within the unit, the keys in the block).
template <typename Q, typename T, typename OnBlock, typename F>
inline void for_block_tiles(const Problem<Q, T>& pb, const UnitView& v, const T* pool, OnBlock&& on_block, F&& f) {
  for (int b = v.b0; b < v.b1; ++b) {
    on_block(b);
    const int offset = (b - v.b0) * pb.block_size;
    const int n = v.length - offset < pb.block_size ? v.length - offset : pb.block_size;
    for (int h = 0; h < v.heads; ++h) {
      const T* pool_tile = tile(pb, v, pool, b, v.first_head + h);
      for_row_groups(h * v.rows_per_head, v.rows_per_head,
                     [&](int r, auto rows_here) { f(r, rows_here, pool_tile, offset, n); });
    }
  }
}

constexpr int kToL1 = 3, kToL2 = 1;  // prefetch_tile localities

// Pass 1: scores (q . k) of every row against every key. The keys run kPrefetchAhead blocks
// ahead into L1; the values are brought toward L2 meanwhile, so pass 2 does not wait on memory.
// Both passes stay out of line: inlined into the unit loop, GCC 12 ran short of registers and
// spilled the query rows inside the FMA loop (12% slower).
template <typename Q, typename T>
[[gnu::noinline]] void score_pass(const Problem<Q, T>& pb, const UnitView& v, Scratch& s) {
  for (int b = v.b0 + 1; b < v.b1 && b < v.b0 + kPrefetchAhead; ++b) prefetch_block<kToL1>(pb, v, pb.key_cache, b);
  for_block_tiles(
      pb, v, pb.key_cache,
      [&](int b) {
        if (b + kPrefetchAhead < v.b1) prefetch_block<kToL1>(pb, v, pb.key_cache, b + kPrefetchAhead);
        prefetch_block<kToL2>(pb, v, pb.value_cache, b);
      },
      [&](int r, auto rows_here, const T* keys, int offset, int n) {
        constexpr int R = decltype(rows_here)::value;
        float* scores = s.scores.data() + static_cast<size_t>(r) * v.length + offset;
#ifdef PAGED_AVX512_BF16
        if constexpr (kBf16Scores<Q, T>)
          if (pb.bf16_scores)
            return score_keys_bf16<R>(&s.q_bf16[r * pb.head_dim], keys, n, pb.head_dim, pb.scale, scores, v.length);
#endif
        score_rows<R>(pb.vector, s.q.data() + static_cast<size_t>(r) * pb.head_dim, keys, n, pb.head_dim, pb.scale,
                      scores, v.length);
      });
}

// Softmax numerators of each row over the keys of the partition it may see (causal: token t
// sees token_context[t] keys; a partition may hold none of them). Left unnormalised, with the
// row's max and sum kept, because a split context is only normalised once merged.
template <typename Q, typename T>
inline void softmax_pass(const Problem<Q, T>& pb, const UnitView& v, Scratch& s) {
  auto clamp = [&](int pos) { return pos < 0 ? 0 : pos > v.length ? v.length : pos; };
  for (int r = 0; r < v.rows; ++r) {
    const int context = static_cast<int>(pb.token_context[v.first + (r % v.rows_per_head) / pb.group]);
    // The row sees the partition's keys [from, to): up to itself, and from its window's start.
    const int to = clamp(context - v.begin), from = std::min(clamp(first_visible_key(pb, context) - v.begin), to);
    float* row = s.scores.data() + static_cast<size_t>(r) * v.length;
    if (pb.logits_soft_cap > 0.0f) soft_cap(row + from, to - from, pb.logits_soft_cap);
    const float max = max_of(row + from, to - from);
    const float sum = to > from ? softmax_numerators(row + from, to - from, max) : 0.0f;
    for (int pos = 0; pos < from; ++pos) row[pos] = 0.0f;  // pass 2 runs over whole tiles
    for (int pos = to; pos < v.length; ++pos) row[pos] = 0.0f;
    s.row_max[r] = max;
    s.row_sum[r] = sum;
  }
}

// Pass 2: the softmax-weighted sum of values; the values kPrefetchAhead blocks on go to L1 (pass
// 1 already brought them toward L2).
template <typename Q, typename T>
[[gnu::noinline]] void value_pass(const Problem<Q, T>& pb, const UnitView& v, Scratch& s) {
  for_block_tiles(
      pb, v, pb.value_cache,
      [&](int b) {
        if (b + kPrefetchAhead < v.b1) prefetch_block<kToL1>(pb, v, pb.value_cache, b + kPrefetchAhead);
      },
      [&](int r, auto rows_here, const T* values, int offset, int n) {
        constexpr int R = decltype(rows_here)::value;
        accumulate_rows<R>(pb.vector, s.scores.data() + static_cast<size_t>(r) * v.length + offset, v.length, values, n,
                           pb.head_dim, s.acc.data() + static_cast<size_t>(r) * pb.head_dim);
      });
}

// A partition's sums stay unnormalised: the normaliser needs every partition's max and sum.
inline void store_partial(const UnitView& v, const Scratch& s, int64_t partial, int head_dim, float* partials) {
  for (int r = 0; r < v.rows; ++r) {
    float* dst = partial_row(partials, partial + r, head_dim);
    std::memcpy(dst, s.acc.data() + static_cast<size_t>(r) * head_dim, sizeof(float) * head_dim);
    dst[head_dim] = s.row_max[r];
    dst[head_dim + 1] = s.row_sum[r];
  }
}

// A unit that covers its whole context is final: normalise straight into the output.
template <typename Q, typename T>
inline void write_output(const Problem<Q, T>& pb, const UnitView& v, const Scratch& s) {
  for_unit_rows(v.heads, v.count, pb.group, [&](int r, int h, int t, int g) {
    store_normalised(s.acc.data() + static_cast<size_t>(r) * pb.head_dim, s.row_sum[r],
                     pb.out + head_row(pb, v.first + t, v.first_head + h, g), pb.head_dim);
  });
}

// One work unit from its queries to its (partial) output: the body of the parallel loop.
template <typename Q, typename T>
inline void run_unit(const Problem<Q, T>& pb, const Plan& plan, const Unit& unit, Scratch& s, float* partials) {
  const UnitView v = unit_view(pb, unit, plan.heads_per_unit);
  load_queries(pb, v, s);
  score_pass(pb, v, s);
  softmax_pass(pb, v, s);
  value_pass(pb, v, s);
  if (unit.partial >= 0) {
    store_partial(v, s, unit.partial, pb.head_dim, partials);
  } else {
    write_output(pb, v, s);
  }
}

// Merge the partitions of a split item: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p,
// the partitions having each used their own max m_p. Done by the unit of its first partition
// (the others follow it in plan.units), so each split item and head group is merged once.
template <typename Q, typename T>
inline void merge_partitions(const Problem<Q, T>& pb, const Plan& plan, size_t u, const float* partials) {
  const Unit& unit = plan.units[u];
  if (unit.partial < 0 || (u > 0 && plan.units[u - 1].item == unit.item && plan.units[u - 1].first_head == unit.first_head))
    return;  // not the first partition of its item and heads
  const int head_dim = pb.head_dim, item = unit.item, first = pb.item_first_token[item];
  const int parts = plan.item_partitions[item];
  std::vector<float> merged(head_dim);
  for_unit_rows(plan.heads_per_unit, pb.item_num_tokens[item], pb.group, [&](int r, int h, int t, int g) {
    float max = -INFINITY;
    for (int p = 0; p < parts; ++p) {
      const float* part = partial_row(partials, plan.units[u + p].partial + r, head_dim);
      if (part[head_dim + 1] > 0.0f) max = part[head_dim] > max ? part[head_dim] : max;
    }
    float sum = 0.0f;
    std::fill(merged.begin(), merged.end(), 0.0f);
    for (int p = 0; p < parts; ++p) {
      const float* part = partial_row(partials, plan.units[u + p].partial + r, head_dim);
      if (part[head_dim + 1] <= 0.0f) continue;  // saw no keys
      const float w = std::exp(part[head_dim] - max);
      sum += w * part[head_dim + 1];
      for (int d = 0; d < head_dim; ++d) merged[d] += w * part[d];
    }
    store_normalised(merged.data(), sum, pb.out + head_row(pb, first + t, unit.first_head + h, g), head_dim);
  });
}

// Q: the type of queries and outputs; T: the type of the pools (the KV cache may be stored in
// a narrower type than the model computes in).
template <typename Q, typename T>
void attention(Q* out, const Q* query, const T* key_cache, const T* value_cache,
               int64_t block_stride, int64_t head_stride,
               const int32_t* block_tables, int64_t block_table_stride,
               const int32_t* item_seq, const int32_t* item_first_token, const int32_t* item_num_tokens,
               int num_items, const int64_t* token_context,
               int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
               int fixed_partition_blocks, int sliding_window, float logits_soft_cap, int num_threads) {
#ifdef PAGED_AVX2
  const bool vector = head_dim % 8 == 0;
#else
  const bool vector = false;
#endif
  const int64_t tile_elements = static_cast<int64_t>(block_size) * head_dim;
  const Problem<Q, T> pb{out, query, key_cache, value_cache, block_stride, head_stride, block_tables,
                         block_table_stride, item_seq, item_first_token, item_num_tokens, num_items,
                         token_context, num_heads, num_kv_heads, head_dim, block_size, scale,
                         num_heads / num_kv_heads, tile_elements, head_stride == tile_elements, vector,
                         kBf16Scores<Q, T> && vector && head_dim % 32 == 0, fixed_partition_blocks,
                         sliding_window, logits_soft_cap};
  const Plan plan = plan_units(pb, num_threads);
  std::vector<float> partials(static_cast<size_t>(plan.partial_rows) * partial_width(head_dim));

#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (size_t u = 0; u < plan.units.size(); ++u) run_unit(pb, plan, plan.units[u], scratch, partials.data());
    // Every partition is written before any merge reads it: the implicit barrier above.
#pragma omp for schedule(dynamic, 1)
    for (size_t u = 0; u < plan.units.size(); ++u) merge_partitions(pb, plan, u, partials.data());
  }
}

}  // namespace

extern "C" {

// Entry points, named by (compute type)_(cache type): f32_f32, bf16_bf16, and f32_bf16 for a
// float32 model with a bfloat16 KV cache; the _windowed ones take a sliding window and a logit
// soft-cap too (0: none), so that layers without either keep the shorter call.
#define PAGED_ATTENTION_ARGS                                                                       \
  void *out, const void *query, const void *key_cache, const void *value_cache,                   \
      int64_t block_stride, int64_t head_stride, const int32_t *block_tables,                     \
      int64_t block_table_stride, const int32_t *item_seq, const int32_t *item_first_token,       \
      const int32_t *item_num_tokens, int num_items, const int64_t *token_context, int num_heads, \
      int num_kv_heads, int head_dim, int block_size, float scale, int fixed_partition_blocks
#define PAGED_ATTENTION_CALL(Q, T, WINDOW, CAP)                                                    \
  attention<Q, T>(static_cast<Q*>(out), static_cast<const Q*>(query),                              \
                  static_cast<const T*>(key_cache), static_cast<const T*>(value_cache),            \
                  block_stride, head_stride, block_tables, block_table_stride, item_seq,           \
                  item_first_token, item_num_tokens, num_items, token_context, num_heads,          \
                  num_kv_heads, head_dim, block_size, scale, fixed_partition_blocks, WINDOW, CAP,  \
                  num_threads)
#define PAGED_ATTENTION_ENTRY(NAME, Q, T)                                                          \
  void NAME(PAGED_ATTENTION_ARGS, int num_threads) { PAGED_ATTENTION_CALL(Q, T, 0, 0.0f); }        \
  void NAME##_windowed(PAGED_ATTENTION_ARGS, int sliding_window, float logits_soft_cap,            \
                       int num_threads) {                                                          \
    PAGED_ATTENTION_CALL(Q, T, sliding_window, logits_soft_cap);                                   \
  }

PAGED_ATTENTION_ENTRY(paged_attention_f32_f32, float, float)
PAGED_ATTENTION_ENTRY(paged_attention_bf16_bf16, uint16_t, uint16_t)
PAGED_ATTENTION_ENTRY(paged_attention_f32_bf16, float, uint16_t)

}  // extern "C"
