// GGUF block layouts (ggml's block_q4_0 ... block_q6_K) and their exact dequantization, the
// reference of every kernel in gguf_matmul.cpp: the same float32 operations in the same order as
// gguf-py's `gguf.quants.dequantize` (so `gguf_dequantize_rows` equals it bit for bit).
//
// Blocks of 32 weights (legacy types; f16 d, f16 m where there is a minimum):
//   Q4_0 d qs[16]              w_j = d (q_j - 8)       q_j: low nibble of qs[j], j + 16 the high one
//   Q4_1 d m qs[16]            w_j = d q_j + m
//   Q5_0 d qh[4] qs[16]        w_j = d (q_j - 16)      q_j's bit 4: bit j of the uint32 qh
//   Q5_1 d m qh[4] qs[16]      w_j = d q_j + m
//   Q8_0 d qs[32]              w_j = q_j d             q_j: int8
// Super-blocks of 256 weights in 8 sub-blocks of 32 (Q4_K, Q5_K) or 16 of 16 (Q6_K):
//   Q4_K d dmin scales[12] qs[128]          w = (d sc_i) q - (dmin m_i), 6-bit sc_i, m_i packed in
//        scales; sub-blocks 2c, 2c + 1: the low and high nibbles of qs[32c .. 32c + 31]
//   Q5_K d dmin scales[12] qh[32] qs[128]   as Q4_K, q's bit 4: bit i of qh[l] in sub-block i
//   Q6_K ql[128] qh[64] scales[16] d        w = (d sc_g) (q - 32), int8 sc_g per 16; per half h of
//        128 weights, sub-block 4h + s of 32: the low (s = 0, 1) or high (s = 2, 3) nibbles of
//        ql[64h + 32 (s & 1) + l], bits 4-5 from qh[32h + l] >> 2s
//   Q2_K scales[16] qs[64] d dmin           w = (d sc_g) q - (dmin m_g) per 16, sc_g and m_g the low and
//        high nibbles of scales[g]; weight 128 n + 32 j + l (l < 32): q = (qs[32n + l] >> 2j) & 3
//   Q3_K hmask[32] qs[64] scales[12] d      w = (d (sc_g - 32)) q per 16, 6-bit sc_g: low 4 bits from
//        scales[g % 8] >> 4 (g / 8), high 2 from scales[8 + g % 4] >> 2 (g / 4); weight 128 n + 32 j
//        + l: q = ((qs[32n + l] >> 2j) & 3) - 4 unless bit 4n + j of hmask[l] is set (-4..3)
// Non-linear 4-bit types (the imatrix quants): a value is a 4-bit index into kIq4Values.
//   IQ4_NL d qs[16] (32 weights)           w_j = d v(q_j), q_j: low nibble of qs[j], j + 16 the high one
//   IQ4_XS d scales_h scales_l[4] qs[128]   per 32 (i): w = (d (ls_i - 32)) v(q), 6-bit ls_i: low 4 bits
//        from scales_l[i / 2] >> 4 (i % 2), high 2 from the uint16 scales_h >> 2i; sub-block i's
//        nibbles in qs[16 i .. 16 i + 15] as IQ4_NL's
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace gguf {

// The C ABI's type ids are ggml's (GGMLQuantizationType).
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kIQ4_NL = 20, kIQ4_XS = 23
};

// The values of IQ4_NL's and IQ4_XS's 4-bit indices (ggml's kvalues_iq4nl).
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

struct TypeSize {
  int weights;  // per block
  int bytes;    // per block
};

inline TypeSize type_size(int qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    case kQ2_K: return {256, 84};
    case kQ3_K: return {256, 110};
    case kIQ4_NL: return {32, 18};
    case kIQ4_XS: return {256, 136};
    default: return {0, 0};
  }
}

// IEEE half to float, exact (F16C's VCVTPH2PS where the CPU has it).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: mantissa 2^-24, exact in float
      float v = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
      std::memcpy(&bits, &v, 4);
      bits |= sign;
    }
  } else if (exponent == 31) {
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The 6-bit value of weight k (0..255) of a Q6_K block, 0..63.
inline int q6k_value(const uint8_t* b, int k) {
  const int h = k / 128, s = (k % 128) / 32, l = k % 32;
  const uint8_t byte = b[64 * h + 32 * (s & 1) + l];
  const int nibble = s < 2 ? byte & 0xF : byte >> 4;
  return nibble | (((b[128 + 32 * h + l] >> (2 * s)) & 3) << 4);
}

// The 5-bit value of weight k (0..255) of a Q5_K block, 0..31.
inline int q5k_value(const uint8_t* b, int k) {
  const int i = k / 32, l = k % 32;
  const uint8_t byte = b[48 + 32 * (i / 2) + l];
  const int nibble = i & 1 ? byte >> 4 : byte & 0xF;
  return nibble | (((b[16 + l] >> i) & 1) << 4);
}

// Q3_K's 6-bit scale of group g (0..15), before its -32.
inline int q3k_scale(const uint8_t* b, int g) {
  const uint8_t* sc = b + 96;
  return ((sc[g % 8] >> (4 * (g / 8))) & 0xF) | (((sc[8 + g % 4] >> (2 * (g / 4))) & 3) << 4);
}

// Q2_K's value of weight k (0..255), 0..3, and Q3_K's plus 4, 0..7 (its signed value is this - 4).
inline int q2k_value(const uint8_t* qs, int k) { return (qs[32 * (k / 128) + k % 32] >> (2 * ((k % 128) / 32))) & 3; }
inline int q3k_value(const uint8_t* b, int k) {
  const int high = (b[k % 32] >> (4 * (k / 128) + (k % 128) / 32)) & 1;
  return q2k_value(b + 32, k) | (high << 2);
}

// IQ4_XS's 6-bit scale of sub-block i (0..7), before its -32.
inline int iq4xs_scale(const uint8_t* b, int i) {
  uint16_t h;
  std::memcpy(&h, b + 2, 2);
  return ((b[4 + i / 2] >> (4 * (i % 2))) & 0xF) | (((h >> (2 * i)) & 3) << 4);
}

// The 4- or 5-bit value of weight j (0..31) of a legacy block whose nibbles start at qs (and whose
// uint32 of high bits is qh, for Q5_0 and Q5_1).
inline int legacy_value(const uint8_t* qs, uint32_t qh, bool five_bits, int j) {
  const int nibble = j < 16 ? qs[j] & 0xF : qs[j - 16] >> 4;
  return five_bits ? nibble | static_cast<int>(((qh >> j) & 1) << 4) : nibble;
}

// The float32 weights of one block, exactly as gguf-py computes them: no fused multiply-adds
// (-ffast-math would contract d q + m, which rounds once instead of twice).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
inline void dequantize_block(int qtype, const uint8_t* b, float* y) {
  switch (qtype) {
    case kQ4_0: {
      const float d = half_to_float(b);
      for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(legacy_value(b + 2, 0, false, j) - 8);
      break;
    }
    case kQ4_1: {
      const float d = half_to_float(b), m = half_to_float(b + 2);
      for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(legacy_value(b + 4, 0, false, j)) + m;
      break;
    }
    case kQ5_0: {
      const float d = half_to_float(b);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(legacy_value(b + 6, qh, true, j) - 16);
      break;
    }
    case kQ5_1: {
      const float d = half_to_float(b), m = half_to_float(b + 2);
      uint32_t qh;
      std::memcpy(&qh, b + 4, 4);
      for (int j = 0; j < 32; ++j) y[j] = d * static_cast<float>(legacy_value(b + 8, qh, true, j)) + m;
      break;
    }
    case kQ8_0: {
      const float d = half_to_float(b);
      for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      for (int i = 0; i < 8; ++i) {
        int sc, m;
        scale_min_k4(i, b + 4, &sc, &m);
        const float di = d * static_cast<float>(sc), mi = dmin * static_cast<float>(m);
        for (int l = 0; l < 32; ++l) {
          const int k = 32 * i + l;
          const int q = qtype == kQ4_K ? (i & 1 ? b[16 + 32 * (i / 2) + l] >> 4 : b[16 + 32 * (i / 2) + l] & 0xF)
                                       : q5k_value(b, k);
          y[k] = di * static_cast<float>(q) - mi;
        }
      }
      break;
    }
    case kQ6_K: {
      const float d = half_to_float(b + 208);
      for (int g = 0; g < 16; ++g) {
        const float dg = d * static_cast<float>(static_cast<int8_t>(b[192 + g]));
        for (int l = 0; l < 16; ++l) y[16 * g + l] = dg * static_cast<float>(q6k_value(b, 16 * g + l) - 32);
      }
      break;
    }
    case kQ2_K: {
      const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
      for (int g = 0; g < 16; ++g) {
        const float dl = d * static_cast<float>(b[g] & 0xF), ml = dmin * static_cast<float>(b[g] >> 4);
        for (int l = 0; l < 16; ++l) y[16 * g + l] = dl * static_cast<float>(q2k_value(b + 16, 16 * g + l)) - ml;
      }
      break;
    }
    case kQ3_K: {
      const float d = half_to_float(b + 108);
      for (int g = 0; g < 16; ++g) {
        const float dl = d * static_cast<float>(q3k_scale(b, g) - 32);
        for (int l = 0; l < 16; ++l) y[16 * g + l] = dl * static_cast<float>(q3k_value(b, 16 * g + l) - 4);
      }
      break;
    }
    case kIQ4_NL: {
      const float d = half_to_float(b);
      for (int j = 0; j < 16; ++j) {
        y[j] = d * static_cast<float>(kIq4Values[b[2 + j] & 0xF]);
        y[j + 16] = d * static_cast<float>(kIq4Values[b[2 + j] >> 4]);
      }
      break;
    }
    case kIQ4_XS: {
      const float d = half_to_float(b);
      for (int i = 0; i < 8; ++i) {
        const float dl = d * static_cast<float>(iq4xs_scale(b, i) - 32);
        for (int j = 0; j < 16; ++j) {
          y[32 * i + j] = dl * static_cast<float>(kIq4Values[b[8 + 16 * i + j] & 0xF]);
          y[32 * i + j + 16] = dl * static_cast<float>(kIq4Values[b[8 + 16 * i + j] >> 4]);
        }
      }
      break;
    }
    default: break;
  }
}
#pragma GCC pop_options

// Types whose int8 values (int8_values) are signed: Q8_0's bytes, the non-linear types' table values.
inline bool signed_values(int qtype) { return qtype == kQ8_0 || qtype == kIQ4_NL || qtype == kIQ4_XS; }

// For the int8 path: per group of 16 weights of a block, a scale s and a constant c such that
// w = s u - c over the group, u being the weight's value as int8_values gives it:
//   sum_k w_k x_k = s sum_k u_k x_k - c sum_k x_k.
// s, c: weights / 16 floats.
inline void int8_scales(int qtype, const uint8_t* b, float* s, float* c) {
  switch (qtype) {
    case kQ4_0:
    case kQ4_1:
    case kQ5_0:
    case kQ5_1: {
      const bool has_min = qtype == kQ4_1 || qtype == kQ5_1, five = qtype == kQ5_0 || qtype == kQ5_1;
      const float d = half_to_float(b);
      s[0] = s[1] = d;
      c[0] = c[1] = has_min ? -half_to_float(b + 2) : (five ? 16.0f : 8.0f) * d;
      break;
    }
    case kQ8_0:
      s[0] = s[1] = half_to_float(b);
      c[0] = c[1] = 0.0f;
      break;
    case kQ4_K:
    case kQ5_K: {
      const float d = half_to_float(b), dmin = half_to_float(b + 2);
      for (int i = 0; i < 8; ++i) {
        int sc, m;
        scale_min_k4(i, b + 4, &sc, &m);
        s[2 * i] = s[2 * i + 1] = d * static_cast<float>(sc);
        c[2 * i] = c[2 * i + 1] = dmin * static_cast<float>(m);
      }
      break;
    }
    case kQ6_K: {
      const float d = half_to_float(b + 208);
      for (int g = 0; g < 16; ++g) {
        s[g] = d * static_cast<float>(static_cast<int8_t>(b[192 + g]));
        c[g] = 32.0f * s[g];
      }
      break;
    }
    case kQ2_K: {
      const float d = half_to_float(b + 80), dmin = half_to_float(b + 82);
      for (int g = 0; g < 16; ++g) {
        s[g] = d * static_cast<float>(b[g] & 0xF);
        c[g] = dmin * static_cast<float>(b[g] >> 4);
      }
      break;
    }
    case kQ3_K: {
      const float d = half_to_float(b + 108);
      for (int g = 0; g < 16; ++g) {
        s[g] = d * static_cast<float>(q3k_scale(b, g) - 32);
        c[g] = 4.0f * s[g];
      }
      break;
    }
    case kIQ4_NL:
      s[0] = s[1] = half_to_float(b);
      c[0] = c[1] = 0.0f;
      break;
    case kIQ4_XS: {
      const float d = half_to_float(b);
      for (int i = 0; i < 8; ++i) {
        s[2 * i] = s[2 * i + 1] = d * static_cast<float>(iq4xs_scale(b, i) - 32);
        c[2 * i] = c[2 * i + 1] = 0.0f;
      }
      break;
    }
    default: break;
  }
}

// The unsigned values of a block's weights (signed_values types: their int8 values), one byte each.
inline void int8_values(int qtype, const uint8_t* b, uint8_t* u) {
  switch (qtype) {
    case kQ4_0:
    case kQ4_1:
    case kQ5_0:
    case kQ5_1: {
      const bool has_min = qtype == kQ4_1 || qtype == kQ5_1, five = qtype == kQ5_0 || qtype == kQ5_1;
      uint32_t qh = 0;
      if (five) std::memcpy(&qh, b + (has_min ? 4 : 2), 4);
      const uint8_t* qs = b + (has_min ? 4 : 2) + (five ? 4 : 0);
      for (int j = 0; j < 32; ++j) u[j] = static_cast<uint8_t>(legacy_value(qs, qh, five, j));
      break;
    }
    case kQ8_0: std::memcpy(u, b + 2, 32); break;
    case kQ4_K:
      for (int k = 0; k < 256; ++k) {
        const uint8_t byte = b[16 + 32 * (k / 64) + k % 32];
        u[k] = (k / 32) & 1 ? byte >> 4 : byte & 0xF;
      }
      break;
    case kQ5_K:
      for (int k = 0; k < 256; ++k) u[k] = static_cast<uint8_t>(q5k_value(b, k));
      break;
    case kQ6_K:
      for (int k = 0; k < 256; ++k) u[k] = static_cast<uint8_t>(q6k_value(b, k));
      break;
    case kQ2_K:
      for (int k = 0; k < 256; ++k) u[k] = static_cast<uint8_t>(q2k_value(b + 16, k));
      break;
    case kQ3_K:
      for (int k = 0; k < 256; ++k) u[k] = static_cast<uint8_t>(q3k_value(b, k));
      break;
    case kIQ4_NL:
      for (int j = 0; j < 16; ++j) {
        u[j] = static_cast<uint8_t>(kIq4Values[b[2 + j] & 0xF]);
        u[j + 16] = static_cast<uint8_t>(kIq4Values[b[2 + j] >> 4]);
      }
      break;
    case kIQ4_XS:
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < 16; ++j) {
          u[32 * i + j] = static_cast<uint8_t>(kIq4Values[b[8 + 16 * i + j] & 0xF]);
          u[32 * i + j + 16] = static_cast<uint8_t>(kIq4Values[b[8 + 16 * i + j] >> 4]);
        }
      break;
    default: break;
  }
}

}  // namespace gguf
