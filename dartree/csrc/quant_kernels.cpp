// Products on block-quantised weights as GGUF stores them (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), with integer dot
// products: exact and row-invariant, like the lean forward's float kernels (lean_kernels.cpp).
//
// y[r, n] = sum over blocks b of  d_w[n, b] * d_x[r, b] * isum[r, n, b]  (+ m_w[n, b] * s_x[r, b] with a minimum)
//
// where each activation row is quantised per block of 32 to int8 the llama.cpp way (Q8_0: d_x = max|x| / 127,
// q = round-to-nearest-even(x * (1 / d_x)); s_x = d_x * sum(q), what llama.cpp's Q8_1 keeps), and isum is the
// block's integer dot product of the weight's quants with the row's quants, exact in int32. Every float
// operation is a correctly rounded one in one fixed order per (row, output): for b = 0..K/32-1 in order,
//   acc = fma(d_w * d_x, float(isum), acc)                      Q8_0, Q4_0
//   acc = fma(d_w * d_x, float(isum), acc); acc = fma(m_w, s_x, acc)          Q4_1, Q5_1 (and Q4_K, Q5_K)
//   acc = fma(d_w0 * d_x, float(isum0), acc); acc = fma(d_w1 * d_x, float(isum1), acc)   Q6_K (a scale a 16)
// and the residual, when given, is added after the whole sum (res + acc). The instruction-set paths
// (AVX-512 VNNI, AVX2, scalar) differ only in how the exact integer sums are formed, so they give the same
// bits, and nothing a row computes depends on the other rows of the call: the same bits whatever the row
// count. A row with a NaN gives NaN (a non-finite block makes its outputs NaN); other rows are unaffected.
//
// Packed layout (the same on every path), per group of 16 output rows and per block of 32 inputs, one
// record: quants, then 16 scales, then 16 minimums (Q4_1, Q5_1) or second scales (Q6_K).
//   quants: 4-byte units [t][j][i], unit t of output row j holding its inputs 4t..4t+3:
//     Q8_0, Q6_K, Q5_1: 8 units a row, the value + 128 as uint8 (Q5_1's values 0..31);
//     Q4_0, Q4_1: 4 units a row, bytes with the low nibble input 4t+i and the high nibble input 16+4t+i
//       (GGUF's own bytes qs[4t..4t+3] for Q4_0 and Q4_1).
//   scales: Q8_0, Q4_0, Q4_1 keep GGUF's own fp16 scales (and minimums), 2 bytes each: a one-row product
//     streams its weights from memory, and fp32 scales made a Q4_1 record 6 bits a weight instead of 5 (the
//     conversion to float32 is exact, so the products' bits are the same either way).
// The K-quants keep their own records: Q4_K its nibbles, Q5_K (values 0..31) and Q6_K (int8 q - 32) a byte a value,
// then each row's super-block d (and dmin) as fp16 and the 32-block's 6-bit scale and minimum (Q6_K: its two int8
// scales, one a 16) a byte each (``k_floats``); the kernels form d * sc and -(dmin * m), exact in float32 (not in
// fp16), so the products are those of float32 scales. Measured (scripts/quant_products_ab.py, AMD EPYC Zen 3, AVX2,
// 2 threads, a 1B model's shapes) against float32 scales in the records: one row 1.10-1.27x (Q4_K), 1.03-1.05x
// (Q5_K), 1.11-1.23x (Q6_K) faster, 4-64 rows the same within noise.
// Rows past N (the last group's padding) have zero scales; their outputs are never written.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// DARTREE_SCALAR (a compile-time macro) keeps every product on the scalar code, for the tests
#if !defined(DARTREE_SCALAR)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define DQ_VNNI 1
#elif defined(__AVX2__)
#define DQ_AVX2 1
#endif
#endif
#if defined(DQ_VNNI) || defined(DQ_AVX2)
#include <immintrin.h>
#endif

namespace {

constexpr int QK = 32;    // inputs per block
constexpr int QKK = 256;  // inputs per K-quant super-block
constexpr int G = 16;     // output rows per group

// GGML's type ids (gguf.GGMLQuantizationType); Q4_0, Q4_1, Q5_1, Q8_0 and Q6_K are also the record types
constexpr int64_t Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14;

constexpr bool wide(int64_t t) { return t == Q8_0 || t == Q6_K || t == Q5_1 || t == Q5_K; }  // a byte a value
constexpr bool has_min(int64_t t) { return t == Q4_1 || t == Q5_1 || t == Q4_K || t == Q5_K; }  // scale * q + minimum
constexpr bool two_floats(int64_t t) { return has_min(t) || t == Q6_K; }  // a second float a row: minimum or scale
// the K-quants' records: each row's super-block floats as fp16 (d, and dmin) beside the block's integer scale (and
// minimum), multiplied in the kernels (exact in float32: 11 bits times 6 or 8)
constexpr bool k_scaled(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
constexpr int64_t quant_bytes(int64_t t) { return wide(t) ? G * QK : G * QK / 2; }
// a record of type t: its quants, then fp16 floats (the scales, and the minimums or second scales); the K-quants':
// d (and dmin) fp16, the integer scales (and minimums) a byte each; Q6_K's 16 bytes of padding keep its size apart
// from Q5_1's (a packed weight's record type is read from its record size)
constexpr int64_t record_bytes(int64_t t) {
  if (k_scaled(t)) return quant_bytes(t) + (t == Q6_K ? G * 2 + 2 * G + 16 : 2 * G * 2 + 2 * G);
  return quant_bytes(t) + G * 2 * (two_floats(t) ? 2 : 1);
}
// where a record's second floats start (after the quants and the scales; not the K-quants': ``k_floats``)
constexpr int64_t second_at(int64_t t) { return quant_bytes(t) + G * 2; }
// Q5_0 (d * (q - 16), q of 5 bits: llama.cpp's Q4_K_M writes it for rows whose width is no multiple of 256) is held
// in Q8_0's records, its values as bytes beside its own fp16 scale: the same values, 8.5 bits a weight instead of 5.5.
// Q5_1 (d * q + m, q of 5 bits; Q5_K_M's fallback for such rows) is held as bytes with its fp16 scale and minimum:
// 9 bits a weight instead of 6, the values exactly
constexpr int64_t record_type(int64_t t) { return t == Q5_0 ? Q8_0 : t; }
// GGUF's bytes per block (of 32, or of 256 for the K-quants) and values per block
constexpr int64_t raw_bytes(int64_t t) {
  return t == Q8_0 ? 34 : t == Q4_0 ? 18 : t == Q4_1 ? 20 : t == Q5_0 ? 22 : t == Q5_1 ? 24 : t == Q4_K ? 144
         : t == Q5_K ? 176 : 210;
}
constexpr int64_t raw_values(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K ? QKK : QK; }

// the record type of a packed weight, from its record size (every type's size differs)
int64_t type_of_record(int64_t bytes) {
  for (int64_t t : {Q4_0, Q4_1, Q8_0, Q5_1, Q4_K, Q5_K, Q6_K})
    if (record_bytes(t) == bytes) return t;
  TORCH_CHECK(false, "quant: not a packed weight (record of ", bytes, " bytes)");
  return -1;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// float j (0..15) of a record's fp16 float array at p (exactly widened)
inline float float_at(const uint8_t* p, int j) { return half_to_float(p + 2 * j); }

// the quant byte of value v (0..31) of output row j in a record of byte-a-value quants, and the byte
// holding value v % 16 (low nibble: v < 16) in a record of nibbles
inline int64_t wide_at(int v, int j) { return ((v / 4) * G + j) * 4 + v % 4; }
inline int64_t nibble_at(int v, int j) { return (((v % 16) / 4) * G + j) * 4 + v % 4; }

// a K-quant record's two floats of row j (its floats start at f): the scale d * sc and the minimum -(dmin * m)
// (Q4_K, Q5_K: d, dmin fp16 [16] each, then sc, m uint8 [16] each), or the scales d * sc0 and d * sc1 of inputs
// 0..15 and 16..31 (Q6_K: d fp16 [16], then sc0, sc1 int8 [16] each). Every product is exact in float32.
template <int64_t T>
inline void k_floats(const uint8_t* f, int j, float* a, float* b) {
  const float d = half_to_float(f + 2 * j);
  if constexpr (T == Q6_K) {
    *a = d * (float)(int8_t)f[2 * G + j];
    *b = d * (float)(int8_t)f[3 * G + j];
  } else {
    *a = d * (float)f[4 * G + j];
    *b = -(half_to_float(f + 2 * G + 2 * j) * (float)f[5 * G + j]);
  }
}

// ---------------------------------------------------------------- activations
// One block of 32 of one row, quantised: q (32 int8 as 8 dwords), d, ds = d * float(sum of q), and what the
// unsigned-by-signed integer products need added (the weight's offset times the row's sums: Q8_0 and Q6_K
// and Q5_1 -128, Q4_0 -8, Q4_1 0; Q6_K's for each half). qproduct lays them out block-major, [K/32][M], so that
// the R rows of a tile sit at constant offsets from one pointer.
struct alignas(16) ActBlock {
  int32_t q[8];
  float d;
  float ds;
  int32_t corr;   // for the whole block, or for inputs 0..15 (Q6_K)
  int32_t corr1;  // for inputs 16..31 (Q6_K)
};
static_assert(sizeof(ActBlock) == 48, "ActBlock is 48 bytes");

// llama.cpp's Q8_0 for one block: d = max|x| / 127, q = round-to-nearest-even(x * (1 / d)), |q| <= 127; a block
// holding a NaN or an infinity gets d = NaN and q = 0 (its row's outputs become NaN). Returns sum(q). Every
// step is exact or correctly rounded (max, abs, one division, one multiplication, rounding to an integer),
// so the vector paths give the scalar code's bits.
inline int32_t quantize_block(const float* xb, int8_t* q, float* d) {
#if defined(DQ_VNNI)
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const __m512 zero = _mm512_setzero_ps();
  // finite: x - x == 0 (NaN and infinities give NaN)
  const bool finite = (_mm512_cmp_ps_mask(_mm512_sub_ps(x0, x0), zero, _CMP_EQ_OQ) &
                       _mm512_cmp_ps_mask(_mm512_sub_ps(x1, x1), zero, _CMP_EQ_OQ)) == 0xFFFF;
  if (finite) {
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float db = amax / 127.0f;
    const __m512 id = _mm512_set1_ps(db != 0.0f ? 1.0f / db : 0.0f);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(x0, id), nearest), lo), hi));
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(x1, id), nearest), lo), hi));
    _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(i1));
    *d = db;
    return _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
  }
#elif defined(DQ_AVX2)
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = _mm256_loadu_ps(xb + 8 * i);
  const __m256 zero = _mm256_setzero_ps();
  int finite_bits = 0xFF;
  for (int i = 0; i < 4; ++i) finite_bits &= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_sub_ps(x[i], x[i]), zero, _CMP_EQ_OQ));
  if (finite_bits == 0xFF) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                             _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float db = amax / 127.0f;
    const __m256 id = _mm256_set1_ps(db != 0.0f ? 1.0f / db : 0.0f);
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i v[4];
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(
          _mm256_round_ps(_mm256_mul_ps(x[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), lo), hi));
    // to bytes in order (llama.cpp's packing): the packs interleave 128-bit lanes, one permutation undoes it
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    *d = db;
    return _mm_cvtsi128_si32(s4);
  }
#else
  bool finite = true;
  float amax = 0.0f;
  for (int i = 0; i < QK; ++i) {
    finite &= xb[i] - xb[i] == 0.0f;
    const float a = std::fabs(xb[i]);
    amax = a > amax ? a : amax;
  }
  if (finite) {
    const float db = amax / 127.0f;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < QK; ++i) {
      float v = std::nearbyint(xb[i] * id);  // round to nearest even (the default rounding mode)
      v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
      q[i] = (int8_t)(int)v;
      sum += q[i];
    }
    *d = db;
    return sum;
  }
#endif
  std::memset(q, 0, QK);
  *d = std::numeric_limits<float>::quiet_NaN();
  return 0;
}

// ---------------------------------------------------------------- one tile: R rows x 16 outputs
// A one-row product streams its weights from memory once, and the hardware's prefetchers alone kept it at ~60 % of
// this machine's read rate: each tile asks for the records DQ_PREFETCH bytes ahead of the block it reads. Measured
// (scripts/quant_products_ab.py, AMD EPYC Zen 3, SmolLM2-135M's 151 products of a one-row step): 0 -> 2048 bytes
// 4.07 -> 3.65 ms on 2 threads, 3.92 -> 3.43 on one; 1024 and 4096 alike, 512 half the gain; 16 rows unchanged.
// Only the order memory is read in changes, never a value.
#if defined(DARTREE_SCALAR)
#undef DQ_PREFETCH
#define DQ_PREFETCH 0
#elif !defined(DQ_PREFETCH)
#define DQ_PREFETCH 2048
#endif

inline void store_row(const float* out, float* dst, const float* res, int64_t n) {
  if (res != nullptr) {
    for (int64_t j = 0; j < n; ++j) dst[j] = res[j] + out[j];
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = out[j];
  }
}

#if defined(DQ_VNNI)
// a record's 16 fp16 floats at p as float32 (widened exactly)
inline __m512 floats16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#elif defined(DQ_AVX2)
// fp16 floats 8h..8h+7 of a record's 16 at p as float32 (widened exactly, F16C)
inline __m256 floats8(const uint8_t* p, int h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16 * h))); }
#endif

// R activation rows (from row r0 of M) against one group's records (nb blocks), written to y columns col0..
template <int64_t T, int R>
inline void tile(const uint8_t* rec, const ActBlock* act, int64_t M, int64_t nb, int64_t r0, float* y, int64_t N,
                 int64_t col0, const float* res) {
  // record bytes, quant bytes, and where the second floats start
  constexpr int64_t RB = record_bytes(T), QB = quant_bytes(T), SB = second_at(T);
  alignas(64) float out[R][G];
#if DQ_PREFETCH > 0 && (defined(DQ_VNNI) || defined(DQ_AVX2))
  // the first row tile of a group asks for the records DQ_PREFETCH bytes ahead of the block it reads
  const bool ahead = r0 == 0;
#define DQ_FETCH_AHEAD(rb) \
    if (ahead) for (int64_t off = 0; off < RB; off += 64) __builtin_prefetch((rb) + DQ_PREFETCH + off);
#else
#define DQ_FETCH_AHEAD(rb)
#endif
#if defined(DQ_VNNI)
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rb = rec + b * RB;
    const ActBlock* ab = act + b * M + r0;
    DQ_FETCH_AHEAD(rb)
    // w[t] holds inputs 4t..4t+3 of the 16 rows, as unsigned bytes: x's dword t goes with it
    __m512i w[8];
    if constexpr (wide(T)) {
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(rb + 64 * t);
    } else {
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m512i v = _mm512_loadu_si512(rb + 64 * t);
        w[t] = _mm512_and_si512(v, low);
        w[4 + t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    __m512 dw, second;  // scales; the minimums (Q4_1, Q5_1, Q4_K, Q5_K) or Q6_K's second scales
    if constexpr (k_scaled(T)) {
      const uint8_t* f = rb + QB;
      const auto bytes16 = [&](int at) {  // 16 integer scales as float32 (int8 for Q6_K, uint8 otherwise)
        const __m128i v = _mm_loadu_si128((const __m128i*)(f + at));
        return _mm512_cvtepi32_ps(T == Q6_K ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
      };
      const __m512 d = floats16(f);
      dw = _mm512_mul_ps(d, bytes16(T == Q6_K ? 2 * G : 4 * G));
      second = T == Q6_K ? _mm512_mul_ps(d, bytes16(3 * G))
                         : _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(floats16(f + 2 * G), bytes16(5 * G))),
                                                                _mm512_set1_epi32((int)0x80000000)));
    } else {
      dw = floats16(rb + QB);
      second = two_floats(T) ? floats16(rb + SB) : dw;
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      // the block's integer dot products, exact: dpbusd multiplies the weight's unsigned bytes by the row's
      // signed bytes; the offsets come off as the row's sums times them (corr). Inputs 0..15 and 16..31
      // in two chains, added (or scaled apart for Q6_K)
      __m512i s0 = _mm512_set1_epi32(ab[r].corr), s1 = _mm512_set1_epi32(ab[r].corr1);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        s0 = _mm512_dpbusd_epi32(s0, w[t], _mm512_set1_epi32(ab[r].q[t]));
        s1 = _mm512_dpbusd_epi32(s1, w[4 + t], _mm512_set1_epi32(ab[r].q[4 + t]));
      }
      const __m512 dx = _mm512_set1_ps(ab[r].d);
      if constexpr (T == Q6_K) {
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(s0), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(second, dx), _mm512_cvtepi32_ps(s1), acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[r]);
      }
      if constexpr (has_min(T))
        acc[r] = _mm512_fmadd_ps(second, _mm512_set1_ps(ab[r].ds), acc[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm512_store_ps(out[r], acc[r]);
#elif defined(DQ_AVX2)
  // two halves of 8 outputs (lanes j and 8 + j). Each broadcast of a row's 4 bytes serves both halves, and the
  // weights' bytes of a block are unpacked once for the R rows: the loads and unpacks per multiply are what
  // bounds AVX2 (no dpbusd), and this order took a 16..64-row product from ~62 % to ~88 % of this CPU's
  // maddubs rate (AMD EPYC Zen 3, one thread; the earlier order walked the halves outside the rows).
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rb = rec + b * RB;
    const ActBlock* ab = act + b * M + r0;
    DQ_FETCH_AHEAD(rb)
    __m256i s[R][2][2];  // [row][half][inputs 0..15, 16..31]: the exact integer sums
    if constexpr (wide(T)) {
      // the weight as int8, then |w| (uint8) times the row's byte with w's sign: pairs of products stay
      // within int16 (|w| <= 128, |x| <= 127), so maddubs never saturates; no offset to take off
      for (int r = 0; r < R; ++r) s[r][0][0] = s[r][0][1] = s[r][1][0] = s[r][1][1] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(rb + 64 * t)), flip);
        const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(rb + 64 * t + 32)), flip);
        const __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_set1_epi32(ab[r].q[t]);
          s[r][0][t / 4] = _mm256_add_epi32(s[r][0][t / 4], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0)), ones));
          s[r][1][t / 4] = _mm256_add_epi32(s[r][1][t / 4], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1)), ones));
        }
      }
    } else {
      // nibbles (0..15) times bytes (|x| <= 127): the 8 pair sums of a lane stay within int16
      // (8 * 2 * 15 * 127 = 30480), so they add in int16 before one madd to int32
      __m256i p[R][2];
      for (int r = 0; r < R; ++r) p[r][0] = p[r][1] = _mm256_setzero_si256();
      for (int t = 0; t < 4; ++t) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i*)(rb + 64 * t));
        const __m256i v1 = _mm256_loadu_si256((const __m256i*)(rb + 64 * t + 32));
        const __m256i lo0 = _mm256_and_si256(v0, low), lo1 = _mm256_and_si256(v1, low);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_set1_epi32(ab[r].q[t]);
          p[r][0] = _mm256_add_epi16(p[r][0], _mm256_maddubs_epi16(lo0, x));
          p[r][1] = _mm256_add_epi16(p[r][1], _mm256_maddubs_epi16(lo1, x));
        }
        const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
        const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_set1_epi32(ab[r].q[4 + t]);
          p[r][0] = _mm256_add_epi16(p[r][0], _mm256_maddubs_epi16(hi0, x));
          p[r][1] = _mm256_add_epi16(p[r][1], _mm256_maddubs_epi16(hi1, x));
        }
      }
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) {
          s[r][h][0] = _mm256_add_epi32(_mm256_madd_epi16(p[r][h], ones), _mm256_set1_epi32(ab[r].corr));
          s[r][h][1] = _mm256_setzero_si256();
        }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 dw, second;  // scales; the minimums (Q4_1, Q5_1, Q4_K, Q5_K) or Q6_K's second scales
      if constexpr (k_scaled(T)) {
        const uint8_t* f = rb + QB;
        const auto bytes8 = [&](int at) {  // 8 integer scales as float32 (int8 for Q6_K, uint8 otherwise)
          const __m128i v = _mm_loadl_epi64((const __m128i*)(f + at + 8 * h));
          return _mm256_cvtepi32_ps(T == Q6_K ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
        };
        const __m256 d = floats8(f, h);
        dw = _mm256_mul_ps(d, bytes8(T == Q6_K ? 2 * G : 4 * G));
        second = T == Q6_K ? _mm256_mul_ps(d, bytes8(3 * G))
                           : _mm256_xor_ps(_mm256_mul_ps(floats8(f + 2 * G, h), bytes8(5 * G)), _mm256_set1_ps(-0.0f));
      } else {
        dw = floats8(rb + QB, h);
        second = two_floats(T) ? floats8(rb + SB, h) : dw;
      }
      for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(ab[r].d);
        if constexpr (T == Q6_K) {
          acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s[r][h][0]), acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(second, dx), _mm256_cvtepi32_ps(s[r][h][1]), acc[r][h]);
        } else {
          acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(_mm256_add_epi32(s[r][h][0], s[r][h][1])),
                                      acc[r][h]);
        }
        if constexpr (has_min(T))
          acc[r][h] = _mm256_fmadd_ps(second, _mm256_set1_ps(ab[r].ds), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(out[r], acc[r][0]);
    _mm256_store_ps(out[r] + 8, acc[r][1]);
  }
#else
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < G; ++j) out[r][j] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rb = rec + b * RB;
    const ActBlock* ab = act + b * M + r0;
    float dw[G], second[G];  // scales; Q4_1's and Q5_1's minimums, Q6_K's scales of inputs 16..31
    for (int j = 0; j < G; ++j) {
      if constexpr (k_scaled(T)) {
        k_floats<T>(rb + QB, j, &dw[j], &second[j]);
      } else {
        dw[j] = float_at(rb + QB, j);
        second[j] = two_floats(T) ? float_at(rb + SB, j) : dw[j];
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = reinterpret_cast<const int8_t*>(ab[r].q);
      for (int j = 0; j < G; ++j) {
        int32_t s[2] = {0, 0};  // the integer dot products of the signed values, inputs 0..15 and 16..31
        for (int v = 0; v < QK; ++v) {
          int32_t wv;
          if constexpr (wide(T)) {
            wv = (int8_t)(rb[wide_at(v, j)] ^ 0x80);
          } else {
            const uint8_t byte = rb[nibble_at(v, j)];
            wv = (v < 16 ? byte & 0x0F : byte >> 4) - (T == Q4_0 ? 8 : 0);
          }
          s[v / 16] += wv * xb[v];
        }
        if constexpr (T == Q6_K) {
          out[r][j] = std::fma(dw[j] * ab[r].d, (float)s[0], out[r][j]);
          out[r][j] = std::fma(second[j] * ab[r].d, (float)s[1], out[r][j]);
        } else {
          out[r][j] = std::fma(dw[j] * ab[r].d, (float)(s[0] + s[1]), out[r][j]);
        }
        if constexpr (has_min(T)) out[r][j] = std::fma(second[j], ab[r].ds, out[r][j]);
      }
    }
  }
#endif
#undef DQ_FETCH_AHEAD
  const int64_t n = std::min<int64_t>(G, N - col0);
  for (int r = 0; r < R; ++r)
    store_row(out[r], y + (r0 + r) * N + col0, res ? res + (r0 + r) * N + col0 : nullptr, n);
}

// Rows per tile: measured on an AMD EPYC Zen 4 (one thread, 960 x 576): 4 to 16 rows a tile give the same
// times on the VNNI path (bound by vpdpbusd's one a cycle). The AVX2 path (AMD EPYC Zen 3, one thread, builds
// with DQ_AVX2_ROWS = 2, 3, 4 side by side): 4 rows a tile beat 2 by 1.1-1.25x from 4 rows on; 3 was between them
// for Q4_x and slower than both for Q8_0.
#if defined(DQ_VNNI)
constexpr int ROWS_PER_TILE = 8;
#elif defined(DQ_AVX2) && defined(DQ_AVX2_ROWS)
constexpr int ROWS_PER_TILE = DQ_AVX2_ROWS;  // for measuring other tile heights
#elif defined(DQ_AVX2)
constexpr int ROWS_PER_TILE = 4;
#else
constexpr int ROWS_PER_TILE = 4;
#endif
static_assert(ROWS_PER_TILE >= 1 && ROWS_PER_TILE <= 16, "product_impl's tail covers at most 15 rows");

template <int64_t T>
void product_impl(const ActBlock* act, int64_t M, int64_t nb, const uint8_t* packed, int64_t N, float* y,
                  const float* res) {
  const int64_t groups = (N + G - 1) / G, group_bytes = nb * record_bytes(T);
  // threads split the output groups; a group's records (a few KiB) stay in L1 while every row tile reads them
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* rec = packed + g * group_bytes;
      int64_t r = 0;
      for (; r + ROWS_PER_TILE <= M; r += ROWS_PER_TILE) tile<T, ROWS_PER_TILE>(rec, act, M, nb, r, y, N, g * G, res);
      switch (M - r) {
#define DQ_TAIL(n) case n: if constexpr (n < ROWS_PER_TILE) tile<T, n>(rec, act, M, nb, r, y, N, g * G, res); break;
        DQ_TAIL(15) DQ_TAIL(14) DQ_TAIL(13) DQ_TAIL(12) DQ_TAIL(11) DQ_TAIL(10) DQ_TAIL(9) DQ_TAIL(8)
        DQ_TAIL(7) DQ_TAIL(6) DQ_TAIL(5) DQ_TAIL(4) DQ_TAIL(3) DQ_TAIL(2) DQ_TAIL(1)
#undef DQ_TAIL
        default: break;
      }
    }
  });
}

// ---------------------------------------------------------------- packing
// One block of 32 of one output row, decoded from GGUF's bytes: the values as integers (Q4_x: 0..15, Q8_0 and
// Q6_K: signed; Q5_1 and Q5_K: 0..31) and what the record keeps of its scales: GGUF's fp16 bits, and the K-quants'
// integer scales (and minimums).
struct Decoded {
  int q[QK];
  uint16_t half_a, half_b;  // GGUF's fp16 scale and minimum (0 without one); the K-quants': d and dmin
  uint8_t int_a, int_b;     // the K-quants' integer scale and minimum (Q6_K: its two int8 scales)
};

// block b (of 32) of a row of GGUF blocks
Decoded decode(const uint8_t* row, int64_t qtype, int64_t b) {
  Decoded o{};
  if (qtype == Q8_0 || qtype == Q4_0 || qtype == Q4_1) {
    const uint8_t* blk = row + b * raw_bytes(qtype);
    std::memcpy(&o.half_a, blk, 2);
    if (qtype == Q4_1) std::memcpy(&o.half_b, blk + 2, 2);
    const uint8_t* qs = blk + (qtype == Q4_1 ? 4 : 2);
    for (int v = 0; v < QK; ++v)
      o.q[v] = qtype == Q8_0 ? (int)(int8_t)qs[v] : (v < 16 ? qs[v] & 0x0F : qs[v - 16] >> 4);
    return o;
  }
  if (qtype == Q5_0 || qtype == Q5_1) {
    // d (fp16), Q5_1's m (fp16), 4 bytes of high bits (bit v: value v's fifth bit), 16 bytes of nibbles as Q4_0's
    const uint8_t* blk = row + b * raw_bytes(qtype);
    std::memcpy(&o.half_a, blk, 2);
    const int64_t at = qtype == Q5_1 ? 4 : 2;  // where the high bits start
    if (qtype == Q5_1) std::memcpy(&o.half_b, blk + 2, 2);
    uint32_t high;
    std::memcpy(&high, blk + at, 4);  // little-endian, as GGUF writes it
    const uint8_t* qs = blk + at + 4;
    for (int v = 0; v < QK; ++v)
      o.q[v] = ((v < 16 ? qs[v] & 0x0F : qs[v - 16] >> 4) | (int)((high >> v) & 1u) << 4) - (qtype == Q5_0 ? 16 : 0);
    return o;
  }
  const uint8_t* blk = row + (b / 8) * raw_bytes(qtype);
  const int sub = b % 8;  // the 32-block within the super-block
  if (qtype == Q4_K || qtype == Q5_K) {
    // d, dmin (fp16), 12 bytes of 6-bit scales and minimums, (Q5_K: 32 bytes of high bits, bit j of byte i the
    // fifth bit of value i of 32-block j,) 128 bytes of nibbles: 64 values a 32 bytes, the even 32-block in the
    // low nibbles, the odd one in the high nibbles (llama.cpp's get_scale_min_k4)
    const uint8_t* sc = blk + 4;
    const int j = sub;
    const int scale = j < 4 ? sc[j] & 63 : (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
    const int min = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    // value = (d * sc) * q - dmin * m, as gguf computes it (k_floats)
    std::memcpy(&o.half_a, blk, 2);
    std::memcpy(&o.half_b, blk + 2, 2);
    o.int_a = (uint8_t)scale;
    o.int_b = (uint8_t)min;
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (qtype == Q5_K ? 48 : 16) + 32 * (j / 2);
    for (int v = 0; v < QK; ++v)
      o.q[v] = (j % 2 ? qs[v] >> 4 : qs[v] & 0x0F) | (qtype == Q5_K ? ((qh[v] >> j) & 1) << 4 : 0);
    return o;
  }
  // Q6_K: ql (128: 4 low bits), qh (64: 2 high bits), 16 int8 scales (one a 16), d (fp16); the values of
  // each 128-half in four 32-runs: run l of half h is ql[64h + 32(l % 2) + i] (low nibble for l < 2)
  // with the bits 2l..2l+1 of qh[32h + i]
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
  const int h = sub / 4, l = sub % 4;
  for (int i = 0; i < QK; ++i) {
    const uint8_t lb = ql[64 * h + 32 * (l % 2) + i];
    const int lo = l < 2 ? lb & 0x0F : lb >> 4;
    o.q[i] = (lo | (((qh[32 * h + i] >> (2 * l)) & 3) << 4)) - 32;
  }
  std::memcpy(&o.half_a, blk + 208, 2);
  o.int_a = (uint8_t)scales[2 * sub];
  o.int_b = (uint8_t)scales[2 * sub + 1];
  return o;
}

}  // namespace

// ---------------------------------------------------------------- entry points
// raw: uint8 [N, K / block values * block bytes], GGUF's blocks of one tensor as stored;
// -> uint8 [ceil(N / 16), K / 32, record bytes]
torch::Tensor pack(torch::Tensor raw, int64_t qtype, int64_t K) {
  TORCH_CHECK(qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0 || qtype == Q4_K ||
                  qtype == Q5_K || qtype == Q6_K,
              "quant.pack: type ", qtype, " is not Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K");
  TORCH_CHECK(K > 0 && K % raw_values(qtype) == 0, "quant.pack: K must be a positive multiple of ", raw_values(qtype));
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_contiguous(), "quant.pack: contiguous uint8 [N, bytes]");
  const int64_t rt = record_type(qtype), N = raw.size(0), nb = K / QK;
  const int64_t RB = record_bytes(rt), QB = quant_bytes(rt), SB = second_at(rt);
  const int64_t row_bytes = K / raw_values(qtype) * raw_bytes(qtype);
  TORCH_CHECK(raw.size(1) == row_bytes, "quant.pack: ", raw.size(1), " bytes a row, expected ", row_bytes);
  const int64_t groups = (N + G - 1) / G;
  auto packed = torch::zeros({groups, nb, RB}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* rec = dst + (g * nb + b) * RB;
        for (int j = 0; j < G; ++j) {
          const int64_t n = g * G + j;
          if (n >= N) {  // padding: zero scales (and value 0)
            if (wide(rt))
              for (int v = 0; v < QK; ++v) rec[wide_at(v, j)] = 0x80;
            continue;
          }
          const Decoded o = decode(src + n * row_bytes, qtype, b);
          if (k_scaled(rt)) {  // d (and dmin) fp16, then the integer scales (and minimums): k_floats' layout
            std::memcpy(rec + QB + 2 * j, &o.half_a, 2);
            if (rt == Q6_K) {
              rec[QB + 2 * G + j] = o.int_a;
              rec[QB + 3 * G + j] = o.int_b;
            } else {
              std::memcpy(rec + QB + 2 * G + 2 * j, &o.half_b, 2);
              rec[QB + 4 * G + j] = o.int_a;
              rec[QB + 5 * G + j] = o.int_b;
            }
          } else {  // GGUF's own fp16 scale (and minimum)
            std::memcpy(rec + QB + 2 * j, &o.half_a, 2);
            if (two_floats(rt)) std::memcpy(rec + SB + 2 * j, &o.half_b, 2);
          }
          for (int v = 0; v < QK; ++v) {
            if (wide(rt)) rec[wide_at(v, j)] = (uint8_t)(o.q[v] + 128);
            else rec[nibble_at(v, j)] |= (uint8_t)(v < 16 ? o.q[v] : o.q[v] << 4);
          }
        }
      }
  });
  return packed;
}

// packed -> float32 [n, K]: GGUF's dequantisation, value for value, as gguf.quants computes it (Q8_0 and
// Q6_K: q * d; Q4_0: d * (q - 8); Q4_1, Q5_1, Q4_K and Q5_K: d * q + m), each a correctly rounded operation. With
// ``rows`` (int64 [R]) only those rows, in that order, [R, K]: a token embedding's lookup in the weight
// that a tied output layer multiplies by, so that the table is held once.
torch::Tensor dequantize(torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> rows) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "quant.dequantize: a packed weight");
  const int64_t rt = type_of_record(packed.size(2)), nb = packed.size(1), K = nb * QK, QB = quant_bytes(rt), SB = second_at(rt);
  TORCH_CHECK(N <= packed.size(0) * G && N > (packed.size(0) - 1) * G, "quant.dequantize: n does not match the packed rows");
  const bool some = rows.has_value() && rows->defined();
  torch::Tensor ids = some ? rows->contiguous() : torch::Tensor();
  if (some) TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong && ids.device().is_cpu(),
                        "quant.dequantize: rows must be int64 [R] on the CPU");
  const int64_t R = some ? ids.size(0) : N;
  const int64_t* id = some ? ids.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; some && i < R; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < N, "quant.dequantize: row ", id[i], " outside the weight's ", N, " rows");
  auto w = torch::empty({R, K}, torch::dtype(torch::kFloat32));
  const uint8_t* p = packed.data_ptr<uint8_t>();
  float* base = w.data_ptr<float>();
  at::parallel_for(0, R, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t n = some ? id[i] : i;  // the weight's row that is the output's row i
        const uint8_t* rec = p + ((n / G) * nb + b) * packed.size(2);
        const int j = n % G;
        float a = 0.0f, second = 0.0f;
        if (rt == Q4_K || rt == Q5_K) k_floats<Q4_K>(rec + QB, j, &a, &second);
        else if (rt == Q6_K) k_floats<Q6_K>(rec + QB, j, &a, &second);
        else {
          a = float_at(rec + QB, j);
          second = two_floats(rt) ? float_at(rec + SB, j) : 0.0f;
        }
        float* o = base + i * K + b * QK;
        for (int v = 0; v < QK; ++v) {
          if (rt == Q5_1 || rt == Q5_K) {
            o[v] = a * (float)(int8_t)(rec[wide_at(v, j)] ^ 0x80) + second;
          } else if (wide(rt)) {
            o[v] = (float)(int8_t)(rec[wide_at(v, j)] ^ 0x80) * (rt == Q6_K && v >= 16 ? second : a);
          } else {
            const uint8_t byte = rec[nibble_at(v, j)];
            const int q = v < 16 ? byte & 0x0F : byte >> 4;
            if (rt == Q4_0) o[v] = a * (float)(q - 8);
            else o[v] = a * (float)q + second;
          }
        }
      }
  });
  return w;
}

// x [M, K] float32 -> (q int8 [M, K], d float32 [M, K/32], s int32 [M, K/32]): the activation quantisation
// qproduct uses (for references and tests)
std::vector<torch::Tensor> quantize_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(1) % QK == 0,
              "quant.quantize_rows: contiguous float32 [M, K], K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  auto q = torch::empty({M, K}, torch::dtype(torch::kInt8));
  auto d = torch::empty({M, nb}, torch::dtype(torch::kFloat32));
  auto s = torch::empty({M, nb}, torch::dtype(torch::kInt32));
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int32_t* sp = s.data_ptr<int32_t>();
  for (int64_t i = 0; i < M * nb; ++i) sp[i] = quantize_block(xp + i * QK, qp + i * QK, dp + i);
  return {q, d, s};
}

// y [M, n] = x [M, K] @ W.T (+ residual), W packed by pack (its record type read from the record size)
torch::Tensor qproduct(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "qproduct: contiguous float32 x [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(), "qproduct: a packed weight");
  const int64_t rt = type_of_record(packed.size(2)), M = x.size(0), K = x.size(1), nb = packed.size(1);
  TORCH_CHECK(K == nb * QK, "qproduct: x has ", K, " columns, the weight ", nb * QK);
  TORCH_CHECK(N <= packed.size(0) * G && N > (packed.size(0) - 1) * G, "qproduct: n does not match the packed rows");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res)
    TORCH_CHECK(residual->scalar_type() == torch::kFloat32 && residual->is_contiguous() && residual->dim() == 2 &&
                    residual->size(0) == M && residual->size(1) == N, "qproduct: residual must be contiguous float32 [M, n]");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  // the rows quantised block by block, block-major: act[b * M + r]
  std::vector<ActBlock> act(nb * M);
  const int32_t offset = wide(rt) ? -128 : rt == Q4_0 ? -8 : 0;
  const float* xp = x.data_ptr<float>();
  // cheap next to the products: split over threads only for many rows (a parallel region costs a sync)
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        ActBlock& ab = act[b * M + r];
        const int8_t* q = reinterpret_cast<const int8_t*>(ab.q);
        const int32_t sum = quantize_block(xp + r * K + b * QK, reinterpret_cast<int8_t*>(ab.q), &ab.d);
        ab.ds = ab.d * (float)sum;
        ab.corr = offset * sum;
        ab.corr1 = 0;
        if (rt == Q6_K) {  // a scale a 16: the offsets of the two halves apart
          int32_t sum0 = 0;
          for (int i = 0; i < QK / 2; ++i) sum0 += q[i];
          ab.corr = offset * sum0;
          ab.corr1 = offset * (sum - sum0);
        }
      }
  });
  const float* rp = has_res ? residual->data_ptr<float>() : nullptr;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (rt == Q8_0) product_impl<Q8_0>(act.data(), M, nb, wp, N, yp, rp);
  else if (rt == Q4_0) product_impl<Q4_0>(act.data(), M, nb, wp, N, yp, rp);
  else if (rt == Q4_1) product_impl<Q4_1>(act.data(), M, nb, wp, N, yp, rp);
  else if (rt == Q5_1) product_impl<Q5_1>(act.data(), M, nb, wp, N, yp, rp);
  else if (rt == Q4_K) product_impl<Q4_K>(act.data(), M, nb, wp, N, yp, rp);
  else if (rt == Q5_K) product_impl<Q5_K>(act.data(), M, nb, wp, N, yp, rp);
  else product_impl<Q6_K>(act.data(), M, nb, wp, N, yp, rp);
  return y;
}

// which integer path this build took: "avx512-vnni", "avx2" or "scalar"
std::string path() {
#if defined(DQ_VNNI)
  return "avx512-vnni";
#elif defined(DQ_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

#if !defined(DARTREE_NO_MODULE)  // forward_kernels.cpp compiles this file into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("pack", &pack, "GGUF blocks [N, bytes] of a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K tensor -> the packed weight", py::arg("raw"),
        py::arg("qtype"), py::arg("k"), release());
  m.def("dequantize", &dequantize, "packed weight -> float32 [n, K] (or its rows [R, K]), GGUF's values", py::arg("packed"),
        py::arg("n"), py::arg("rows") = py::none(), release());
  m.def("quantize_rows", &quantize_rows, "x [M, K] -> (int8 q, float32 d, int32 sum) per block of 32", release());
  m.def("qproduct", &qproduct, "x @ W.T (+ residual) on a packed quantised weight, exact integer blocks, row-invariant",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("residual") = py::none(), release());
  m.def("path", &path, "the integer path this build took");
}
#endif
