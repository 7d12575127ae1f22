// y = x W^T with W in a GGUF block type (layouts in gguf_blocks.h), for any number of rows of x:
// the entry points of the GGUF kernels and the choice of way. The packed weight is the file's rows
// of blocks as they are (kernels/gguf.py's PackedWeight.data): no float copy is kept.
//
// The ways, each in its own header:
// - float, a few rows (below kTiledRows: decoding), gguf_float.h's fused_matmul: each block of a
//   row of W expanded in registers and multiplied with up to 8 rows of x (4 on AVX2).
// - float, more rows (prompts), gguf_float.h's tiled_matmul: x in transposed panels, 12 rows of W
//   expanded into a buffer, each weight broadcast against a panel's column.
// - float, 8 to 31 rows on AMX (path 3), types with one scale per 32 weights: gguf_amx_exact.h
//   (exact operands on the tiles); 32 rows and more: gguf_amx.h (two bfloat16 halves).
// - int8 (use_int8: x quantized per 32 or per 256, llama.cpp's Q8_0 and Q8_K; gguf_int8.h):
//   on AVX2, gguf_int8_avx2.h (VPMADDUBSW, register-blocked over rows of W and groups of rows of
//   x); on AVX-512 VNNI, gguf_vnni_int8.h (VPDPBUSD; one row of x, or two of a legacy type, takes
//   four rows of W at a time, gguf_vnni_wrows.h); on AMX-INT8 from 5 rows (10 for Q6_K),
//   gguf_amx_int8.h and gguf_amx_q8k.h. The types only the AVX2 way decodes (Q2_K, Q3_K, IQ4_NL,
//   IQ4_XS) take it on every SIMD path. The portable way decodes a row into a buffer.
// The ISA path (portable C++, AVX2, AVX-512, AMX) is chosen at run time (gguf_set_isa) among those
// this build has, so tests run every one the machine can. Rows of W are split across OpenMP
// threads. Math in float32.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <omp.h>

#include "gguf_amx.h"
#include "gguf_amx_exact.h"
#include "gguf_amx_int8.h"
#include "gguf_amx_q8k.h"
#include "gguf_blocks.h"
#include "gguf_common.h"
#include "gguf_float.h"
#include "gguf_int8.h"
#include "gguf_int8_avx2.h"
#include "gguf_matmul.h"
#include "gguf_vnni_int8.h"

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

// The int8 way per type and row count where the path has more than one (AVX-512 and AMX: its own,
// or the AVX2 way): chosen by a measurement (kernels/gguf.py's set_int8_way), never by a table of
// thresholds. Row counts in buckets by powers of two: 1, 2-3, 4-7, ..., 64 and more.
// kWayAvx2Rows: the AVX2 way with every row of x alone (int8_avx2::matmul's rows_alone), on every
// SIMD path.
enum Int8Way : int { kWayPath = 0, kWayAvx2 = 1, kWayAvx2Rows = 2 };
constexpr int kWayBuckets = 8;
constexpr int kWayTypes = 32;  // (ggml's type ids are below this)
int g_int8_way[kWayTypes][kWayBuckets] = {};

inline int way_bucket(int64_t rows) {
  int b = 0;
  while (b + 1 < kWayBuckets && (int64_t{1} << (b + 1)) <= rows) ++b;
  return b;
}
// Ways measured for one row width (in_features) of a type, where the trial's width chose
// otherwise: per row the fixed costs (reductions, the constants' term) weigh more in a short row
// (measured: Q8_0 at 1 row, 640 wide: the AVX2 way 30% faster than VNNI; 2048 wide: a tie). -1:
// not set for that bucket (the type's way).
struct WidthWays {
  int qtype;
  int64_t in_features;
  int8_t way[kWayBuckets];
};
constexpr int kMaxWidths = 64;
WidthWays g_width_ways[kMaxWidths];
int g_num_width_ways = 0;

WidthWays* width_ways(int qtype, int64_t in_features) {
  for (int i = 0; i < g_num_width_ways; ++i)
    if (g_width_ways[i].qtype == qtype && g_width_ways[i].in_features == in_features) return &g_width_ways[i];
  return nullptr;
}

inline int int8_way(int qtype, int64_t rows, int64_t in_features = 0) {
  if (qtype < 0 || qtype >= kWayTypes) return kWayPath;
  const int bucket = way_bucket(rows);
  if (g_num_width_ways > 0 && in_features > 0)
    if (const WidthWays* w = width_ways(qtype, in_features); w != nullptr && w->way[bucket] >= 0) return w->way[bucket];
  return g_int8_way[qtype][bucket];
}

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

template <int ISA, bool kSigned>
inline void int8_dot_group(float* y, int64_t y_stride, const uint8_t* u, const float* s16, const float* c16,
                           const Int8Rows& a, int64_t r0, int rows) {
  int8_dot_portable(y, y_stride, u, s16, c16, kSigned, a, r0, rows);
}


template <int ISA, bool kSigned>
void int8_matmul(int qtype, float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                 int64_t in_features, int num_threads) {
#ifdef GGUF_INT8_AVX2
  // (the types the VNNI and AMX ways have no decoder for take the AVX2 way on every SIMD path, as
  // do the row counts where a measurement chose it: gguf_set_int8_way)
  const int way = int8_way(qtype, num_rows, in_features);
  if (ISA != kPortable && (ISA == kAvx2 || !vnni_type(qtype) || way != kWayPath))
    return int8_avx2::matmul(qtype, y, x, packed, num_rows, out_features, in_features, num_threads, way == kWayAvx2Rows);
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

// out: [num_indices, in_features] float32, the rows `indices` of W (num_rows of them) dequantized
// exactly as gguf-py does (embedding lookups, tests). Returns 0, or -1 (nothing written) where an
// index is outside [0, num_rows): the check costs the caller no tensor operations (a decode step's
// lookup of a token or two is mostly such fixed costs).
int gguf_dequantize_rows(int qtype_id, float* out, const uint8_t* packed, const int64_t* indices, int64_t num_indices,
                         int64_t num_rows, int64_t in_features, int num_threads) {
  const TypeSize t = type_size(qtype_id);
  if (t.weights == 0) return 0;
  for (int64_t i = 0; i < num_indices; ++i)
    if (indices[i] < 0 || indices[i] >= num_rows) return -1;
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const int threads = num_indices < num_threads ? static_cast<int>(num_indices) : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < num_indices; ++i)
    expand_row_portable(qtype_id, packed + indices[i] * row_bytes, num_blocks, out + i * in_features);
  return 0;
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
// threads its share in row_streams() interleaved runs with software prefetch (prefetch_hint()),
// 256 bytes a step (on AVX2: 32-byte loads summed as bytes). Returns a checksum, so that nothing
// is left out; a benchmark times it for the machine's read bandwidth.
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

// The interleaved runs each thread reads its rows of W in (gguf_common.h's for_rows_streamed):
// 1 to kMaxStreams; returns nonzero (and changes nothing) outside.
int gguf_set_row_streams(int streams) {
  if (streams < 1 || streams > kMaxStreams) return 1;
  row_streams() = streams;
  return 0;
}
int gguf_row_streams() { return row_streams(); }
// The hint of the weight stream's software prefetch (gguf_common.h's prefetch_ahead): kPrefetchNta
// or kPrefetchT0; returns nonzero (and changes nothing) for any other.
int gguf_set_prefetch(int hint) {
  if (hint != kPrefetchNta && hint != kPrefetchT0) return 1;
  prefetch_hint() = hint;
  return 0;
}
int gguf_prefetch() { return prefetch_hint(); }
// Selects the path (tests, benchmarks); returns 0, or -1 (unchanged) if this build lacks it.
int gguf_set_isa(int isa) {
  if (isa < 0 || isa > best_isa()) return -1;
  g_isa = isa;
  return 0;
}

// The int8 way of products of `rows` rows of type qtype_id (with every other row count in its
// bucket: 1, 2-3, 4-7, ..., 64 and more): 0 the path's own (VNNI, AMX; on the AVX2 path the AVX2
// way), 1 the AVX2 way, 2 the AVX2 way with every row of x alone. Returns 0, or -1 if this build
// has no AVX2 way or the arguments are out of range.
int gguf_set_int8_way(int qtype_id, int64_t rows, int way) {
#ifdef GGUF_INT8_AVX2
  if (qtype_id < 0 || qtype_id >= kWayTypes || type_size(qtype_id).weights == 0 || rows < 1 || way < kWayPath || way > kWayAvx2Rows)
    return -1;
  g_int8_way[qtype_id][way_bucket(rows)] = way;
  return 0;
#else
  return -1;
#endif
}
int gguf_int8_way(int qtype_id, int64_t rows) { return int8_way(qtype_id, rows); }

// As gguf_set_int8_way, for products whose rows are in_features wide only (way -1: that bucket
// takes the type's way again). Returns 0, or -1 if out of range or the table is full.
int gguf_set_int8_way_for_width(int qtype_id, int64_t in_features, int64_t rows, int way) {
#ifdef GGUF_INT8_AVX2
  if (qtype_id < 0 || qtype_id >= kWayTypes || type_size(qtype_id).weights == 0 || rows < 1 || in_features < 1 ||
      way < -1 || way > kWayAvx2Rows)
    return -1;
  WidthWays* w = width_ways(qtype_id, in_features);
  if (w == nullptr) {
    if (g_num_width_ways == kMaxWidths) return -1;
    w = &g_width_ways[g_num_width_ways];
    *w = WidthWays{qtype_id, in_features, {}};
    for (int b = 0; b < kWayBuckets; ++b) w->way[b] = -1;
    ++g_num_width_ways;
  }
  w->way[way_bucket(rows)] = static_cast<int8_t>(way);
  return 0;
#else
  return -1;
#endif
}
int gguf_int8_way_for_width(int qtype_id, int64_t in_features, int64_t rows) {
  return int8_way(qtype_id, rows, in_features);
}

}  // extern "C"
