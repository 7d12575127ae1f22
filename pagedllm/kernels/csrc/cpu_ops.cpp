// Fused element-wise steps of a float32 decoder layer on the CPU: each replaces several torch
// operators (and their dispatch and temporaries), which at small batches cost more than the
// arithmetic.
//   fused_add_rms_norm: residual += x (optional), out = weight * residual / rms(residual)
//   rotary_neox: rotate the query and key heads of each token in place (halves layout)
//   silu_and_mul: out = silu(gate) * up for rows laid out [gate | up]

#include <cmath>
#include <cstdint>

#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#define OPS_AVX2 1
#endif

namespace {

// Rows of work below which the ops stay on one thread (waking the pool costs more).
constexpr int64_t kParallelElements = 1 << 15;

#ifdef OPS_AVX2
using namespace pagedllm_simd;
#endif

void fused_add_rms_norm(float* out, float* residual, const float* x, const float* weight, int num_rows, int dim,
                        float eps, int num_threads) {
  const int threads = static_cast<int64_t>(num_rows) * dim >= kParallelElements ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int row = 0; row < num_rows; ++row) {
    const float* src = x + static_cast<int64_t>(row) * dim;
    float* dst = out + static_cast<int64_t>(row) * dim;
    if (residual != nullptr) {  // the sum becomes the residual stream, and is what is normalised
      float* res = residual + static_cast<int64_t>(row) * dim;
      for (int i = 0; i < dim; ++i) res[i] += src[i];
      src = res;
    }
    float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
    for (int i = 0; i < dim; ++i) sum_sq += src[i] * src[i];
    const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int i = 0; i < dim; ++i) dst[i] = weight[i] * (src[i] * inv_rms);
  }
}

// qk: [num_tokens] rows of row_stride floats, starting with num_heads heads of head_dim;
// cos, sin: [max_position, head_dim] (the first half is used).
void rotary_neox(float* qk, int64_t row_stride, const int64_t* positions, const float* cos_cache,
                 const float* sin_cache, int num_tokens, int num_heads, int head_dim, int num_threads) {
  const int half = head_dim / 2;
  const int threads = static_cast<int64_t>(num_tokens) * num_heads * head_dim >= kParallelElements ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < num_tokens; ++t) {
    const float* c = cos_cache + positions[t] * head_dim;
    const float* s = sin_cache + positions[t] * head_dim;
    for (int h = 0; h < num_heads; ++h) {
      float* x1 = qk + t * row_stride + static_cast<int64_t>(h) * head_dim;
      float* x2 = x1 + half;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  }
}

void silu_and_mul(float* out, const float* x, int num_rows, int dim, int num_threads) {
  const int threads = static_cast<int64_t>(num_rows) * dim >= kParallelElements ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int row = 0; row < num_rows; ++row) {
    const float* gate = x + static_cast<int64_t>(row) * 2 * dim;
    const float* up = gate + dim;
    float* dst = out + static_cast<int64_t>(row) * dim;
    int i = 0;
#ifdef OPS_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= dim; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < dim; ++i) dst[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
}

}  // namespace

extern "C" {

// residual may be null (plain RMSNorm of x).
void fused_add_rms_norm_f32(float* out, float* residual, const float* x, const float* weight, int num_rows, int dim,
                            float eps, int num_threads) {
  fused_add_rms_norm(out, residual, x, weight, num_rows, dim, eps, num_threads);
}

void rotary_neox_f32(float* qk, int64_t row_stride, const int64_t* positions, const float* cos_cache,
                     const float* sin_cache, int num_tokens, int num_heads, int head_dim, int num_threads) {
  rotary_neox(qk, row_stride, positions, cos_cache, sin_cache, num_tokens, num_heads, head_dim, num_threads);
}

void silu_and_mul_f32(float* out, const float* x, int num_rows, int dim, int num_threads) {
  silu_and_mul(out, x, num_rows, dim, num_threads);
}

}  // extern "C"
