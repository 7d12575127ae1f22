// y = x W^T with W kept in its GGUF block quantization (Q4_1 or Q8_0), for a few rows of x.
//
// Decoding a handful of sequences is bound by reading the weights: a float32 copy of a 135M
// parameter model is 540 MB per step, its Q4_1/Q8_0 blocks about 80 MB. This kernel reads the
// blocks and expands them in registers: per block of 32 weights, Q4_1 holds a float16 scale d,
// a float16 minimum m and 32 4-bit values q (w = d q + m); Q8_0 holds d and 32 int8 values
// (w = d q). With s_b(x) = sum of x over the block, a row of y is
//   Q4_1: sum_b d_b (q_b . x_b) + m_b s_b(x)        Q8_0: sum_b d_b (q_b . x_b)
// computed in float32. Rows of W are independent, split across OpenMP threads.

#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd.h"
#define QUANT_AVX2 1
#endif

namespace {

constexpr int kBlock = 32;
constexpr int kQ41Bytes = 20;  // d, m (float16 each), 16 bytes of 4-bit values
constexpr int kQ80Bytes = 34;  // d (float16), 32 int8 values
constexpr int kRowGroup = 4;   // rows of x handled per pass over a weight row

inline float half_to_float(uint16_t h) {
#ifdef QUANT_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exponent = 127 - 15 + 1;
      while (!(mantissa & 0x400u)) { mantissa <<= 1; --exponent; }
      bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

inline uint16_t read_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The 32 quantized values of one block as floats (without d and m).
inline void expand_block(const uint8_t* block, bool q4_1, float* q) {
  if (q4_1) {
    const uint8_t* qs = block + 4;
    for (int j = 0; j < 16; ++j) {
      q[j] = static_cast<float>(qs[j] & 0x0F);
      q[j + 16] = static_cast<float>(qs[j] >> 4);
    }
  } else {
    const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < kBlock; ++j) q[j] = static_cast<float>(qs[j]);
  }
}

#ifdef QUANT_AVX2
using namespace pagedllm_simd;

struct Expanded {
  __m256 q[4];
};

inline Expanded expand_block_avx2(const uint8_t* block, bool q4_1) {
  Expanded e;
  if (q4_1) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);                     // values 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);  // values 16..31
    e.q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    e.q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    e.q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    e.q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    const uint8_t* qs = block + 2;
    for (int c = 0; c < 4; ++c) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * c));
      e.q[c] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    }
  }
  return e;
}

#endif

void quant_matmul(float* y, const float* x, const uint8_t* w, int num_rows, int out_features, int in_features,
                  bool q4_1, int num_threads) {
  const int num_blocks = in_features / kBlock;
  const int64_t row_bytes = static_cast<int64_t>(num_blocks) * (q4_1 ? kQ41Bytes : kQ80Bytes);
  const int block_bytes = q4_1 ? kQ41Bytes : kQ80Bytes;
  // Block sums of x, for the minimum term of Q4_1.
  std::vector<float> x_sums(static_cast<size_t>(num_rows) * num_blocks, 0.0f);
  if (q4_1)
    for (int r = 0; r < num_rows; ++r)
      for (int b = 0; b < num_blocks; ++b) {
        float s = 0.0f;
        for (int j = 0; j < kBlock; ++j) s += x[static_cast<int64_t>(r) * in_features + b * kBlock + j];
        x_sums[static_cast<size_t>(r) * num_blocks + b] = s;
      }

#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int n = 0; n < out_features; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int r0 = 0; r0 < num_rows; r0 += kRowGroup) {
      const int rows = num_rows - r0 < kRowGroup ? num_rows - r0 : kRowGroup;
      float scaled[kRowGroup] = {0, 0, 0, 0};
      float minimum[kRowGroup] = {0, 0, 0, 0};
#ifdef QUANT_AVX2
      __m256 acc[kRowGroup] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int b = 0; b < num_blocks; ++b) {
        const uint8_t* block = row + static_cast<int64_t>(b) * block_bytes;
        const __m256 d = _mm256_set1_ps(half_to_float(read_u16(block)));
        const Expanded e = expand_block_avx2(block, q4_1);
        for (int r = 0; r < rows; ++r) {
          const float* xb = x + static_cast<int64_t>(r0 + r) * in_features + b * kBlock;
          __m256 t = _mm256_mul_ps(e.q[0], _mm256_loadu_ps(xb));
          t = _mm256_fmadd_ps(e.q[1], _mm256_loadu_ps(xb + 8), t);
          t = _mm256_fmadd_ps(e.q[2], _mm256_loadu_ps(xb + 16), t);
          t = _mm256_fmadd_ps(e.q[3], _mm256_loadu_ps(xb + 24), t);
          acc[r] = _mm256_fmadd_ps(t, d, acc[r]);
        }
        if (q4_1) {
          const float m = half_to_float(read_u16(block + 2));
          for (int r = 0; r < rows; ++r) minimum[r] += m * x_sums[static_cast<size_t>(r0 + r) * num_blocks + b];
        }
      }
      for (int r = 0; r < rows; ++r) scaled[r] = hsum(acc[r]);
#else
      float q[kBlock];
      for (int b = 0; b < num_blocks; ++b) {
        const uint8_t* block = row + static_cast<int64_t>(b) * block_bytes;
        const float d = half_to_float(read_u16(block));
        expand_block(block, q4_1, q);
        for (int r = 0; r < rows; ++r) {
          const float* xb = x + static_cast<int64_t>(r0 + r) * in_features + b * kBlock;
          float dot = 0.0f;
          for (int j = 0; j < kBlock; ++j) dot += q[j] * xb[j];
          scaled[r] += d * dot;
        }
        if (q4_1) {
          const float m = half_to_float(read_u16(block + 2));
          for (int r = 0; r < rows; ++r) minimum[r] += m * x_sums[static_cast<size_t>(r0 + r) * num_blocks + b];
        }
      }
#endif
      for (int r = 0; r < rows; ++r) y[static_cast<int64_t>(r0 + r) * out_features + n] = scaled[r] + minimum[r];
    }
  }
}

}  // namespace

extern "C" {

// qtype: 0 = Q8_0, 1 = Q4_1. x: [num_rows, in_features] float32; w: [out_features, blocks];
// y: [num_rows, out_features] float32. in_features must be a multiple of 32.
void quant_matmul_f32(float* y, const float* x, const uint8_t* w, int num_rows, int out_features, int in_features,
                      int qtype, int num_threads) {
  quant_matmul(y, x, w, num_rows, out_features, in_features, qtype == 1, num_threads);
}

}  // extern "C"
