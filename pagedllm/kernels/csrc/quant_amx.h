// The Q4_1 and Q8_0 products on AMX tiles with exact operands and float32 sums (amx_exact.h), for
// csrc/quant_matmul.cpp: included inside its namespace, after the AVX-512 way (QUANT_AVX512). A
// weight is q d + m (Q4_1: q 0..15; Q8_0: q -128..127, m = 0), which amx_exact.h multiplies as it
// is: the expander here turns each step's rows of W into q as bfloat16 (a 16-entry table, Q4_1, or
// a conversion, Q8_0) and copies their scales and minimums.

#if defined(QUANT_AVX512) && defined(PAGEDLLM_AMX_EXACT)
#define QUANT_AMX 1
using pagedllm_amx::amx_permitted;

// From this many rows of x on, products take this way. Measured on the 2-core Xeon VM (AMX), a
// decode step's products of the default model's shapes (121 of them), ms, AVX-512 way / this:
// 1 row 5.1 / 13.1, 8 rows 12.7 / 13.8, 10 rows 14.9 / 13.3, 12 rows 16.7 / 14.0, 16 rows
// 21.5 / 14.6, 17 rows 23.3 / 20.8, 32 rows 41.9 / 22.4, 64 rows 82.8 / 39.3, and against
// the tiled way: 128 rows 187 / 84, 512 rows 778 / 348. Below it, the weights' expansion and
// the per-block scaling (about 10 vector operations per 32 weights and 16 rows of x, whatever
// the rows) cost more than the AVX-512 way's FMAs.
constexpr int kAmxMinRows = 10;
constexpr int kAmxPrefetch = 2048;  // bytes of W ahead of its expansion that are prefetched

// 1: products take this way; at first use, where Linux grants the tiles and the environment
// variable PAGEDLLM_QUANT_AMX is not "0" (benchmarks: the same run without the tiles);
// quant_matmul_set_amx changes it.
int g_amx = -1;
inline bool amx_on() {
  if (g_amx < 0) {
    const char* env = std::getenv("PAGEDLLM_QUANT_AMX");
    g_amx = amx_permitted() && !(env != nullptr && std::strcmp(env, "0") == 0) ? 1 : 0;
  }
  return g_amx == 1;
}

// Block kt of row n of W as 32 bfloat16 (its q) at a.
template <bool kSigned, bool kMin>
inline void amx_expand_block(uint16_t* a, const uint8_t* row, int kt, __m512i q4_table) {
  if (kMin) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + kt * 16));
    const __m128i low = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_set_m128i(high, low));  // values 0-15, then 16-31
    _mm512_store_si512(a, _mm512_permutexvar_epi16(q, q4_table));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + kt * kBlock));
    const __m512 f0 = kSigned ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)))
                              : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(v)));
    const __m512 f1 = kSigned ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)))
                              : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1)));
    _mm512_store_si512(a, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(f1, f0)));
  }
}

template <bool kSigned, bool kMin>
void amx_matmul(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins, int num_rows,
                int out_features, int in_features, int num_threads) {
  const int kt_count = in_features / kBlock;
  const int64_t stride = row_bytes<kMin>(in_features);
  constexpr int kBlockBytes = kMin ? kBlock / 2 : kBlock;
  const __m512i q4_table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
      _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31),
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)));
  // The step's rows of W expanded one after the other: a stream the prefetchers follow
  // (expanding each block of 32 rows in turn, 32 streams of 16 bytes, took 3x the time).
  const auto expand = [=](int n0, int nw, uint16_t* a, float* d, float* m) {
    // locals, not the closure's members: the vector stores below may alias anything, and the
    // closure's values were read again after each of them (about 8% of a product's time)
    const __m512i table = q4_table;
    const int blocks = kt_count, k = in_features;
    const uint8_t* const v = values + n0 * stride;
    const int64_t row_stride = stride;
    for (int j = 0; j < nw; ++j) {
      const uint8_t* row = v + j * row_stride;
      uint16_t* aj = a + j * k;
      for (int kt = 0; kt < blocks; ++kt) {
        if (kt % (64 / kBlockBytes) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + kt * kBlockBytes + kAmxPrefetch), _MM_HINT_T0);
        amx_expand_block<kSigned, kMin>(aj + kt * kBlock, row, kt, table);
      }
    }
    std::memcpy(d, scales + static_cast<int64_t>(n0) * blocks, sizeof(float) * nw * blocks);
    if (kMin) std::memcpy(m, mins + static_cast<int64_t>(n0) * blocks, sizeof(float) * nw * blocks);
  };
  pagedllm_amx::exact_matmul<kMin>(y, x, num_rows, out_features, in_features, num_threads, expand);
}
#endif
