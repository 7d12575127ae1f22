// What the GGUF kernels share besides the block layouts (gguf_blocks.h): the weight stream's
// software prefetch, the rows of W each OpenMP thread reads, and per-thread scratch buffers kept
// between calls. Self-contained; everything is in namespace gguf.
#pragma once

#include <cstdint>
#include <cstdlib>

#include <omp.h>
#if defined(__SSE__)
#include <immintrin.h>
#endif

// The SIMD paths this build has (-march=native): GGUF_AVX2 (with FMA), GGUF_AVX512 (F, BW, VL and
// VNNI); the AMX ways add theirs (gguf_amx.h, gguf_amx_int8.h).
#if defined(__AVX2__) && defined(__FMA__)
#define GGUF_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define GGUF_AVX512 1
#endif
#endif

namespace gguf {

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Software prefetch of the weight stream, kPrefetchAhead bytes ahead of the bytes [p, p + n)
// being decoded: one decode is too short to hide a memory access behind (measured: a 1-row
// product read 5.8 GB/s of a 9.9 GB/s stream without). Which hint reads fastest is a property of
// the core, so it is measured per machine (model/quant/read_trial.py, set by gguf_set_prefetch):
// non-temporal (kPrefetchNta, PREFETCHNTA) by default, since a weight is read once a step and its
// lines then go to L1 and not on to the other caches, where they would evict what the step keeps
// using (activations, the KV cache, the interpreter's state between kernels): on a 2-core Zen 4
// EPYC, whole decode steps, the two hints alternated, the products' rates were unchanged and the
// default model's step went 7.5 -> 6.8 ms. On a 2-core Xeon VM (AMX) the same hint throttled the
// stream: a 1-row Q8_0 product of 178 MB read 11.4 GB/s with PREFETCHNTA, 30.7 with PREFETCHT0
// (kPrefetchT0), and a plain read 10.7 against 32 GB/s.
constexpr int kPrefetchAhead = 2048;
enum PrefetchHint : int { kPrefetchNta = 0, kPrefetchT0 = 1 };
inline int& prefetch_hint() {
  static int hint = kPrefetchNta;  // until a measurement sets it
  return hint;
}
inline void prefetch_ahead(const uint8_t* p, int n) {
#if defined(__SSE__)
  const char* a = reinterpret_cast<const char*>(p + kPrefetchAhead);
  if (prefetch_hint() == kPrefetchT0)
    for (int off = 0; off < n; off += 64) _mm_prefetch(a + off, _MM_HINT_T0);
  else
    for (int off = 0; off < n; off += 64) _mm_prefetch(a + off, _MM_HINT_NTA);
#endif
}

// The rows of W that this thread of an OpenMP team reads (its static share), in `row_streams()`
// interleaved runs: a row from each of that many separate parts of the share in turn, so that the
// hardware prefetchers follow several streams at once. Which count reads fastest depends on the
// core's prefetchers, so it is measured per machine (model/quant/read_trial.py's
// choose_read_way, set by gguf_set_row_streams), never fixed: on one core of a 2-core Xeon VM a
// 1-row int8 Q4_K product read 5.5 GB/s from DRAM in one stream, 8.7 GB/s in four; on a 2-core
// AVX-512 EPYC (Zen 4) the other way round, 1-row Q4_K/Q6_K products past the L3 at 2 threads
// 25.7 GB/s in one stream, 20.9 GB/s in four (Phi-4-mini's layers; 8 streams 17 GB/s).
constexpr int kMaxStreams = 8;
inline int& row_streams() {
  static int streams = 4;  // until a measurement sets it
  return streams;
}
template <class Fn>
inline void for_rows_streamed(int64_t count, Fn&& fn) {
  const int teams = omp_get_num_threads(), me = omp_get_thread_num(), streams = row_streams();
  const int64_t lo = count * me / teams, hi = count * (me + 1) / teams, run = (hi - lo + streams - 1) / streams;
  for (int64_t i = 0; i < run; ++i)
    for (int s = 0; s < streams; ++s) {
      const int64_t n = lo + s * run + i;
      if (n < hi) fn(n);
    }
}

// The same share as four streams read together, for ways with four rows of W in flight:
// fn(rows, valid), rows[s] = lo + s q + i (q: a quarter of the share, rounded up), valid: a bit
// per stream, clear past the share's end (that stream's row is then lo + i again, read, not kept).
// Each row of W is read whole in order, and each stream goes on with the next row: four
// sequential streams, which the prefetchers follow, where four adjacent rows read a chunk of each
// in turn were not (a 1-row Q4_K product 3072 wide from DRAM: 39-40 against 52-55 GB/s).
template <class Fn>
inline void for_rows_in_four_streams(int64_t count, Fn&& fn) {
  const int teams = omp_get_num_threads(), me = omp_get_thread_num();
  const int64_t lo = count * me / teams, hi = count * (me + 1) / teams, q = (hi - lo + 3) / 4;
  for (int64_t i = 0; i < q; ++i) {
    int64_t rows[4];
    unsigned valid = 0;
    for (int s = 0; s < 4; ++s) {
      const int64_t n = lo + s * q + i;
      valid |= (n < hi ? 1u : 0u) << s;
      rows[s] = n < hi ? n : lo + i;
    }
    fn(rows, valid);
  }
}

// A 64-byte aligned buffer of at least `bytes` that the calling thread keeps between calls (one
// per slot): fresh pages on every call would fault in.
inline void* thread_buffer(int slot, int64_t bytes) {
  struct Buffer {
    void* data = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(data); }
  };
  static thread_local Buffer buffers[10];
  Buffer& b = buffers[slot];
  if (b.size < bytes) {
    std::free(b.data);
    b.size = round_up(bytes, 64);
    b.data = std::aligned_alloc(64, b.size);
  }
  return b.data;
}
}  // namespace gguf
