// What the AVX2 int8 kernels share (gguf_int8_avx2.h's chunked and legacy ways,
// gguf_int8_ksuper_rows.h's one-row K-quant way): x's quantization per block, the unpacking of
// Q4_K/Q5_K's 6-bit scales, scale shuffles, aligned loads and the dispatch of rows of x in fours.
// In namespace gguf::int8_avx2; included by gguf_int8_avx2.h only where AVX2, FMA and F16C are.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

namespace gguf {
namespace int8_avx2 {

constexpr int kChunk = 256;  // weights of a row of W decoded at a time (a super-block, or 8 legacy blocks)

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline __m256i load(const void* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }

// The shuffle of 8 int16 (repeated in both halves) into [int16 2q x 8 | int16 2q + 1 x 8].
inline __m256i pair_of_scales(int q) {
  const char lo = static_cast<char>(4 * q), hi = static_cast<char>(4 * q + 2);
  return _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1,
                          hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1);
}

// Q4_K's and Q5_K's eight 6-bit scales and eight minimums, packed in the 12 bytes at q (ggml's
// get_scale_min_k4), as 16 bytes: the scales, then the minimums. Reads 16 bytes (the block goes on).
//   sc[j] = q[j] & 63, m[j] = q[j + 4] & 63                                    (j < 4)
//   sc[j] = (q[j + 4] & 15) | (q[j - 4] >> 6) << 4, m[j] = q[j + 4] >> 4 | (q[j] >> 6) << 4  (j >= 4)
inline __m128i k4_scales_and_mins(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i high = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  // bytes 0-11 keep their low 6 or 4 bits; 12-15 take their high nibble
  const __m128i lows = _mm_blend_epi32(_mm_and_si128(low, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0)),
                                       _mm_and_si128(_mm_srli_epi16(low, 4), _mm_set1_epi8(15)), 0x8);
  return _mm_or_si128(lows, _mm_and_si128(_mm_srli_epi16(high, 2), _mm_set1_epi8(0x30)));  // (b >> 6) << 4
}

// Row r of x quantized per `block` into q (kc bytes, zeros past in_features) and d (per block),
// as the portable quantize_activations does it: d = max |x| / 127, q = x / d rounded to nearest
// even (the same floats: one multiply by 1 / d).
inline void quantize_row(const float* x, int64_t in_features, int64_t kc, int block, int8_t* q, float* d) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t k0 = 0; k0 < in_features; k0 += block) {
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < block; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k0 + j)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float dk = _mm_cvtss_f32(m) / 127.0f;
    const __m256 inv = _mm256_set1_ps(dk > 0.0f ? 1.0f / dk : 0.0f);
    for (int j = 0; j < block; j += 32) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k0 + j), inv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k0 + j + 8), inv));
      const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k0 + j + 16), inv));
      const __m256i e = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k0 + j + 24), inv));
      const __m256i ab = _mm256_packs_epi32(a, b), ce = _mm256_packs_epi32(c, e);
      const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(ab, ce), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0 + j), bytes);
    }
    d[k0 / block] = dk;
  }
  std::memset(q + in_features, 0, kc - in_features);
  for (int64_t b = in_features / block; b < kc / block; ++b) d[b] = 0.0f;
}

// kernel(R, g0) for the rows [g0, g0 + R) of x in runs of 4 (R a std::integral_constant: the
// row-blocked kernels take it as a template argument), the last run shorter.
template <class Kernel>
inline void in_fours(int64_t rows, Kernel&& kernel) {
  for (int64_t g0 = 0; g0 < rows; g0 += 4) {
    switch (rows - g0 < 4 ? rows - g0 : 4) {
      case 1: kernel(std::integral_constant<int, 1>{}, g0); break;
      case 2: kernel(std::integral_constant<int, 2>{}, g0); break;
      case 3: kernel(std::integral_constant<int, 3>{}, g0); break;
      default: kernel(std::integral_constant<int, 4>{}, g0); break;
    }
  }
}

}  // namespace int8_avx2
}  // namespace gguf
