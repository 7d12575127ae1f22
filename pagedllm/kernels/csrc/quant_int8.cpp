// y = x W^T with W from GGUF blocks (Q4_1, Q8_0) and x quantized to int8 on the fly: integer
// dot products, for a few rows of x.
//
// Each row of x is quantized per block of 32 values, as llama.cpp's Q8 does: a scale
// dx = max|x| / 127, 32 int8 values round(x / dx), and the sum of the rounded block, dx sum(qx)
// (for Q4_1's minimum, as llama.cpp's Q8_1). A block's dot product is then
//   Q4_1 (w = d q + m, q in 0..15):   d dx sum(q qx) + m dx sum(qx)
//   Q8_0 (w = d q, q in -127..127):   d dx sum(q qx)
// with sum(q qx) on 8-bit integers: one VPDPBUSD (AVX-VNNI, AVX512-VNNI) or VPMADDUBSW and
// VPMADDWD (AVX2) per 32 products, against four float FMAs and the expansion of the weights.
// VPDPBUSD and VPMADDUBSW multiply unsigned by signed bytes: Q4_1 values are unsigned already;
// for Q8_0 the weight's sign moves onto x (|q| times sign(q) qx).
//
// Outputs are close to the float32 product, not equal: x loses bits to its 8-bit quantization.
// `pagedllm bench dtype` measures what that does to greedy outputs. Selected at build time by
// the compiler's target (-march=native), reported by quant_int8_isa().

#include <cmath>
#include <cstdint>
#include <vector>

#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#define INT8_AVX2 1
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kRowGroup = 4;  // rows of x that share each load of a block of W

// qx, dx, sx for `rows` rows of x (in_features a multiple of 32).
void quantize_rows(int8_t* qx, float* dx, float* sx, const float* x, int rows, int in_features) {
  const int num_blocks = in_features / kBlock;
  for (int r = 0; r < rows; ++r) {
    for (int b = 0; b < num_blocks; ++b) {
      const int64_t base = static_cast<int64_t>(r) * in_features + b * kBlock;
      const float* src = x + base;
      float amax = 0.0f;
      for (int j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(src[j]));
      const float d = amax / 127.0f;
      const float inv = d > 0.0f ? 1.0f / d : 0.0f;
      int sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int q = static_cast<int>(std::nearbyint(src[j] * inv));
        qx[base + j] = static_cast<int8_t>(q);
        sum += q;
      }
      dx[static_cast<int64_t>(r) * num_blocks + b] = d;
      // The sum of the rounded x, not of x: Q4_1's minimum then meets the same x as its values,
      // so that the weight d q + m, centred, bears the rounding (llama.cpp's Q8_1 sum). With x's
      // own sum the error followed d q, uncentred: 2.4x the relative error on the embedded
      // model's projections (benchmarks/int8_product_error.py).
      sx[static_cast<int64_t>(r) * num_blocks + b] = d * static_cast<float>(sum);
    }
  }
}

#ifdef INT8_AVX2
using namespace pagedllm_simd;

// 8 int32 sums of 4 products each: unsigned bytes u times signed bytes s.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  // pairs of products into 16 int16 (at most 2 * 128 * 127: no saturation), then pairs of those
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// y[r * out_features] = x_r . w for R rows of x and one row of W.
template <int R, bool kSigned>
inline void dot_rows(float* y, int64_t out_features, const int8_t* qx, const float* dx, const float* sx,
                     int64_t in_features, const uint8_t* values, const float* scales, const float* mins,
                     int num_blocks) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int b = 0; b < num_blocks; ++b) {
    __m256i w;
    if (kSigned) {
      w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + b * kBlock));
    } else {  // Q4_1's nibbles: values 0-15 in the low ones, 16-31 in the high ones
      __m128i lo, hi;
      split_nibbles(values + b * (kBlock / 2), &lo, &hi);
      w = _mm256_set_m128i(hi, lo);
    }
    const __m256i wu = kSigned ? _mm256_abs_epi8(w) : w;
    const float d = scales[b];
    for (int r = 0; r < R; ++r) {
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * in_features + b * kBlock));
      if (kSigned) q = _mm256_sign_epi8(q, w);
      const __m256 dot = _mm256_cvtepi32_ps(dot_u8s8(wu, q));
      acc[r] = _mm256_fmadd_ps(dot, _mm256_set1_ps(d * dx[r * num_blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float min_term = 0.0f;
    if (!kSigned) {  // sum over blocks of m sum(x)
      const float* s = sx + r * num_blocks;
      int b = 0;
      __m256 m8 = _mm256_setzero_ps();
      for (; b + 8 <= num_blocks; b += 8) m8 = _mm256_fmadd_ps(_mm256_loadu_ps(mins + b), _mm256_loadu_ps(s + b), m8);
      min_term = hsum(m8);
      for (; b < num_blocks; ++b) min_term += mins[b] * s[b];
    }
    y[r * out_features] = hsum(acc[r]) + min_term;
  }
}

template <bool kSigned>
inline void row_group(float* y, int64_t out_features, const int8_t* qx, const float* dx, const float* sx,
                      int64_t in_features, const uint8_t* values, const float* scales, const float* mins,
                      int num_blocks, int rows) {
  switch (rows) {
    case 1: return dot_rows<1, kSigned>(y, out_features, qx, dx, sx, in_features, values, scales, mins, num_blocks);
    case 2: return dot_rows<2, kSigned>(y, out_features, qx, dx, sx, in_features, values, scales, mins, num_blocks);
    case 3: return dot_rows<3, kSigned>(y, out_features, qx, dx, sx, in_features, values, scales, mins, num_blocks);
    default: return dot_rows<4, kSigned>(y, out_features, qx, dx, sx, in_features, values, scales, mins, num_blocks);
  }
}

#else  // portable

template <bool kSigned>
inline void row_group(float* y, int64_t out_features, const int8_t* qx, const float* dx, const float* sx,
                      int64_t in_features, const uint8_t* values, const float* scales, const float* mins,
                      int num_blocks, int rows) {
  for (int r = 0; r < rows; ++r) {
    float total = 0.0f;
    for (int b = 0; b < num_blocks; ++b) {
      int32_t dot = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int k = b * kBlock + j;
        const int32_t q = kSigned ? static_cast<int8_t>(values[k])
                                  : (j < 16 ? values[b * 16 + j] & 0x0F : values[b * 16 + j - 16] >> 4);
        dot += q * qx[r * in_features + k];
      }
      total += scales[b] * dx[r * num_blocks + b] * static_cast<float>(dot);
      if (!kSigned) total += mins[b] * sx[r * num_blocks + b];
    }
    y[r * out_features] = total;
  }
}

#endif

template <bool kSigned>
void matmul(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins, int num_rows,
            int out_features, int in_features, int num_threads) {
  const int num_blocks = in_features / kBlock;
  std::vector<int8_t> qx(static_cast<size_t>(num_rows) * in_features);
  std::vector<float> dx(static_cast<size_t>(num_rows) * num_blocks), sx(dx.size());
  quantize_rows(qx.data(), dx.data(), sx.data(), x, num_rows, in_features);
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int n = 0; n < out_features; ++n) {
    const uint8_t* v = values + static_cast<int64_t>(n) * (kSigned ? in_features : in_features / 2);
    const float* d = scales + static_cast<int64_t>(n) * num_blocks;
    const float* m = kSigned ? nullptr : mins + static_cast<int64_t>(n) * num_blocks;
    for (int r0 = 0; r0 < num_rows; r0 += kRowGroup) {
      const int rows = num_rows - r0 < kRowGroup ? num_rows - r0 : kRowGroup;
      row_group<kSigned>(y + static_cast<int64_t>(r0) * out_features + n, out_features,
                         qx.data() + static_cast<int64_t>(r0) * in_features, dx.data() + r0 * num_blocks,
                         sx.data() + r0 * num_blocks, in_features, v, d, m, num_blocks, rows);
    }
  }
}

}  // namespace

extern "C" {

// As quant_matmul_f32 (same unpacked blocks: Q4_1's values as nibbles), with x quantized to
// int8 per block of 32.
void quant_matmul_int8(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins,
                       int num_rows, int out_features, int in_features, int num_threads) {
  if (mins != nullptr)
    matmul<false>(y, x, values, scales, mins, num_rows, out_features, in_features, num_threads);
  else
    matmul<true>(y, x, values, scales, mins, num_rows, out_features, in_features, num_threads);
}

// Which integer dot product this build runs: 0 portable C++, 1 AVX2 (VPMADDUBSW), 2 AVX-VNNI,
// 3 AVX512-VNNI (both VPDPBUSD).
int quant_int8_isa() {
#if defined(INT8_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return 3;
#elif defined(INT8_AVX2) && defined(__AVXVNNI__)
  return 2;
#elif defined(INT8_AVX2)
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
