// The int8 way on AVX2 (path 'avx2'): y = x W^T with x quantized per 32 (legacy types, llama.cpp's
// Q8_0) or per 256 (K-quants, its Q8_K) and W's blocks multiplied as 8-bit integers by
// VPMADDUBSW, register-blocked over rows of W and of x. gguf_matmul.cpp calls int8_avx2::matmul;
// one row of x of Q4_K, Q5_K or Q6_K goes to gguf_int8_ksuper_rows.h, and what both use is in
// gguf_int8_avx2_parts.h.
//
// The layout. A row of W is read 256 weights at a time (a chunk: a super-block, or 8 legacy
// blocks), decoded once into an L1 buffer (WChunk: unsigned values, and the scales as the kernel
// applies them), and kTileRows rows of W share every load of x. The rows of x go in groups of G =
// 8, 4, 2 or 1 (a step of 8 rows, then what is left), and a group's quantized activations are
// interleaved: each 32-byte vector holds 32 / G bytes of each of its G rows at the same weights.
// The matching 32 / G bytes of a row of W are broadcast (VPBROADCASTD/Q, VBROADCASTI128) and one
// VPMADDUBSW multiplies them with all G rows at once; its int16 pairs are summed over as many
// steps as cannot overflow (kDepth: 8 for 4-bit values, 4 for 5-bit, 2 for 6-bit; 2 x umax x 127
// a step) before one VPMADDWD applies the sub-block's scale (the K-quants, whose x shares one
// scale per 256: llama.cpp's Q8_K way) or sums pairs (legacy types, whose float16 scale per 32
// then applies in float, for G rows at once). So at G = 8 a Q4_K sub-block of 32 weights takes 8
// VPMADDUBSW and 1 VPMADDWD for 8 rows of x, and int32 lane l of every sum belongs to row l G / 8
// of the group. Q4_K and Q5_K chunks are decoded in pairs of sub-blocks (each 32 bytes: 16
// weights of sub-block 2c, then 16 of 2c + 1; x is permuted the same way), so that at G = 1 two
// steps still share one VPMADDWD by a vector of two scales. Rows of x taken alone (one row:
// decoding; or the "avx2_rows" way) go other ways: block by block for the legacy types
// (legacy_rows), super-block by super-block in natural order for Q4_K, Q5_K and Q6_K
// (lean_matmul_rows), the other K-quants decoded in registers a chunk at a time (Decoder).
//
// The constants (Q4_K/Q5_K's minimums, Q6_K's 32, Q4_0's 8, Q5_0's 16, Q4_1/Q5_1's minimums)
// multiply the sums of x's quantized values per sub-block (integer, kept with x), and come in per
// chunk: as integers where they share the main scale, else by one float FMA.
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_blocks.h"
#include "gguf_common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "gguf_int8_avx2_parts.h"
#include "gguf_int8_ksuper_rows.h"
#define GGUF_INT8_AVX2 1

namespace gguf {
namespace int8_avx2 {

constexpr int kTileRows = 4;   // rows of W sharing each load of x

// How a type's chunk is laid out and scaled:
// - kK4 (Q4_K, Q5_K): sub-blocks of 32 with 6-bit scales and minimums, decoded in pairs of sub-blocks;
// - kK16 (Q6_K, Q3_K, Q2_K): groups of 16 with their own scales, natural order;
// - kKSigned (IQ4_XS): sub-blocks of 32 with signed scales, signed values (the table's), natural order;
// - kLegacy (Q4_0 ... Q8_0, IQ4_NL): blocks of 32 with a float16 scale each.
enum Family { kK4, kK16, kKSigned, kLegacy };
template <int T>
constexpr Family family = T == kQ4_K || T == kQ5_K                ? kK4
                          : T == kQ6_K || T == kQ3_K || T == kQ2_K ? kK16
                          : T == kIQ4_XS                           ? kKSigned
                                                                   : kLegacy;
// Signed values (Q8_0's, the IQ4 table's): multiplied as |w| times x with w's sign (VPSIGNB).
template <int T>
constexpr bool kSignedValues = T == kQ8_0 || T == kIQ4_NL || T == kIQ4_XS;
// The largest value of the unsigned types.
template <int T>
constexpr int kMaxValue = T == kQ2_K ? 3 : T == kQ3_K ? 7 : T == kQ4_0 || T == kQ4_1 || T == kQ4_K ? 15 : T == kQ6_K ? 63 : 31;
// Steps of VPMADDUBSW summed in int16 before a VPMADDWD: 2 umax 127 a step, within 32767 (signed
// values: one, |w| up to 128).
template <int T>
constexpr int kDepth = kSignedValues<T> ? 1 : 32767 / (2 * 127 * kMaxValue<T>);
// Activations quantized per this many: llama.cpp's Q8_K for the super-block types, Q8_0 for the rest.
template <int T>
constexpr int kXBlock = family<T> == kLegacy ? 32 : 256;
// Weights per sum of x kept for the constants: a sub-block (32), a group of 16 (kK16).
template <int T>
constexpr int kSumUnit = family<T> == kK16 ? 16 : 32;
// The constants' term: minimums times dmin (Q4_K, Q5_K, Q2_K), or an offset in the values (Q6_K's
// 32, Q3_K's 4: w = d sc (u - offset)) that comes off the integer sums; none for IQ4_XS.
template <int T>
constexpr bool kMinsByDmin = T == kQ4_K || T == kQ5_K || T == kQ2_K;

// One row of W's chunk as the kernel reads it.
struct alignas(64) WChunk {
  uint8_t u[kChunk];   // values: unsigned (kSignedValues: signed); Q4_K/Q5_K in pairs of sub-blocks (see the top)
  int16_t sv[8][16];   // G = 1: per step (Q4_K/Q5_K: per pair of steps), the scales of its two halves
  int16_t mins[16];    // Q4_K/Q5_K: the 8 minimums, then zeros; Q2_K: its 16; Q6_K, Q3_K: the offset times the 16 scales
  int16_t sc[16];      // the scale of each sub-block (Q4_K/Q5_K, IQ4_XS: 8) or group of 16 (kK16: 16)
  float d, dmin;       // K-quants
  alignas(32) float db[8];  // legacy types: each block's scale (zero past the row)
  alignas(32) float mb[8];  // and minimum
};

// Weight byte p (0..63) of a pair of Q4_K/Q5_K sub-blocks in WChunk::u -> the weight it holds.
inline int pair_weight(int p) {
  static constexpr int kQuarter[4] = {0, 2, 1, 3};
  return kQuarter[p / 16] * 16 + p % 16;
}

inline __m256i nibbles_of_16(const uint8_t* p) {  // [low nibbles of p[0..15] | high nibbles]
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

inline __m256i bits_of_16(const uint8_t* p, int lo_bit, int hi_bit) {  // [bit lo_bit of p[0..15] | bit hi_bit], 0/1
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(both, _mm256_setr_epi32(lo_bit, lo_bit, lo_bit, lo_bit, hi_bit, hi_bit, hi_bit, hi_bit)),
                          _mm256_set1_epi8(1));
}

inline __m256i bytes_from_bits(uint32_t bits) {  // 32 bytes, 0xFF where bit j is set (ggml's bytes_from_bits_32)
  const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuffle);
  bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE));
  return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

inline __m256i iq4_values(__m256i indices) {  // each 4-bit index's value in kIq4Values (signed bytes)
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kIq4Values))), indices);
}

inline void store(void* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }

// The 32 values of the legacy block at b (Q4_0 ... Q8_0, IQ4_NL), in order: unsigned, or signed
// (kSignedValues: Q8_0's bytes, IQ4_NL's table values).
template <int T>
inline __m256i legacy_values(const uint8_t* b) {
  constexpr bool has_min = T == kQ4_1 || T == kQ5_1, five = T == kQ5_0 || T == kQ5_1;
  constexpr int qs_at = T == kQ8_0 ? 2 : (has_min ? 4 : 2) + (five ? 4 : 0), qh_at = has_min ? 4 : 2;
  if constexpr (T == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + qs_at));
  // (shifting a 128-bit copy and inserting it: VPSRLVD on a ymm is slow on first-generation Zen)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + qs_at));
  __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
  if constexpr (T == kIQ4_NL) return iq4_values(v);
  if constexpr (five) {
    uint32_t qh;
    std::memcpy(&qh, b + qh_at, 4);
    v = _mm256_or_si256(v, _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10)));
  }
  return v;
}

// Chunk c of a row of W decoded in registers as the kernel asks for it: its scales at once, its
// values 32 at a time (step(s): the values of step s of a one-row group, in WChunk::u's order).
template <int T>
struct Decoder {
  const uint8_t* p;        // the super-block, or the chunk's first legacy block
  int blocks = 8;          // legacy: the chunk's blocks in the row (values past them are zero)
  float d = 0.0f, dmin = 0.0f;
  __m256i scales;          // Q4_K/Q5_K, IQ4_XS: the 8 scales as int16, in both halves; kK16: its 16
  __m256i mins;            // as WChunk::mins
  alignas(32) float db[8], mb[8];

  Decoder(const uint8_t* row, int64_t num_blocks, int64_t c) {
    const TypeSize t = type_size(T);
    if constexpr (family<T> == kLegacy) {
      constexpr bool has_min = T == kQ4_1 || T == kQ5_1;
      p = row + c * 8 * t.bytes;
      prefetch_ahead(p, 8 * t.bytes);
      blocks = num_blocks - 8 * c < 8 ? static_cast<int>(num_blocks - 8 * c) : 8;
      // the float16 scales (and minimums) of the 8 blocks, one conversion each
      __m128i dh = _mm_setzero_si128(), mh = _mm_setzero_si128();
      if (blocks == 8) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          dh = _mm_insert_epi16(dh, load_u16(p + j * t.bytes), j);
          if (has_min) mh = _mm_insert_epi16(mh, load_u16(p + j * t.bytes + 2), j);
        }
      } else {  // the row's last, partial chunk
        alignas(16) uint16_t d16[8] = {}, m16[8] = {};
        for (int j = 0; j < blocks; ++j) {
          d16[j] = load_u16(p + j * t.bytes);
          if (has_min) m16[j] = load_u16(p + j * t.bytes + 2);
        }
        dh = _mm_load_si128(reinterpret_cast<const __m128i*>(d16));
        mh = _mm_load_si128(reinterpret_cast<const __m128i*>(m16));
      }
      _mm256_store_ps(db, _mm256_cvtph_ps(dh));
      _mm256_store_ps(mb, _mm256_cvtph_ps(mh));
      return;
    }
    p = row + c * t.bytes;
    prefetch_ahead(p, t.bytes);
    if constexpr (family<T> == kK4) {
      d = half_to_float(p);
      dmin = half_to_float(p + 2);
      const __m128i both = k4_scales_and_mins(p + 4);
      scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(both));
      mins = _mm256_cvtepu8_epi16(_mm_srli_si128(both, 8));  // then zeros
    } else if constexpr (T == kQ6_K) {
      d = half_to_float(p + 208);
      scales = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
      mins = _mm256_slli_epi16(scales, 5);  // 32 sc
    } else if constexpr (T == kQ3_K) {
      d = half_to_float(p + 108);
      // sc_g - 32: low 4 bits from bytes 96-103 (g < 8: low nibbles, else high), high 2 from
      // bytes 104-107 (byte g % 4, bits 2 (g / 4))
      const __m128i lo8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 96));
      const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(lo8, _mm_set1_epi8(0x0F)),
                                             _mm_and_si128(_mm_srli_epi16(lo8, 4), _mm_set1_epi8(0x0F)));
      int32_t h;
      std::memcpy(&h, p + 104, 4);
      const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(h), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
      const __m128i sc = _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
      scales = _mm256_cvtepi8_epi16(sc);
      mins = _mm256_slli_epi16(scales, 2);  // 4 sc
    } else if constexpr (T == kQ2_K) {
      d = half_to_float(p + 80);
      dmin = half_to_float(p + 82);
      const __m128i sm = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      scales = _mm256_cvtepu8_epi16(_mm_and_si128(sm, _mm_set1_epi8(0x0F)));
      mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), _mm_set1_epi8(0x0F)));
    } else {  // IQ4_XS
      d = half_to_float(p);
      alignas(16) int16_t ls[8];
      for (int i = 0; i < 8; ++i) ls[i] = static_cast<int16_t>(iq4xs_scale(p, i) - 32);
      scales = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(ls)));
      mins = _mm256_setzero_si256();
    }
  }

  // The 32 values of step s of a one-row group (G = 1), in WChunk::u's order.
  __m256i step(int s) const {
    if constexpr (family<T> == kK4) {  // pair s / 2 of sub-blocks, its weights 0-15 (s even) or 16-31
      const int q = s / 2, half = 16 * (s % 2);
      const __m256i v = nibbles_of_16(p + (T == kQ4_K ? 16 : 48) + 32 * q + half);
      if constexpr (T == kQ4_K) return v;
      return _mm256_or_si256(v, _mm256_slli_epi16(bits_of_16(p + 16 + half, 2 * q, 2 * q + 1), 4));
    } else if constexpr (T == kQ6_K) {  // weights 32 s to 32 s + 31
      const int h = s / 4, r = s % 4;
      const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * (r & 1)));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      const __m256i nib = r < 2 ? _mm256_and_si256(ql, low4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), low4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), _mm256_set1_epi8(3));
      return _mm256_or_si256(nib, _mm256_slli_epi16(hi, 4));
    } else if constexpr (T == kQ3_K || T == kQ2_K) {  // weights 128 n + 32 j + l: 2 bits at 2j of qs[32n + l]
      const int n = s / 4, j = s % 4;
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (T == kQ2_K ? 16 : 32) + 32 * n));
      const __m256i low = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), _mm256_set1_epi8(3));
      if constexpr (T == kQ2_K) return low;
      const __m256i hm = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));  // Q3_K's third bit: bit 4n + j
      return _mm256_or_si256(low, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * n + j), _mm256_set1_epi8(1)), 2));
    } else if constexpr (T == kIQ4_XS) {  // sub-block s: the table's values of its 16 bytes of nibbles
      return iq4_values(nibbles_of_16(p + 8 + 16 * s));
    } else {  // block s
      if (s >= blocks) return _mm256_setzero_si256();
      return legacy_values<T>(p + s * type_size(T).bytes);
    }
  }

  // The two scales of step pair q (Q4_K/Q5_K; both halves of steps 2q and 2q + 1) or of step q
  // (kK16), each over its half: [scale x 8 | scale x 8].
  __m256i pair_scales(int q) const {
    if constexpr (family<T> == kK4) return _mm256_shuffle_epi8(scales, pair_of_scales(q));
    const __m256i half = q < 4 ? _mm256_broadcastsi128_si256(_mm256_castsi256_si128(scales))
                               : _mm256_broadcastsi128_si256(_mm256_extracti128_si256(scales, 1));
    return _mm256_shuffle_epi8(half, pair_of_scales(q % 4));
  }
  // IQ4_XS: the scale of sub-block i over all lanes.
  __m256i scale(int i) const {
    const char lo = static_cast<char>(2 * i), hi = static_cast<char>(2 * i + 1);
    return _mm256_shuffle_epi8(scales, _mm256_setr_epi8(lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi,
                                                        lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi, lo, hi));
  }

  // As the kernel reads a one-row group (G = 1).
  template <int G>
  __m256i values(int t) const {
    static_assert(G == 1, "a decoder in registers serves one row of x");
    return step(t);
  }
  template <int G>
  __m256i min_values(int) const {
    static_assert(G == 1, "a decoder in registers serves one row of x");
    return mins;
  }
  float scale_d() const { return d; }
  float scale_dmin() const { return dmin; }
  float block_d(int j) const { return db[j]; }
  float block_m(int j) const { return mb[j]; }
  const float* block_ds() const { return db; }
  const float* block_ms() const { return mb; }
};

// Chunk c of a row of W into w (the L1 buffer every group of x reads).
template <int T>
inline void decode_chunk(const uint8_t* row, int64_t num_blocks, int64_t c, WChunk& w) {
  const Decoder<T> dec(row, num_blocks, c);
#pragma GCC unroll 8
  for (int s = 0; s < 8; ++s) store(w.u + 32 * s, dec.step(s));
  if constexpr (family<T> == kLegacy) {
    std::memcpy(w.db, dec.db, sizeof(w.db));
    std::memcpy(w.mb, dec.mb, sizeof(w.mb));
  } else {
    w.d = dec.d;
    w.dmin = dec.dmin;
    store(w.mins, dec.mins);
    if constexpr (family<T> == kK4) {
      _mm_store_si128(reinterpret_cast<__m128i*>(w.sc), _mm256_castsi256_si128(dec.scales));
      for (int q = 0; q < 4; ++q) store(w.sv[q], dec.pair_scales(q));
    } else if constexpr (family<T> == kK16) {
      store(w.sc, dec.scales);
      for (int s = 0; s < 8; ++s) store(w.sv[s], dec.pair_scales(s));
    } else {  // (IQ4_XS reads its 8 scales by scale(i) at any G)
      _mm_store_si128(reinterpret_cast<__m128i*>(w.sc), _mm256_castsi256_si128(dec.scales));
    }
  }
}

// x's rows in groups, as the kernel reads them (see the top). Per chunk of 256 weights:
// q: the group's interleaved steps (256 G bytes); dx: 8 lane scales (K-quants; legacy: per block,
// 8 x 8); sums: K-quants, the sums of each row's values per kSumUnit, interleaved as q is (2-byte
// elements; at least one 32-byte step); offs: legacy, per block 8 lanes holding each row's
// constant term in its first lane (Q4_0/Q5_0: -8 or -16 times the sum, int32; Q4_1/Q5_1: dx times
// the sum, float).
struct Group {
  int G;
  int64_t row0;
  int8_t* q;
  float* dx;
  int16_t* sums;
  int32_t* offs;
  float* xs;   // legacy, for one row (G = 1): per block dx times the sum of its values, 8 a chunk
  float* dxb;  // legacy, for one row: per block dx, 8 a chunk
};

template <int T>
constexpr int64_t sums_bytes(int G) {  // per chunk
  const int64_t per_row = 2 * kChunk / kSumUnit<T>;
  return per_row * G < 32 ? 32 : per_row * G;
}

template <int T>
constexpr int64_t group_bytes(int G, int64_t chunks) {
  const int64_t side = family<T> == kLegacy ? 2 * 8 * 8 * 4 + 2 * 8 * 4 : 8 * 4 + sums_bytes<T>(G);
  return chunks * (kChunk * G + side);
}

// The rows [row0, row0 + G) of x into group g's buffers; qrow, drow: scratch for one row.
template <int T>
void fill_group(const Group& g, const float* x, int64_t in_features, int64_t chunks, int8_t* qrow, float* drow) {
  constexpr int B = kXBlock<T>, U = kSumUnit<T>;
  const int64_t kc = chunks * kChunk;
  const int S = 32 / g.G;  // bytes of a row per step
  for (int i = 0; i < g.G; ++i) {
    quantize_row(x + (g.row0 + i) * in_features, in_features, kc, B, qrow, drow);
    for (int64_t c = 0; c < chunks; ++c) {
      const int8_t* qc = qrow + c * kChunk;
      int8_t* dst = g.q + c * kChunk * g.G + i * S;
      // the values, in W's order (Q4_K/Q5_K: pairs of sub-blocks), S bytes a step
      for (int p = 0; p < kChunk; p += 16) {
        const int src = family<T> == kK4 ? (p / 64) * 64 + pair_weight(p % 64) : p;
        for (int b = 0; b < 16; b += S < 16 ? S : 16) {
          const int pos = p + b;
          std::memcpy(dst + (pos / S) * 32 + pos % S, qc + src + b, S < 16 ? S : 16);
        }
      }
      // the lane scales
      if constexpr (family<T> != kLegacy) {
        for (int l = i * 8 / g.G; l < (i + 1) * 8 / g.G; ++l) g.dx[c * 8 + l] = drow[c];
      } else {
        for (int j = 0; j < 8; ++j)
          for (int l = i * 8 / g.G; l < (i + 1) * 8 / g.G; ++l) g.dx[(c * 8 + j) * 8 + l] = drow[c * 8 + j];
      }
      // the sums per unit, interleaved (K-quants) or in each row's first lane (legacy)
      int16_t sums[kChunk / 16];
      for (int u = 0; u < kChunk / U; ++u) {
        int s = 0;
        for (int k = 0; k < U; ++k) s += qc[u * U + k];
        sums[u] = static_cast<int16_t>(s);
      }
      if constexpr (family<T> != kLegacy) {
        constexpr int per_row = 2 * kChunk / U;  // bytes
        uint8_t* sd = reinterpret_cast<uint8_t*>(g.sums) + c * sums_bytes<T>(g.G);
        const uint8_t* ss = reinterpret_cast<const uint8_t*>(sums);
        if (per_row * g.G < 32 && i == 0) std::memset(sd, 0, 32);
        const int step = per_row * g.G < 32 ? 32 : S;  // one row, less than a step: its sums then zeros
        for (int pos = 0; pos < per_row; pos += step)
          std::memcpy(sd + (pos / step) * 32 + (step == 32 ? 0 : i * S), ss + pos, step < per_row ? step : per_row);
      } else {
        constexpr bool has_min = T == kQ4_1 || T == kQ5_1;
        constexpr int offset = T == kQ5_0 ? 16 : T == kQ4_0 ? 8 : 0;
        for (int j = 0; j < 8; ++j) {
          g.xs[c * 8 + j] = drow[c * 8 + j] * static_cast<float>(sums[j]);
          g.dxb[c * 8 + j] = drow[c * 8 + j];
          int32_t* o = g.offs + (c * 8 + j) * 8;
          if (i == 0) std::memset(o, 0, 32);
          if constexpr (has_min) {
            const float v = drow[c * 8 + j] * static_cast<float>(sums[j]);
            std::memcpy(o + i * 8 / g.G, &v, 4);
          } else {
            o[i * 8 / g.G] = -offset * sums[j];
          }
        }
      }
    }
  }
}

template <int G>
inline __m256i bcast(const uint8_t* p) {  // 32 / G bytes at p, repeated
  if constexpr (G == 8) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  } else if constexpr (G == 4) {
    long long v;
    std::memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
  } else if constexpr (G == 2) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  }
}

// A row of W's chunk in the L1 buffer (decode_chunk), read by groups of any G.
struct Buffered {
  const WChunk* w;
  template <int G>
  __m256i values(int t) const { return bcast<G>(w->u + t * (32 / G)); }
  template <int G>
  __m256i min_values(int s) const { return bcast<G>(reinterpret_cast<const uint8_t*>(w->mins) + s * (32 / G)); }
  __m256i pair_scales(int q) const { return load(w->sv[q]); }
  __m256i scale(int i) const { return _mm256_set1_epi16(w->sc[i]); }
  float scale_d() const { return w->d; }
  float scale_dmin() const { return w->dmin; }
  float block_d(int j) const { return w->db[j]; }
  float block_m(int j) const { return w->mb[j]; }
  const float* block_ds() const { return w->db; }
  const float* block_ms() const { return w->mb; }
};

// acc[n] += the products of step t (its x vector xv) with row n of W.
template <int T, int G, int NR, class Row>
inline void step_products(__m256i (&acc)[NR], const Row* w, int t, __m256i xv) {
#pragma GCC unroll 4
  for (int n = 0; n < NR; ++n) {
    const __m256i wv = w[n].template values<G>(t);
    if constexpr (kSignedValues<T>)  // |w| times x with w's sign
      acc[n] = _mm256_add_epi16(acc[n], _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv)));
    else
      acc[n] = _mm256_add_epi16(acc[n], _mm256_maddubs_epi16(wv, xv));
    // keep the sum a chain: GCC otherwise reassociates it into a tree whose many products are
    // live at once and spill (measured: a third of the G = 8 kernel's instructions were spills)
    __asm__("" : "+x"(acc[n]));
  }
}

// The steps [t0, t0 + count) of a unit of one scale, summed into isum[n] by scale(n).
template <int T, int G, int NR, class Row, class Scale>
inline void unit_products(__m256i (&isum)[NR], const Row* w, const int8_t* xq, int t0, int count, Scale&& scale) {
  constexpr int L = kDepth<T>;
  __m256i acc[NR];
  for (int s0 = 0; s0 < count; s0 += L) {
    for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_si256();
    for (int s = s0; s < s0 + L && s < count; ++s) step_products<T, G, NR, Row>(acc, w, t0 + s, load(xq + (t0 + s) * 32));
    for (int n = 0; n < NR; ++n) isum[n] = _mm256_add_epi32(isum[n], _mm256_madd_epi16(acc[n], scale(n)));
  }
}

// facc[n] (8 float lanes) += chunk c of group g times rows w[0..NR) of W.
template <int T, int G, int NR, class Row>
inline void chunk_product(float* facc, const Row* w, const Group& g, int64_t c) {
  constexpr int S = 32 / G;  // bytes of a row of x (and of W) per step
  const int8_t* xq = g.q + c * kChunk * G;
  // (the float accumulators stay in facc until the integer sums are done: registers are few)
  if constexpr (family<T> == kLegacy && G == 1) {
    // one row: the 8 blocks' integer sums gathered into one vector (lane j: block j) by a tree of
    // VPHADDD, then one conversion and one FMA by the 8 blocks' d dx; the constants (Q4_0's -8 d,
    // Q5_0's -16 d, Q4_1/Q5_1's minimum) by one FMA against dx times each block's sum of x
    constexpr float offset = T == kQ4_0 ? -8.0f : T == kQ5_0 ? -16.0f : 0.0f;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 dx8 = _mm256_load_ps(g.dxb + c * 8), xs8 = _mm256_load_ps(g.xs + c * 8);
    for (int n = 0; n < NR; ++n) {
      __m256i b[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __m256i isum[1] = {_mm256_setzero_si256()};
        unit_products<T, G, 1, Row>(isum, w + n, xq, j, 1, [&](int) { return ones; });
        b[j] = isum[0];
      }
      const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(b[0], b[1]), _mm256_hadd_epi32(b[2], b[3]));
      const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(b[4], b[5]), _mm256_hadd_epi32(b[6], b[7]));
      const __m256i sums8 = _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
      const __m256 d8 = _mm256_load_ps(w[n].block_ds());
      __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums8), _mm256_mul_ps(d8, dx8), _mm256_load_ps(facc + 8 * n));
      if constexpr (T == kQ4_1 || T == kQ5_1)
        f = _mm256_fmadd_ps(_mm256_load_ps(w[n].block_ms()), xs8, f);
      else if constexpr (offset != 0.0f)
        f = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(offset)), xs8, f);
      _mm256_store_ps(facc + 8 * n, f);
    }
  } else if constexpr (family<T> == kLegacy) {
    constexpr bool has_min = T == kQ4_1 || T == kQ5_1, has_offset = T == kQ4_0 || T == kQ5_0;
    const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {  // block j: steps [G j, G j + G)
      __m256i isum[NR];
      const __m256i off = has_offset ? load(g.offs + (c * 8 + j) * 8) : _mm256_setzero_si256();
      for (int n = 0; n < NR; ++n) isum[n] = off;
      unit_products<T, G, NR, Row>(isum, w, xq, G * j, G, [&](int) { return ones; });
      const __m256 dx = _mm256_load_ps(g.dx + (c * 8 + j) * 8);
      for (int n = 0; n < NR; ++n) {
        __m256 f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[n]), _mm256_mul_ps(_mm256_set1_ps(w[n].block_d(j)), dx),
                                   _mm256_load_ps(facc + 8 * n));
        if constexpr (has_min)
          f = _mm256_fmadd_ps(_mm256_set1_ps(w[n].block_m(j)), _mm256_castsi256_ps(load(g.offs + (c * 8 + j) * 8)), f);
        _mm256_store_ps(facc + 8 * n, f);
      }
    }
  } else {
    __m256i isum[NR];
    for (int n = 0; n < NR; ++n) isum[n] = _mm256_setzero_si256();
    if constexpr (family<T> == kK4) {
      if constexpr (G == 1) {
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) unit_products<T, G, NR, Row>(isum, w, xq, 2 * q, 2, [&](int n) { return w[n].pair_scales(q); });
      } else {
        constexpr int half = 16 / S;  // steps per 16 weights
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {  // sub-block i: its two halves in pair q = i / 2, at 16 e and 16 e + 32 of it
          const int q = i / 2, e = i % 2;
          const auto scale = [&](int n) { return w[n].scale(i); };
          if constexpr (kDepth<T> >= 2 * half) {  // both halves in one int16 sum: a unit of non-adjacent steps
            __m256i acc[NR];
            for (int n = 0; n < NR; ++n) acc[n] = _mm256_setzero_si256();
            for (int s = 0; s < half; ++s) {
              const int ta = (64 * q + 16 * e) / S + s, tb = (64 * q + 32 + 16 * e) / S + s;
              step_products<T, G, NR, Row>(acc, w, ta, load(xq + ta * 32));
              step_products<T, G, NR, Row>(acc, w, tb, load(xq + tb * 32));
            }
            for (int n = 0; n < NR; ++n) isum[n] = _mm256_add_epi32(isum[n], _mm256_madd_epi16(acc[n], scale(n)));
          } else {
            unit_products<T, G, NR, Row>(isum, w, xq, (64 * q + 16 * e) / S, half, scale);
            unit_products<T, G, NR, Row>(isum, w, xq, (64 * q + 32 + 16 * e) / S, half, scale);
          }
        }
      }
    } else if constexpr (family<T> == kKSigned) {  // IQ4_XS: sub-blocks of 32, natural order
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i)
        unit_products<T, G, NR, Row>(isum, w, xq, 32 * i / S, 32 / S, [&](int n) { return w[n].scale(i); });
    } else {  // kK16: groups of 16 weights, natural order
      if constexpr (G == 1) {
#pragma GCC unroll 8
        for (int s = 0; s < 8; ++s) unit_products<T, G, NR, Row>(isum, w, xq, s, 1, [&](int n) { return w[n].pair_scales(s); });
      } else {
        constexpr int half = 16 / S;
#pragma GCC unroll 16
        for (int grp = 0; grp < 16; ++grp)
          unit_products<T, G, NR, Row>(isum, w, xq, grp * half, half, [&](int n) { return w[n].scale(grp); });
      }
    }
    // the constants: sums of x per unit times W's minimums (by dmin) or its offset times its scales (by d)
    const uint8_t* sums = reinterpret_cast<const uint8_t*>(g.sums) + c * sums_bytes<T>(G);
    constexpr int steps = family<T> == kKSigned ? 0 : sums_bytes<T>(G) / 32;
    __m256i m[NR];
    for (int n = 0; n < NR; ++n) m[n] = _mm256_setzero_si256();
    for (int s = 0; s < steps; ++s) {
      const __m256i xs = load(sums + 32 * s);
      for (int n = 0; n < NR; ++n)
        m[n] = _mm256_add_epi32(m[n], _mm256_madd_epi16(xs, w[n].template min_values<G>(s)));
    }
    const __m256 dx = _mm256_load_ps(g.dx + c * 8);
    for (int n = 0; n < NR; ++n) {
      __m256 f = _mm256_load_ps(facc + 8 * n);
      if constexpr (!kMinsByDmin<T>) {
        f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(isum[n], m[n])), _mm256_mul_ps(_mm256_set1_ps(w[n].scale_d()), dx), f);
      } else {
        f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[n]), _mm256_mul_ps(_mm256_set1_ps(w[n].scale_d()), dx), f);
        f = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m[n]), _mm256_mul_ps(_mm256_set1_ps(w[n].scale_dmin()), dx), f);
      }
      _mm256_store_ps(facc + 8 * n, f);
    }
  }
}

// Legacy types, rows of x alone (G = 1): one row of W times R of them, block by block, with no
// chunks: each block is decoded in registers once for the R rows, its integer sums (VPMADDUBSW,
// VPMADDWD) converted and scaled by d dx in float at once, its float16 d and m converted by one
// VCVTPH2PS, the constant term (Q4_1/Q5_1's minimum, Q4_0/Q5_0's offset) one FMA against dx
// times the block's sum of x. Against the chunked way (8 blocks' sums gathered by a VPHADDD tree)
// it leaves out the zero-padded blocks of a row's last chunk (a third of the work at 576 inputs,
// the default model's width) and the gathering of 8 scales per chunk. Measured on the 2-core
// AVX2 EPYC, the default model's decode step at one sequence: its Q4_1 projections 7.3-7.9 ms
// (12.0 the chunked way; 7.3-7.4 on kernels/quant.py's kernel over an unpacked copy, which this
// one replaced), its Q8_0 head 2.1-2.3 ms (2.2-2.4). The rows of W go to the threads in static
// shares, each walked in order with a software prefetch: four interleaved streams
// (for_rows_streamed) measured 8.3-8.5 ms there.
template <int T, int R>
inline void legacy_rows(float* out, const uint8_t* row, int64_t num_blocks, const Group* gs) {
  constexpr bool has_min = T == kQ4_1 || T == kQ5_1;
  constexpr float offset = T == kQ4_0 ? -8.0f : T == kQ5_0 ? -16.0f : 0.0f;
  const int bytes = type_size(T).bytes;
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr bool has_constant = has_min || offset != 0.0f;
  __m256 acc[R];
  __m128 constant[R];  // lane 0: the sum of d dx sum(qx) (the offset's), lane 1: of m dx sum(qx)
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    constant[r] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* blk = row + b * bytes;
    const __m256i w = legacy_values<T>(blk);
    const __m256i wu = kSignedValues<T> ? _mm256_abs_epi8(w) : w;
    // d and (Q4_1/Q5_1) m converted at once: [d, m, 0, 0]
    uint32_t dm_bits;
    std::memcpy(&dm_bits, blk, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(has_min ? dm_bits : dm_bits & 0xFFFF)));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m256i x = load(gs[r].q + b * 32);
      if constexpr (kSignedValues<T>) x = _mm256_sign_epi8(x, w);
      const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(wu, x), ones);
      const __m256 ddx = _mm256_broadcastss_ps(_mm_mul_ss(dm, _mm_load_ss(gs[r].dxb + b)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), ddx, acc[r]);
      if constexpr (has_constant) constant[r] = _mm_fmadd_ps(dm, _mm_broadcast_ss(gs[r].xs + b), constant[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    float y = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    if constexpr (has_min) y += _mm_cvtss_f32(_mm_movehdup_ps(constant[r]));
    else if constexpr (offset != 0.0f) y += offset * _mm_cvtss_f32(constant[r]);
    out[r] = y;
  }
}

template <int T, int NR>
inline void group_chunk(float* facc, const Buffered* w, const Group& g, int64_t c) {
  switch (g.G) {
    case 8: return chunk_product<T, 8, NR, Buffered>(facc, w, g, c);
    case 4: return chunk_product<T, 4, NR, Buffered>(facc, w, g, c);
    case 2: return chunk_product<T, 2, NR, Buffered>(facc, w, g, c);
    default: return chunk_product<T, 1, NR, Buffered>(facc, w, g, c);
  }
}

// Rows [n0, n0 + NR) of W times every group of x, into y.
template <int T, int NR>
inline void tile_product(float* y, const uint8_t* packed, int64_t row_bytes, int64_t num_blocks, int64_t chunks, int64_t n0,
                         int64_t out_features, const Group* groups, int num_groups, WChunk* w, float* facc) {
  std::memset(facc, 0, sizeof(float) * 8 * kTileRows * num_groups);
  for (int64_t c = 0; c < chunks; ++c) {
    Buffered rows[NR];
    for (int n = 0; n < NR; ++n) {
      decode_chunk<T>(packed + (n0 + n) * row_bytes, num_blocks, c, w[n]);
      rows[n].w = w + n;
    }
    for (int gi = 0; gi < num_groups; ++gi) group_chunk<T, NR>(facc + 8 * kTileRows * gi, rows, groups[gi], c);
  }
  for (int gi = 0; gi < num_groups; ++gi) {
    const Group& g = groups[gi];
    const int lanes = 8 / g.G;
    for (int n = 0; n < NR; ++n) {
      const float* f = facc + 8 * (kTileRows * gi + n);
      for (int i = 0; i < g.G; ++i) {
        float s = 0.0f;
        for (int l = 0; l < lanes; ++l) s += f[i * lanes + l];
        y[(g.row0 + i) * out_features + n0 + n] = s;
      }
    }
  }
}

// `rows_alone`: every row of x its own group (G = 1), each row of W decoded in registers once a
// chunk and taken by every row of x, instead of the interleaved groups and their L1 buffer: a way
// for few rows where decoding into the buffer costs more than it saves (a measurement chooses:
// kernels/gguf.py's set_int8_way, "avx2_rows").
template <int T>
void matmul_type(float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                 int64_t in_features, int num_threads, bool rows_alone) {
  if constexpr (T == kQ4_K || T == kQ5_K || T == kQ6_K) {
    if (num_rows == 1 || rows_alone) return lean_matmul_rows<T>(y, x, packed, num_rows, out_features, in_features, num_threads);
  }
  const TypeSize t = type_size(T);
  const int64_t num_blocks = in_features / t.weights, row_bytes = num_blocks * t.bytes;
  const int64_t chunks = (in_features + kChunk - 1) / kChunk, kc = chunks * kChunk;
  // rows of x in groups of 8, then 4, 2, 1
  Group groups[64];  // (64 rows alone: one group each)
  int num_groups = 0;
  int64_t bytes = 0;
  const int64_t max_rows = 64;  // rows of x per pass (their groups' buffers stay in L2)
  for (int64_t r0 = 0; r0 < num_rows; r0 += max_rows) {
    const int64_t rows = num_rows - r0 < max_rows ? num_rows - r0 : max_rows;
    num_groups = 0;
    bytes = 0;
    for (int64_t r = 0; r < rows;) {
      const int G = rows_alone ? 1 : rows - r >= 8 ? 8 : rows - r >= 4 ? 4 : rows - r >= 2 ? 2 : 1;
      groups[num_groups++] = Group{G, r0 + r, nullptr, nullptr, nullptr, nullptr};
      bytes += group_bytes<T>(G, chunks);
      r += G;
    }
    uint8_t* base = static_cast<uint8_t*>(thread_buffer(6, bytes + kc + 4 * (kc / 32) + 64));
    int8_t* qrow = reinterpret_cast<int8_t*>(base + bytes);
    float* drow = reinterpret_cast<float*>(base + bytes + kc);
    uint8_t* at = base;
    for (int gi = 0; gi < num_groups; ++gi) {
      Group& g = groups[gi];
      g.q = reinterpret_cast<int8_t*>(at);
      at += chunks * kChunk * g.G;
      g.dx = reinterpret_cast<float*>(at);
      at += chunks * (family<T> == kLegacy ? 8 * 8 * 4 : 8 * 4);
      if constexpr (family<T> == kLegacy) {
        g.offs = reinterpret_cast<int32_t*>(at);
        at += chunks * 8 * 8 * 4;
        g.xs = reinterpret_cast<float*>(at);
        at += chunks * 8 * 4;
        g.dxb = reinterpret_cast<float*>(at);
        at += chunks * 8 * 4;
      } else {
        g.sums = reinterpret_cast<int16_t*>(at);
        at += chunks * sums_bytes<T>(g.G);
      }
      fill_group<T>(g, x, in_features, chunks, qrow, drow);
    }
    if constexpr (family<T> == kLegacy) {
      if (groups[0].G == 1) {  // one row of x, or rows alone: block by block (legacy_rows)
        const Group* gs = groups;
        const int ng = num_groups;
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t n = 0; n < out_features; ++n) {
          const uint8_t* row = packed + n * row_bytes;
          prefetch_ahead(row, static_cast<int>(row_bytes));
          in_fours(ng, [&](auto R, int64_t g0) {
            constexpr int rs = decltype(R)::value;
            float out[rs];
            legacy_rows<T, rs>(out, row, num_blocks, gs + g0);
            for (int r = 0; r < rs; ++r) y[gs[g0 + r].row0 * out_features + n] = out[r];
          });
        }
        continue;
      }
    }
    if (groups[0].G == 1) {  // one row of x, or rows alone: each row of W decoded in registers
      const Group* gs = groups;
      const int ng = num_groups;
#pragma omp parallel num_threads(num_threads)
      {
        float* facc = static_cast<float*>(thread_buffer(1, sizeof(float) * 8 * ng));
        for_rows_streamed(out_features, [&](int64_t n) {
          std::memset(facc, 0, sizeof(float) * 8 * ng);
          for (int64_t c = 0; c < chunks; ++c) {
            const Decoder<T> dec(packed + n * row_bytes, num_blocks, c);
            for (int gi = 0; gi < ng; ++gi) chunk_product<T, 1, 1, Decoder<T>>(facc + 8 * gi, &dec, gs[gi], c);
          }
          for (int gi = 0; gi < ng; ++gi) {
            const __m256 f = _mm256_load_ps(facc + 8 * gi);
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            y[gs[gi].row0 * out_features + n] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
          }
        });
      }
      continue;
    }
    const int64_t tiles = (out_features + kTileRows - 1) / kTileRows;
    const Group* gs = groups;
    const int ng = num_groups;
#pragma omp parallel num_threads(num_threads)
    {
      WChunk* w = static_cast<WChunk*>(thread_buffer(0, sizeof(WChunk) * kTileRows));
      float* facc = static_cast<float*>(thread_buffer(1, sizeof(float) * 8 * kTileRows * ng));
      const int teams = omp_get_num_threads(), me = omp_get_thread_num();
      for (int64_t tile = tiles * me / teams; tile < tiles * (me + 1) / teams; ++tile) {
        const int64_t n0 = tile * kTileRows;
        switch (out_features - n0 < kTileRows ? out_features - n0 : kTileRows) {
          case 1: tile_product<T, 1>(y, packed, row_bytes, num_blocks, chunks, n0, out_features, gs, ng, w, facc); break;
          case 2: tile_product<T, 2>(y, packed, row_bytes, num_blocks, chunks, n0, out_features, gs, ng, w, facc); break;
          case 3: tile_product<T, 3>(y, packed, row_bytes, num_blocks, chunks, n0, out_features, gs, ng, w, facc); break;
          default: tile_product<T, 4>(y, packed, row_bytes, num_blocks, chunks, n0, out_features, gs, ng, w, facc); break;
        }
      }
    }
  }
}

// The machine's int8 peak on this way's instruction: 8 independent chains of VPMADDUBSW into int16
// sums (the most a kernel can issue; the VPMADDWD that widens the sums comes on top). Returns the
// multiply-adds done: 8 x 32 per iteration.
__attribute__((noinline)) inline int64_t peak_loop(int64_t iterations) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m256i u0 = _mm256_set1_epi8(1), u1 = _mm256_set1_epi8(2), x0 = _mm256_set1_epi8(3), x1 = _mm256_set1_epi8(-4);
  for (int64_t i = 0; i < iterations; ++i) {
    __asm__ volatile("" : "+x"(u0), "+x"(u1), "+x"(x0), "+x"(x1));  // fresh operands: nothing is hoisted
    a0 = _mm256_add_epi16(a0, _mm256_maddubs_epi16(u0, x0));
    a1 = _mm256_add_epi16(a1, _mm256_maddubs_epi16(u0, x1));
    a2 = _mm256_add_epi16(a2, _mm256_maddubs_epi16(u1, x0));
    a3 = _mm256_add_epi16(a3, _mm256_maddubs_epi16(u1, x1));
    a4 = _mm256_add_epi16(a4, _mm256_maddubs_epi16(x0, u0));
    a5 = _mm256_add_epi16(a5, _mm256_maddubs_epi16(x1, u0));
    a6 = _mm256_add_epi16(a6, _mm256_maddubs_epi16(x0, u1));
    a7 = _mm256_add_epi16(a7, _mm256_maddubs_epi16(x1, u1));
  }
  const __m256i all = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(a0, a1), _mm256_add_epi16(a2, a3)),
                                       _mm256_add_epi16(_mm256_add_epi16(a4, a5), _mm256_add_epi16(a6, a7)));
  __asm__ volatile("" : : "x"(all));
  return iterations * 8 * 32;
}

// y [num_rows, out_features] = x [num_rows, in_features] W^T, x quantized as described above.
inline void matmul(int qtype, float* y, const float* x, const uint8_t* packed, int64_t num_rows, int64_t out_features,
                   int64_t in_features, int num_threads, bool rows_alone = false) {
  switch (qtype) {
    case kQ4_0: return matmul_type<kQ4_0>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kQ4_1: return matmul_type<kQ4_1>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kQ5_0: return matmul_type<kQ5_0>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kQ5_1: return matmul_type<kQ5_1>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kQ8_0: return matmul_type<kQ8_0>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kQ4_K: return matmul_type<kQ4_K>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kQ5_K: return matmul_type<kQ5_K>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kQ6_K: return matmul_type<kQ6_K>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kQ2_K: return matmul_type<kQ2_K>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kQ3_K: return matmul_type<kQ3_K>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kIQ4_NL: return matmul_type<kIQ4_NL>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    case kIQ4_XS: return matmul_type<kIQ4_XS>(y, x, packed, num_rows, out_features, in_features, num_threads, rows_alone);
    default: return;
  }
}

}  // namespace int8_avx2
}  // namespace gguf
#endif
