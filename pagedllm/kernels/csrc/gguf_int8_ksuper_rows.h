// The int8 way on AVX2 for one row of x, or rows of x taken alone ("avx2_rows"), of the K-quants
// Q4_K, Q5_K and Q6_K: W read super-block by super-block in natural order, everything in
// registers (the shape of llama.cpp's dot products with Q8_K). gguf_int8_avx2.h's matmul sends
// those products here (lean_matmul_rows). In namespace gguf::int8_avx2; included by
// gguf_int8_avx2.h only where AVX2, FMA and F16C are.
#pragma once

#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "gguf_blocks.h"
#include "gguf_common.h"
#include "gguf_int8_avx2_parts.h"

namespace gguf {
namespace int8_avx2 {

// Q4_K and Q5_K, rows of x alone (G = 1): one row of W times R of them, super-block by
// super-block, as llama.cpp's Q4_K x Q8_K dot product reads it. x in natural order (no pairs of
// sub-blocks): one 32-byte load of W's nibbles is 64 weights, sub-block 2j in the low nibbles and
// 2j + 1 in the high (Q5_K: bit 4 from bits 2j and 2j + 1 of its 32 high-bit bytes), each
// multiplied against 32 bytes of x (VPMADDUBSW), then by its 6-bit scale (VPMADDWD); the minimums
// against x's sums per sub-block (int16, kept with x) in one 128-bit VPMADDWD; per super-block
// two FMAs (by d dx and dmin dx) into float lanes summed at the row's end. Against the chunked
// way (Decoder and chunk_product: scales per pair of sub-blocks, float accumulators stored a
// chunk) it decodes 64 weights per load and keeps everything in registers. Measured on a 2-core
// Zen 4 EPYC, one thread, alternated in one process: Q4_K 10.3-10.5 -> 8.6-8.7 ns a super-block
// (from L2 and from memory alike); Phi-4-mini's decode step 101 -> 92 ms (medians of 8 rounds).
inline __m256i k4_scale_of(__m256i scales, int k) {  // int16 k of each half over its half
  const char lo = static_cast<char>(2 * k), hi = static_cast<char>(2 * k + 1);
  return _mm256_shuffle_epi8(scales, _mm256_setr_epi8(lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi,
                                                      lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi));
}

// One row of x as the lean kernels read it: values in natural order, a scale per 256, sums per
// sub-block (Q4_K, Q5_K: 32) or group (Q6_K: 16).
struct LeanRow {
  const int8_t* q;
  const float* d;
  const int16_t* sums;
};

template <int T, int R>
inline void k4_rows(float* out, const uint8_t* row, int64_t num_blocks, const LeanRow* xs) {
  const int bytes = type_size(T).bytes;
  constexpr int qs_at = T == kQ4_K ? 16 : 48;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  __m256 acc[R];
  __m128 macc[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    macc[r] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* p = row + b * bytes;
    prefetch_ahead(p, bytes);
    uint32_t dm_bits;
    std::memcpy(&dm_bits, p, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm_bits)));  // [d, dmin, 0, 0]
    const __m128i both = k4_scales_and_mins(p + 4);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(both));
    const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(both, 8));
    __m256i lo[4], hi[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + qs_at + 32 * j));
      lo[j] = _mm256_and_si256(v, low4);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (T == kQ5_K) {
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
        lo[j] = _mm256_or_si256(lo[j], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * j), 4), bit4));
        hi[j] = _mm256_or_si256(hi[j], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, 2 * j + 1), 4), bit4));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const int8_t* x = xs[r].q + b * 256;
      __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256i pl = _mm256_maddubs_epi16(lo[j], load(x + 64 * j));
        const __m256i ph = _mm256_maddubs_epi16(hi[j], load(x + 64 * j + 32));
        isum = _mm256_add_epi32(isum, _mm256_add_epi32(_mm256_madd_epi16(pl, k4_scale_of(scales, 2 * j)),
                                                       _mm256_madd_epi16(ph, k4_scale_of(scales, 2 * j + 1))));
      }
      const __m128i msum = _mm_madd_epi16(mins, _mm_loadu_si128(reinterpret_cast<const __m128i*>(xs[r].sums + 8 * b)));
      const __m128 ddx = _mm_mul_ps(dm, _mm_set1_ps(xs[r].d[b]));  // [d dx, dmin dx, 0, 0]
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcastss_ps(ddx), acc[r]);
      macc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(msum), _mm_permute_ps(ddx, 0x55), macc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 h = _mm_sub_ps(_mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1)), macc[r]);
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[r] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
}

// Q6_K, rows of x alone: as k4_rows, 128 weights from three 32-byte loads (low nibbles of two,
// 2-bit pairs of the third), each 32 against a vector of its two groups' scales; the offset 32
// comes off the integer sums as 32 sc times x's sums per group of 16 (one VPMADDWD a
// super-block). One thread on the Zen 4 EPYC: 11.6-12.1 -> 9.2-10.1 ns a super-block from L2.
template <int R>
inline void k6_rows(float* out, const uint8_t* row, int64_t num_blocks, const LeanRow* xs) {
  const int bytes = type_size(kQ6_K).bytes;
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* p = row + b * bytes;
    prefetch_ahead(p, bytes);
    const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(p + 208)));
    const __m256i scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
    const __m256i low_scales = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(scales));
    const __m256i high_scales = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(scales, 1));
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
      const __m256i v[4] = {
          _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45)),
          _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, bits45)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4), _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45))};
      const __m256i half_scales = h == 0 ? low_scales : high_scales;
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m256i sc = _mm256_shuffle_epi8(half_scales, pair_of_scales(q));
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(v[q], load(xs[r].q + b * 256 + 128 * h + 32 * q)), sc));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // Q6_K's offset: w = d sc (u - 32), so 32 sc times x's sum per group of 16 comes off
      const __m256i m = _mm256_madd_epi16(scales, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs[r].sums + 16 * b)));
      const __m256i net = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(m, 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(net), _mm256_set1_ps(_mm_cvtss_f32(d) * xs[r].d[b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    out[r] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
}

template <int T, int R>
inline void lean_rows(float* out, const uint8_t* row, int64_t num_blocks, const LeanRow* xs) {
  if constexpr (T == kQ6_K) k6_rows<R>(out, row, num_blocks, xs);
  else k4_rows<T, R>(out, row, num_blocks, xs);
}

// y = x W^T for Q4_K, Q5_K or Q6_K with every row of x alone (one row: decoding; or the
// "avx2_rows" way): x quantized per 256 in natural order with its sums per sub-block or group,
// then lean_rows over the rows of W, 4 rows of x at a time.
template <int T>
inline void lean_matmul_rows(float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                             int64_t in_features, int num_threads) {
  constexpr int U = T == kQ6_K ? 16 : 32;  // weights per sum of x
  const TypeSize t = type_size(T);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const int64_t kc = num_blocks * kChunk, units = kc / U;
  constexpr int64_t max_rows = 64;
  const int64_t per_row = round_up(kc + 4 * num_blocks + 2 * units, 64);
  for (int64_t r0 = 0; r0 < num_rows; r0 += max_rows) {
    const int64_t rows = num_rows - r0 < max_rows ? num_rows - r0 : max_rows;
    uint8_t* base = static_cast<uint8_t*>(thread_buffer(6, rows * per_row));
    LeanRow xs[max_rows];
    for (int64_t r = 0; r < rows; ++r) {
      uint8_t* at = base + r * per_row;
      int8_t* q = reinterpret_cast<int8_t*>(at);
      float* d = reinterpret_cast<float*>(at + kc);
      int16_t* sums = reinterpret_cast<int16_t*>(at + kc + 4 * num_blocks);
      quantize_row(x + (r0 + r) * in_features, in_features, kc, kChunk, q, d);
      for (int64_t u = 0; u < units; ++u) {
        int sum = 0;
        for (int k = 0; k < U; ++k) sum += q[U * u + k];
        sums[u] = static_cast<int16_t>(sum);
      }
      xs[r] = LeanRow{q, d, sums};
    }
    const LeanRow* xr = xs;
    float* yr = y + r0 * out_features;
#pragma omp parallel num_threads(num_threads)
    for_rows_streamed(out_features, [&](int64_t n) {
      const uint8_t* w = packed + n * row_bytes;
      in_fours(rows, [&](auto R, int64_t g0) {
        constexpr int rs = decltype(R)::value;
        float out[rs];
        lean_rows<T, rs>(out, w, num_blocks, xr + g0);
        for (int r = 0; r < rs; ++r) yr[(g0 + r) * out_features + n] = out[r];
      });
    });
  }
}

}  // namespace int8_avx2
}  // namespace gguf
