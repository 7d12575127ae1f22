// The float products of 8 to 31 rows, for the types with one scale per 32 weights (all but Q6_K
// and the types only the AVX2 way decodes), on AMX tiles with exact operands (amx_exact.h), up to
// gguf_amx.h's kAmxMinRows, with the int8 way's block decoding (gguf_vnni_int8.h's
// int8_chunks_avx512). Self-contained; in namespace gguf. Each row of W is decoded as the int8 way decodes it (unsigned values
// u, 0..255, which bfloat16 holds exactly, and per 32 weights s and c, w = s u - c), so q = u,
// d = s, m = -c. Its error is of the FMA ways' size, where gguf_amx.h's two halves of each value
// lose 2^-18 of it. It serves kExactMinRows to kAmxMinRows - 1 rows (decode batches, verified
// tokens), where the FMA ways served them: measured on the 2-core Xeon VM, a Llama-3.2-1B layer's
// seven Q4_K projections, 2 threads, ms, this way / the FMA way: 6 rows 6.9 / 5.5, 8 rows 6.6 /
// 7.8, 9 rows 6.6 / 10.3, 10 rows 7.4 / 11.5, 16 rows 7.2 / 12.6, 32 rows 11.9 / 18.2 (the two halves' way 11.7), 128 rows 45.8 (theirs 27.8: they
// split x once per 256 rows and expand W once per 256, this way once per 64).
#pragma once

#include <cstdint>

#include "amx_exact.h"
#include "gguf_amx.h"
#include "gguf_blocks.h"
#include "gguf_int8.h"
#include "gguf_vnni_int8.h"

namespace gguf {

#if defined(GGUF_AMX) && defined(PAGEDLLM_AMX_EXACT)
#define GGUF_AMX_EXACT 1
constexpr int kExactMinRows = 8;
inline bool exact_type(int qtype) { return vnni_type(qtype) && qtype != kQ6_K; }

template <int T>
void amx_exact_matmul_type(float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                           int64_t in_features, int num_threads) {
  const TypeSize t = type_size(T);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const auto expand = [=](int n0, int nw, uint16_t* a, float* d, float* m) {
    // locals, not the closure's members: the vector stores below may alias anything, and the
    // closure's values were read again after each of them (about 8% of a product's time)
    const int64_t bytes = row_bytes, blocks = num_blocks, k = in_features, groups = in_features / 32;
    const uint8_t* const w = packed;
    float* c16 = pagedllm_amx::exact_buffer(5, k / 16 + 16);
    for (int j = 0; j < nw; ++j) {
      uint16_t* aj = a + j * k;
      float* dj = d + j * groups;
      int8_chunks_avx512<T>(w + (n0 + j) * bytes, blocks, c16, [&](int64_t kk, __m512i u, __m512 s) {
        const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(u, 0)));
        const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(u, 1)));
        _mm512_storeu_si512(aj + kk, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f1, f0)));
        dj[kk / 32] = _mm512_cvtss_f32(s);
        if (kk + 32 < k) {  // (a lone last legacy block comes paired with itself)
          const __m512 f2 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(u, 2)));
          const __m512 f3 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(u, 3)));
          _mm512_storeu_si512(aj + kk + 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f3, f2)));
          dj[kk / 32 + 1] = _mm512_cvtss_f32(_mm512_castps256_ps512(_mm512_extractf32x8_ps(s, 1)));
        }
      });
      float* mj = m + j * groups;
      for (int64_t g = 0; g < groups; ++g) mj[g] = -c16[2 * g];
    }
  };
  pagedllm_amx::exact_matmul<true>(y, x, static_cast<int>(num_rows), static_cast<int>(out_features),
                                   static_cast<int>(in_features), num_threads, expand);
}

void amx_exact_matmul(int qtype, float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                      int64_t in_features, int num_threads) {
  switch (qtype) {
    case kQ4_0: return amx_exact_matmul_type<kQ4_0>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ4_1: return amx_exact_matmul_type<kQ4_1>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ5_0: return amx_exact_matmul_type<kQ5_0>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ5_1: return amx_exact_matmul_type<kQ5_1>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ8_0: return amx_exact_matmul_type<kQ8_0>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ4_K: return amx_exact_matmul_type<kQ4_K>(y, x, packed, num_rows, out_features, in_features, num_threads);
    case kQ5_K: return amx_exact_matmul_type<kQ5_K>(y, x, packed, num_rows, out_features, in_features, num_threads);
    default: return;
  }
}
#endif

}  // namespace gguf
