// A row of logits' maximum, shared by the sampling kernels (sampling.cpp, sampling_filtered.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#include "simd.h"

namespace pagedllm_sampling {

// The row's maximum; NaN if the row holds a NaN (as torch's max and logsumexp give).
inline float row_max(const float* x, int64_t n) {
  float max = -INFINITY;
  bool nan = false;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vmax = _mm256_set1_ps(-INFINITY), vnan = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    vmax = _mm256_max_ps(vmax, v);
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  max = pagedllm_simd::hmax(vmax);
  nan = _mm256_movemask_ps(vnan) != 0;
#endif
  for (; j < n; ++j) {
    max = x[j] > max ? x[j] : max;
    nan = nan || x[j] != x[j];
  }
  return nan ? NAN : max;
}

}  // namespace pagedllm_sampling
