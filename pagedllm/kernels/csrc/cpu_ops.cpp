// Fused element-wise steps of a decoder layer on the CPU, in float32 and bfloat16: each replaces
// several torch operators (and their dispatch and temporaries), which at small batches cost more
// than the arithmetic.
//   fused_add_rms_norm: residual += x (optional), out = weight * residual / rms(residual)
//   rotary_neox: rotate the query and key heads of each token in place (halves layout), the
//     first rotary_dim dimensions of each head (all of them but in a partial rotary)
//   silu_and_mul: out = silu(gate) * up for rows laid out [gate | up]
//   gelu_tanh_and_mul: out = gelu_tanh(gate) * up (float32; Gemma's MLP)
// bfloat16 versions compute in float32 and round where a bfloat16 model run by transformers
// rounds (after each torch operator of its code), so their outputs are the ones it computes.

#include <cmath>
#include <cstdint>

#include <omp.h>

#include "bf16.h"
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

using namespace pagedllm_bf16;

// The value a tensor of T holds after an operation computed in float32.
inline float stored(float x, const float*) { return x; }
inline float stored(float x, const uint16_t*) { return round_bf16(x); }

template <typename T>
void fused_add_rms_norm(T* out, T* residual, const T* x, const T* weight, int num_rows, int dim, float eps,
                        int num_threads) {
  const int threads = static_cast<int64_t>(num_rows) * dim >= kParallelElements ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int row = 0; row < num_rows; ++row) {
    const T* src = x + static_cast<int64_t>(row) * dim;
    T* dst = out + static_cast<int64_t>(row) * dim;
    if (residual != nullptr) {  // the sum becomes the residual stream, and is what is normalised
      T* res = residual + static_cast<int64_t>(row) * dim;
#pragma omp simd
      for (int i = 0; i < dim; ++i) from_float(to_float(res[i]) + to_float(src[i]), res + i);
      src = res;
    }
    float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
    for (int i = 0; i < dim; ++i) sum_sq += to_float(src[i]) * to_float(src[i]);
    const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(dim) + eps);
    // transformers: weight * (x * inv_rms).to(dtype), the normalised value rounded first
#pragma omp simd
    for (int i = 0; i < dim; ++i) from_float(to_float(weight[i]) * stored(to_float(src[i]) * inv_rms, dst), dst + i);
  }
}

// qk: [num_tokens] rows of row_stride floats, starting with num_heads heads of head_dim, whose
// first rotary_dim dimensions turn (the rest pass through); cos, sin: [table rows, rotary_dim]
// (the first half is used).
template <typename T>
void rotary_neox(T* qk, int64_t row_stride, const int64_t* positions, const T* cos_cache, const T* sin_cache,
                 int num_tokens, int num_heads, int head_dim, int rotary_dim, int num_threads) {
  const int half = rotary_dim / 2;
  const int threads = static_cast<int64_t>(num_tokens) * num_heads * head_dim >= kParallelElements ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < num_tokens; ++t) {
    const T* c = cos_cache + positions[t] * rotary_dim;
    const T* s = sin_cache + positions[t] * rotary_dim;
    for (int h = 0; h < num_heads; ++h) {
      T* x1 = qk + t * row_stride + static_cast<int64_t>(h) * head_dim;
      T* x2 = x1 + half;
      // transformers: q * cos + rotate_half(q) * sin, each product rounded, then the sum
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float a = to_float(x1[i]), b = to_float(x2[i]), ci = to_float(c[i]), si = to_float(s[i]);
        from_float(stored(a * ci, x1) - stored(b * si, x1), x1 + i);
        from_float(stored(b * ci, x1) + stored(a * si, x1), x2 + i);
      }
    }
  }
}

#ifdef OPS_AVX2
// Eight floats back into T (load8 in simd.h reads them); `stored8` is the value a tensor of T holds.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), narrow8(v)); }
inline __m256 stored8(__m256 v, const float*) { return v; }
inline __m256 stored8(__m256 v, const uint16_t*) { return narrowed8(v); }
#endif

// act(gate) * up over rows laid out [gate | up]. silu(g) = g / (1 + exp(-g)); GELU's tanh form,
// 0.5 g (1 + tanh(u)) with u = sqrt(2 / pi) (g + 0.044715 g^3), is the same expression at
// 2u: g / (1 + exp(-2u)), which needs no tanh and loses nothing near 0. In bfloat16, act(gate)
// is rounded before the product (transformers' act_fn(gate) * up).
enum class Gate { kSilu, kGeluTanh };

constexpr float kGeluTwiceSqrt2OverPi = 1.5957691216057308f;  // 2 sqrt(2 / pi)

template <Gate kGate>
inline float gate_exponent(float g) {  // the z of g / (1 + exp(z))
  if constexpr (kGate == Gate::kSilu) return -g;
  return -kGeluTwiceSqrt2OverPi * (g + 0.044715f * g * g * g);
}

#ifdef OPS_AVX2
template <Gate kGate>
inline __m256 gate_exponent8(__m256 g) {
  if constexpr (kGate == Gate::kSilu) return _mm256_sub_ps(_mm256_setzero_ps(), g);
  const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 inner = _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), cube));
  return _mm256_mul_ps(_mm256_set1_ps(-kGeluTwiceSqrt2OverPi), inner);
}
#endif

template <Gate kGate, typename T>
void gated_activation(T* out, const T* x, int num_rows, int dim, int num_threads) {
  const int threads = static_cast<int64_t>(num_rows) * dim >= kParallelElements ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int row = 0; row < num_rows; ++row) {
    const T* gate = x + static_cast<int64_t>(row) * 2 * dim;
    const T* up = gate + dim;
    T* dst = out + static_cast<int64_t>(row) * dim;
    int i = 0;
#ifdef OPS_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= dim; i += 8) {
      const __m256 g = load8(gate + i);
      const __m256 act = _mm256_div_ps(g, _mm256_add_ps(one, exp8(gate_exponent8<kGate>(g))));
      store8(dst + i, _mm256_mul_ps(stored8(act, dst), load8(up + i)));
    }
#endif
    for (; i < dim; ++i) {
      const float g = to_float(gate[i]);
      from_float(stored(g / (1.0f + std::exp(gate_exponent<kGate>(g))), dst) * to_float(up[i]), dst + i);
    }
  }
}

}  // namespace

extern "C" {

// residual may be null (plain RMSNorm of x).
void fused_add_rms_norm_f32(float* out, float* residual, const float* x, const float* weight, int num_rows, int dim,
                            float eps, int num_threads) {
  fused_add_rms_norm(out, residual, x, weight, num_rows, dim, eps, num_threads);
}

void fused_add_rms_norm_bf16(uint16_t* out, uint16_t* residual, const uint16_t* x, const uint16_t* weight,
                             int num_rows, int dim, float eps, int num_threads) {
  fused_add_rms_norm(out, residual, x, weight, num_rows, dim, eps, num_threads);
}

void rotary_neox_f32(float* qk, int64_t row_stride, const int64_t* positions, const float* cos_cache,
                     const float* sin_cache, int num_tokens, int num_heads, int head_dim, int rotary_dim,
                     int num_threads) {
  rotary_neox(qk, row_stride, positions, cos_cache, sin_cache, num_tokens, num_heads, head_dim, rotary_dim,
              num_threads);
}

void rotary_neox_bf16(uint16_t* qk, int64_t row_stride, const int64_t* positions, const uint16_t* cos_cache,
                      const uint16_t* sin_cache, int num_tokens, int num_heads, int head_dim, int rotary_dim,
                      int num_threads) {
  rotary_neox(qk, row_stride, positions, cos_cache, sin_cache, num_tokens, num_heads, head_dim, rotary_dim,
              num_threads);
}

void silu_and_mul_f32(float* out, const float* x, int num_rows, int dim, int num_threads) {
  gated_activation<Gate::kSilu>(out, x, num_rows, dim, num_threads);
}

void silu_and_mul_bf16(uint16_t* out, const uint16_t* x, int num_rows, int dim, int num_threads) {
  gated_activation<Gate::kSilu>(out, x, num_rows, dim, num_threads);
}

void gelu_tanh_and_mul_f32(float* out, const float* x, int num_rows, int dim, int num_threads) {
  gated_activation<Gate::kGeluTanh>(out, x, num_rows, dim, num_threads);
}

// A decode step's inputs one token further (worker/decode_inputs.py): each of the `count` int64s
// of `advancing` (positions, context lengths, slots) plus one, and the `n` input ids from `ids`.
// (A few integers: what numpy does in one call, but a step that has just streamed the weights
// through the caches would fetch numpy's code again for it, tens of microseconds.)
void advance_decode_inputs(int64_t* advancing, int64_t count, int64_t* input_ids, const int64_t* ids, int64_t n) {
  for (int64_t i = 0; i < count; ++i) advancing[i] += 1;
  for (int64_t i = 0; i < n; ++i) input_ids[i] = ids[i];
}

}  // extern "C"
