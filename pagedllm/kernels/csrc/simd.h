// Small AVX2 helpers shared by the kernels: horizontal sums and maxima, a vector exp, bfloat16
// conversions.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

namespace pagedllm_simd {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// The vector operations of `exp_lanes`, 8 lanes wide (AVX2) and 16 (AVX-512).
struct Lanes8 {
  using F = __m256;
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F min(F a, F b) { return _mm256_min_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F round(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n for whole n held as floats
  static F pow2(F n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
};
#if defined(__AVX512F__)
struct Lanes16 {
  using F = __m512;
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F min(F a, F b) { return _mm512_min_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F round(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static F pow2(F n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
};
#endif

// exp of each lane (Cephes' single-precision polynomial, relative error ~1e-7): x = n ln2 + r,
// exp(x) = 2^n exp(r). Inputs below -87 (exp underflows) give ~1e-38, not 0. One body for every
// width: each lane's result is the same at 8 lanes and at 16, so a row's sums over 16 lanes are
// bitwise those of two 8-lane accumulators.
template <class L>
inline typename L::F exp_lanes(typename L::F x) {
  x = L::max(L::min(x, L::set1(88.0f)), L::set1(-87.0f));
  const typename L::F n = L::round(L::mul(x, L::set1(1.44269504088896341f)));
  typename L::F r = L::fnmadd(n, L::set1(0.693359375f), x);
  r = L::fnmadd(n, L::set1(-2.12194440e-4f), r);
  typename L::F poly = L::set1(1.9875691500e-4f);
  poly = L::fmadd(poly, r, L::set1(1.3981999507e-3f));
  poly = L::fmadd(poly, r, L::set1(8.3334519073e-3f));
  poly = L::fmadd(poly, r, L::set1(4.1665795894e-2f));
  poly = L::fmadd(poly, r, L::set1(1.6666665459e-1f));
  poly = L::fmadd(poly, r, L::set1(5.0000001201e-1f));
  poly = L::fmadd(poly, L::mul(r, r), r);
  poly = L::add(poly, L::set1(1.0f));
  return L::mul(poly, L::pow2(n));
}

inline __m256 exp8(__m256 x) { return exp_lanes<Lanes8>(x); }
#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) { return exp_lanes<Lanes16>(x); }
#endif

// Eight bfloat16 values (uint16_t) as floats.
inline __m256 widen8(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// Eight floats, or eight bfloat16 values widened to floats.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return widen8(p); }

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// v rounded to bfloat16 (to nearest even): eight uint16_t, in one instruction (vcvtneps2bf16).
inline __m128i narrow8(__m256 v) { return reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(v)); }

// v rounded to bfloat16, still as floats.
inline __m256 narrowed8(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(narrow8(v)), 16));
}
#else
// v rounded to bfloat16 (to nearest even), still as floats.
inline __m256 narrowed8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// v rounded to bfloat16: eight uint16_t.
inline __m128i narrow8(__m256 v) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(narrowed8(v)), 16);
  const __m256i packed = _mm256_packus_epi32(high, _mm256_setzero_si256());  // per 128-bit lane
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

}  // namespace pagedllm_simd
#endif
