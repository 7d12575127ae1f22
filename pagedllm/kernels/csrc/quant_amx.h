// The Q4_1 and Q8_0 products on AMX (Intel's tile unit, AMX-BF16), for csrc/quant_matmul.cpp:
// included inside its namespace, after the AVX-512 way (QUANT_AVX512).
//
// Exact operands, float32 sums. A weight is q d + m (Q4_1: q 0..15; Q8_0: q -128..127, m = 0),
// d and m per block of 32, and a bfloat16 holds every such q exactly. So block b of a product is
//   sum_k x[k] w[k] = d_b sum_k x[k] q[k] + m_b sum_k x[k],
// and x[k] is carried exactly as three bfloat16 (x = hi + mid + lo: each the nearest bfloat16 of
// what the ones before left; 8 significant bits each, float32's 24 in all). Every product x q is
// then exact in float32, and one TDPBF16PS per part sums a block's 32 of them for 16 rows of W
// and 16 rows of x in float32, as the FMA ways do: the result is a float32 product like theirs,
// its sums in another order. Each C element is its own dot product: a row of x gets the same
// bits whatever other rows share the call, as in the AVX-512 way.
//
// Per step of 32 rows of W: each block of 32 weights (one tile's k) is expanded to bfloat16 (its
// values looked up in a 16-entry table, Q4_1, or converted, Q8_0) into two A tiles; for each
// 16 rows of x, three tile products (one per part of x) into two C tiles, which are stored and
// scaled by d_b (and m_b times x's block sums added) into float32 accumulators in L1. The
// tile unit does the multiplying; the vector unit expands the weights and applies the scales:
// about 10 vector operations per 32 weights and 16 rows of x, against 64 FMAs on the AVX-512
// way. x is laid out once per call as the unit reads B (VNNI pairs: per block and 16 rows of x,
// a tile of 16 pairs of k by 16 rows); rows of W are split across threads, each of which
// configures its tiles (amx_tiles.h).

#if defined(QUANT_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QUANT_AMX 1
using pagedllm_amx::amx_permitted;
using pagedllm_amx::TileScope;

constexpr int kAmxW = 32;        // rows of W per step (two A tiles)
constexpr int kAmxChunk = 16;    // rows of x per B tile
constexpr int kAmxParts = 3;     // bfloat16 parts carrying a float32 exactly
constexpr int kAmxPassRows = 64; // rows of x per pass over W (its accumulators stay in L1)
constexpr int kAmxTile = 256;    // uint32 in a tile of 16 rows of 64 bytes
// From this many rows of x on, products take this way. Measured on the 2-core Xeon VM (AMX), a
// decode step's products of the default model's shapes (121 of them), ms, AVX-512 way / this:
// 1 row 5.1 / 13.1, 8 rows 12.7 / 13.8, 10 rows 14.9 / 13.3, 12 rows 16.7 / 14.0, 16 rows
// 21.5 / 14.6, 17 rows 23.3 / 20.8, 32 rows 41.9 / 22.4, 64 rows 82.8 / 39.3, and against
// the tiled way: 128 rows 187 / 84, 512 rows 778 / 348. Below it, the weights' expansion and
// the per-block scaling (about 10 vector operations per 32 weights and 16 rows of x, whatever
// the rows) cost more than the AVX-512 way's FMAs.
constexpr int kAmxMinRows = 10;
constexpr int kAmxPrefetch = 2048;  // bytes of W ahead of its expansion that are prefetched  // products of up to this many rows of x take this way

int g_amx = -1;  // 1: products take this way (amx_permitted() at first use); quant_matmul_set_amx
inline bool amx_on() {
  if (g_amx < 0) g_amx = amx_permitted() ? 1 : 0;
  return g_amx == 1;
}

// 16 floats -> their three bfloat16 parts (v = parts[0] + parts[1] + parts[2], normal floats).
inline void split_exact(__m512 v, __m256i parts[kAmxParts]) {
  for (int p = 0; p < kAmxParts; ++p) {
    parts[p] = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    v = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(parts[p]), 16)));
  }
}

// x [rows, in_features] in B's layout: the tile of (block kt, chunk c, part p) at
// ((kt * chunks + c) * kAmxParts + p) * kAmxTile uint32, element [kk][m] the pair of bfloat16
// parts of x[16 c + m][32 kt + 2 kk .. + 1]; rows past `rows` zero. sums[(kt * chunks + c) * 16 + m]:
// x's block sums (kMin). Run by every thread of a team (its share of the blocks).
template <bool kMin>
inline void amx_layout_x(const float* x, int rows, int in_features, int chunks, uint32_t* xb, float* sums) {
  const int kt_count = in_features / kBlock;
  const __m512i pair_rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32(16));
  // split by blocks of k, each its own tiles: split by rows of x, the threads' stores met in
  // every line of a tile (16 rows of x side by side) and a 1-row product took 5x the time
#pragma omp for schedule(static)
  for (int kt = 0; kt < kt_count; ++kt) {
    for (int m = 0; m < chunks * kAmxChunk; ++m) {
      const int c = m / kAmxChunk, ml = m % kAmxChunk;
      uint32_t* tile = xb + static_cast<int64_t>(kt * chunks + c) * kAmxParts * kAmxTile + ml;
      if (m >= rows) {
        for (int p = 0; p < kAmxParts; ++p)
          for (int kk = 0; kk < 16; ++kk) tile[p * kAmxTile + 16 * kk] = 0;
        if (kMin) sums[(kt * chunks + c) * kAmxChunk + ml] = 0.0f;
        continue;
      }
      const float* xk = x + static_cast<int64_t>(m) * in_features + kt * kBlock;
      const __m512 x0 = _mm512_loadu_ps(xk), x1 = _mm512_loadu_ps(xk + 16);
      __m256i p0[kAmxParts], p1[kAmxParts];
      split_exact(x0, p0);
      split_exact(x1, p1);
      for (int p = 0; p < kAmxParts; ++p) {
        // 32 bfloat16 in k's order are 16 pairs (2 kk, 2 kk + 1): pair kk goes to the tile's row kk
        const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(p0[p]), p1[p], 1);
        _mm512_i32scatter_epi32(tile + p * kAmxTile, pair_rows, pairs, 4);
      }
      if (kMin) sums[(kt * chunks + c) * kAmxChunk + ml] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    }
  }
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

// One pass: up to kAmxPassRows rows of x.
template <bool kSigned, bool kMin>
void amx_pass(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins, int rows,
              int out_features, int in_features, int num_threads) {
  const int kt_count = in_features / kBlock, chunks = (rows + kAmxChunk - 1) / kAmxChunk;
  const int64_t stride = row_bytes<kMin>(in_features);
  constexpr int kBlockBytes = kMin ? kBlock / 2 : kBlock;
  uint32_t* xb = reinterpret_cast<uint32_t*>(thread_buffer(2, static_cast<int64_t>(kt_count) * chunks * kAmxParts * kAmxTile));
  float* sums = thread_buffer(3, static_cast<int64_t>(kt_count) * chunks * kAmxChunk);
  const int w_steps = (out_features + kAmxW - 1) / kAmxW;
  const __m512i q4_table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
      _mm512_setr_ps(16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31),
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)));
#pragma omp parallel num_threads(num_threads)
  {
    amx_layout_x<kMin>(x, rows, in_features, chunks, xb, sums);  // (ends in the team's barrier)
    uint16_t* a = reinterpret_cast<uint16_t*>(thread_buffer(4, static_cast<int64_t>(kAmxW) * in_features / 2));
    float* acc = thread_buffer(5, chunks * kAmxW * kAmxChunk);
    alignas(64) float c[2 * kAmxTile];
    const TileScope tiles;  // 0-1: C (16 rows of W x 16 of x), 4-5: A (16 rows of W x 32 k), 6-7: B
#pragma omp for schedule(static)
    for (int step = 0; step < w_steps; ++step) {
      const int n0 = step * kAmxW, nw = out_features - n0 < kAmxW ? out_features - n0 : kAmxW;
      const uint8_t* v = values + n0 * stride;
      const float* d = scales + static_cast<int64_t>(n0) * kt_count;
      const float* mn = kMin ? mins + static_cast<int64_t>(n0) * kt_count : nullptr;
      std::memset(acc, 0, sizeof(float) * chunks * kAmxW * kAmxChunk);
      // the step's rows of W expanded first, one after the other: a stream the prefetchers follow
      // (expanding each block of 32 rows in turn, 32 streams of 16 bytes, took 3x the time)
      if (nw < kAmxW) std::memset(a + nw * in_features, 0, sizeof(uint16_t) * (kAmxW - nw) * in_features);
      for (int j = 0; j < nw; ++j) {
        const uint8_t* row = v + j * stride;
        for (int kt = 0; kt < kt_count; ++kt) {
          if (kt % (64 / kBlockBytes) == 0) _mm_prefetch(reinterpret_cast<const char*>(row + kt * kBlockBytes + kAmxPrefetch), _MM_HINT_T0);
          amx_expand_block<kSigned, kMin>(a + j * in_features + kt * kBlock, row, kt, q4_table);
        }
      }
      for (int kt = 0; kt < kt_count; ++kt) {
        _tile_loadd(4, a + kt * kBlock, 2 * in_features);
        _tile_loadd(5, a + 16 * in_features + kt * kBlock, 2 * in_features);
        for (int ch = 0; ch < chunks; ++ch) {
          const uint32_t* b = xb + static_cast<int64_t>(kt * chunks + ch) * kAmxParts * kAmxTile;
          _tile_zero(0);
          _tile_zero(1);
          _tile_loadd(6, b, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          _tile_loadd(7, b + kAmxTile, 64);
          _tile_dpbf16ps(0, 4, 7);
          _tile_dpbf16ps(1, 5, 7);
          _tile_loadd(6, b + 2 * kAmxTile, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 5, 6);
          _tile_stored(0, c, 64);
          _tile_stored(1, c + kAmxTile, 64);
          float* accs = acc + ch * kAmxW * kAmxChunk;
          const __m512 s = kMin ? _mm512_loadu_ps(sums + (kt * chunks + ch) * kAmxChunk) : _mm512_setzero_ps();
          for (int j = 0; j < nw; ++j) {
            __m512 t = _mm512_fmadd_ps(_mm512_load_ps(c + j * kAmxChunk), _mm512_set1_ps(d[j * kt_count + kt]),
                                       _mm512_load_ps(accs + j * kAmxChunk));
            if (kMin) t = _mm512_fmadd_ps(s, _mm512_set1_ps(mn[j * kt_count + kt]), t);
            _mm512_store_ps(accs + j * kAmxChunk, t);
          }
        }
      }
      for (int m = 0; m < rows; ++m) {
        const float* am = acc + (m / kAmxChunk) * kAmxW * kAmxChunk + m % kAmxChunk;
        float* ym = y + static_cast<int64_t>(m) * out_features + n0;
        for (int j = 0; j < nw; ++j) ym[j] = am[j * kAmxChunk];
      }
    }
  }
}

template <bool kSigned, bool kMin>
void amx_matmul(float* y, const float* x, const uint8_t* values, const float* scales, const float* mins, int num_rows,
                int out_features, int in_features, int num_threads) {
  for (int r0 = 0; r0 < num_rows; r0 += kAmxPassRows) {
    const int rows = num_rows - r0 < kAmxPassRows ? num_rows - r0 : kAmxPassRows;
    amx_pass<kSigned, kMin>(y + static_cast<int64_t>(r0) * out_features, x + static_cast<int64_t>(r0) * in_features,
                            values, scales, mins, rows, out_features, in_features, num_threads);
  }
}
#endif
