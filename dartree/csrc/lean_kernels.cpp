// Kernels of the lean forward (dartree/lean.py): products on packed weights, RMSNorm, RoPE with the
// KV-cache write, attention over a slot's cache with a per-row visibility mask, and SwiGLU.
//
// Every kernel gives a row the same bits whatever the row count and whatever other rows share the
// call: each output element is reduced in one fixed order that depends only on its own row (a
// product accumulates k = 0..K-1 with one fused multiply-add per step; attention walks a row's
// visible keys in cache order), threads split work by output columns or by rows, never inside
// one reduction, and the vector paths use only correctly rounded operations (fma, add, mul, div,
// sqrt, round), so a lane computes what the scalar code computes. That is what makes a tree
// verification give each row exactly the logits a one-token step gives, and a request's rows the
// same logits whatever other requests share the forward.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
// Without AVX-512, the float kernels take 8-lane AVX2 paths: the same operations in the same order,
// so the same bits as the scalar code and as the AVX-512 paths.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define DARTREE_AVX2 1
#endif
#if defined(__AVX512F__)
#define LANES_PER_REGISTER 16
#else
#define LANES_PER_REGISTER 8
#endif

namespace {

constexpr int BLOCK = 16;  // output columns per vector block
// packed[b][k][j] = W[b*16 + j][k]: a tile of NB blocks reads NB streams of weights (measured: one
// interleaved stream of 4 blocks per panel ran 1.5x slower at one row than 4 streams)

// ---------------------------------------------------------------- 16 lanes of T, fma-accumulated
template <typename T>
struct Lanes {
  T v[BLOCK];
  static inline Lanes zero() { Lanes a; for (int j = 0; j < BLOCK; ++j) a.v[j] = T(0); return a; }
  static inline Lanes load(const T* p) { Lanes a; for (int j = 0; j < BLOCK; ++j) a.v[j] = p[j]; return a; }
  inline void fma(const Lanes& w, T x) { for (int j = 0; j < BLOCK; ++j) v[j] = std::fma(w.v[j], x, v[j]); }
  inline void store(T* p) const { for (int j = 0; j < BLOCK; ++j) p[j] = v[j]; }
};

template <typename T>
inline void store_tile_row(const T* out, T* dst, const T* res, int64_t n) {
  if (res != nullptr) {
    for (int64_t j = 0; j < n; ++j) dst[j] = res[j] + out[j];  // the residual added after the whole sum
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = out[j];
  }
}

// R rows x NB blocks of outputs: acc[r][b] accumulates x[r, k] * W[col, k] for k = 0..K-1 in order.
// Over k in [k0, k1) only: the sums start from ``part`` (R * NB * 16 values, the same sums carried
// from the k before k0) unless k0 == 0, and go back there unless k1 == K, when they are written to y.
template <typename T, int R, int NB>
inline void product_tile(const T* x, int64_t ldx, const T* wp, int64_t K, T* y, int64_t ldy, int64_t col0,
                         int64_t N, const T* res, int64_t ldr, int64_t k0, int64_t k1, T* part) {
  alignas(64) T out[BLOCK];
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    // plain register variables (an array of wrapper structs made GCC store every accumulator each step)
    __m512 acc[R * NB];
#pragma GCC unroll 32
    for (int i = 0; i < R * NB; ++i) acc[i] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(part + i * BLOCK);
    for (int64_t k = k0; k < k1; ++k) {
      __m512 w[NB];
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) w[b] = _mm512_loadu_ps(wp + ((int64_t)b * K + k) * BLOCK);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) acc[r * NB + b] = _mm512_fmadd_ps(w[b], xv, acc[r * NB + b]);
      }
    }
    if (k1 < K) {
#pragma GCC unroll 32
      for (int i = 0; i < R * NB; ++i) _mm512_storeu_ps(part + i * BLOCK, acc[i]);
      return;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        _mm512_store_ps(out, acc[r * NB + b]);
        const int64_t c = col0 + (int64_t)b * BLOCK;
        store_tile_row(out, y + r * ldy + c, res ? res + r * ldr + c : nullptr, std::min<int64_t>(BLOCK, N - c));
      }
    return;
  }
#elif defined(DARTREE_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    // the same plain-register path in two 8-lane halves per block (lo at +0, hi at +8: the layout of
    // ``part`` that Lanes uses too); the tile is sized for AVX2's 16 registers (ROWS_PER_TILE)
    __m256 acc[2 * R * NB];
#pragma GCC unroll 32
    for (int i = 0; i < 2 * R * NB; ++i) acc[i] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(part + i * 8);
    for (int64_t k = k0; k < k1; ++k) {
      __m256 w[2 * NB];
#pragma GCC unroll 8
      for (int b = 0; b < NB; ++b) {
        w[2 * b] = _mm256_loadu_ps(wp + ((int64_t)b * K + k) * BLOCK);
        w[2 * b + 1] = _mm256_loadu_ps(wp + ((int64_t)b * K + k) * BLOCK + 8);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
        for (int i = 0; i < 2 * NB; ++i) acc[r * 2 * NB + i] = _mm256_fmadd_ps(w[i], xv, acc[r * 2 * NB + i]);
      }
    }
    if (k1 < K) {
#pragma GCC unroll 32
      for (int i = 0; i < 2 * R * NB; ++i) _mm256_storeu_ps(part + i * 8, acc[i]);
      return;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b) {
        _mm256_store_ps(out, acc[(r * NB + b) * 2]);
        _mm256_store_ps(out + 8, acc[(r * NB + b) * 2 + 1]);
        const int64_t c = col0 + (int64_t)b * BLOCK;
        store_tile_row(out, y + r * ldy + c, res ? res + r * ldr + c : nullptr, std::min<int64_t>(BLOCK, N - c));
      }
    return;
  }
#endif
  Lanes<T> acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = k0 == 0 ? Lanes<T>::zero() : Lanes<T>::load(part + (r * NB + b) * BLOCK);
  for (int64_t k = k0; k < k1; ++k) {
    Lanes<T> w[NB];
    for (int b = 0; b < NB; ++b) w[b] = Lanes<T>::load(wp + ((int64_t)b * K + k) * BLOCK);
    for (int r = 0; r < R; ++r) {
      const T xv = x[r * ldx + k];
      for (int b = 0; b < NB; ++b) acc[r][b].fma(w[b], xv);
    }
  }
  if (k1 < K) {
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) acc[r][b].store(part + (r * NB + b) * BLOCK);
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      acc[r][b].store(out);
      const int64_t c = col0 + (int64_t)b * BLOCK;
      store_tile_row(out, y + r * ldy + c, res ? res + r * ldr + c : nullptr, std::min<int64_t>(BLOCK, N - c));
    }
}

// 8 rows x 3 blocks: 24 accumulators, 3 weight registers and the broadcast row value in the 32 vector
// registers (measured on the SmolLM2 shapes: 0.82-0.85x the time of 4 x 4 tiles at 8 rows, the same
// at 1-4 and 64 rows)
#if defined(__AVX512F__)
constexpr int ROWS_PER_TILE = 8;
constexpr int BLOCKS_PER_TILE = 3;
#else
// AVX2 has 16 vector registers: 2 rows x 3 blocks is 12 accumulators (two halves a block), each
// step's 6 weight vectors shared by the 2 rows. Measured on an AMD EPYC Zen 3 (AVX2, one thread, the
// SmolLM2 layer shapes; tiles of 1x3, 3x2, 4x1 and 6x1 tried too): 12.6 / 33 / 44 / 54 / 65 / 70
// GFLOP/s at 1 / 4 / 8 / 16 / 64 / 128 rows, where the 8 x 3 tile's wrapper-struct lanes (spilled)
// gave 12.3 / 37 / 29 / 28 / 29 / 29
constexpr int ROWS_PER_TILE = 2;
constexpr int BLOCKS_PER_TILE = 3;
#endif

template <typename T, int R>
inline void product_rows(const T* x, int64_t ldx, const T* wp, int64_t K, T* y, int64_t ldy, int64_t b0, int64_t nb,
                         int64_t N, const T* res, int64_t ldr, int64_t k0, int64_t k1, T* part) {
  const T* panel = wp + b0 * K * BLOCK;
  switch (nb) {
    case 4: product_tile<T, R, 4>(x, ldx, panel, K, y, ldy, b0 * BLOCK, N, res, ldr, k0, k1, part); break;
    case 3: product_tile<T, R, 3>(x, ldx, panel, K, y, ldy, b0 * BLOCK, N, res, ldr, k0, k1, part); break;
    case 2: product_tile<T, R, 2>(x, ldx, panel, K, y, ldy, b0 * BLOCK, N, res, ldr, k0, k1, part); break;
    default: product_tile<T, R, 1>(x, ldx, panel, K, y, ldy, b0 * BLOCK, N, res, ldr, k0, k1, part); break;
  }
}

// k steps per pass over the row tiles when there are several: a 64-column panel of that depth
// (32 KiB in float) stays in L1 while every row tile reads it; each sum still runs k = 0..K-1 in
// order, carried between passes, so the bits do not change
constexpr int64_t K_STEPS_PER_PASS = 128;

template <typename T>
void product_impl(const T* x, int64_t M, int64_t K, const T* wp, int64_t N, T* y, const T* res) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  const int64_t groups = (blocks + BLOCKS_PER_TILE - 1) / BLOCKS_PER_TILE;
  const int64_t full_tiles = M / ROWS_PER_TILE, tail = M % ROWS_PER_TILE;
  const int64_t tiles = full_tiles + (tail ? 1 : 0);
  const int64_t step = tiles > 1 ? K_STEPS_PER_PASS : K;
  // Threads split the output columns; each keeps its slice of the weights hot while it walks the row
  // tiles, so the weights are read from memory once per call whatever the row count.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<T> parts(tiles > 1 && step < K ? tiles * (ROWS_PER_TILE + 1) * BLOCKS_PER_TILE * BLOCK : 0);
    for (int64_t g = g0; g < g1; ++g) {  // one panel of columns at a time, kept in cache over the row tiles
      const int64_t b0 = g * BLOCKS_PER_TILE, nb = std::min(blocks, b0 + BLOCKS_PER_TILE) - b0;
      for (int64_t k0 = 0; k0 < K; k0 += step) {
        const int64_t k1 = std::min(K, k0 + step);
        T* part = parts.data();
        const int64_t part_size = (ROWS_PER_TILE + 1) * BLOCKS_PER_TILE * BLOCK;
        int64_t r = 0;
        for (; r + ROWS_PER_TILE <= M; r += ROWS_PER_TILE, part += part_size)
          product_rows<T, ROWS_PER_TILE>(x + r * K, K, wp, K, y + r * N, N, b0, nb, N, res ? res + r * N : nullptr, N,
                                         k0, k1, part);
        const T* xr = x + r * K;
        T* yr = y + r * N;
        const T* rr = res ? res + r * N : nullptr;
        switch (M - r) {
          case 7: product_rows<T, 7>(xr, K, wp, K, yr, N, b0, nb, N, rr, N, k0, k1, part); break;
          case 6: product_rows<T, 6>(xr, K, wp, K, yr, N, b0, nb, N, rr, N, k0, k1, part); break;
          case 5: product_rows<T, 5>(xr, K, wp, K, yr, N, b0, nb, N, rr, N, k0, k1, part); break;
          case 4: product_rows<T, 4>(xr, K, wp, K, yr, N, b0, nb, N, rr, N, k0, k1, part); break;
          case 3: product_rows<T, 3>(xr, K, wp, K, yr, N, b0, nb, N, rr, N, k0, k1, part); break;
          case 2: product_rows<T, 2>(xr, K, wp, K, yr, N, b0, nb, N, rr, N, k0, k1, part); break;
          case 1: product_rows<T, 1>(xr, K, wp, K, yr, N, b0, nb, N, rr, N, k0, k1, part); break;
          default: break;
        }
      }
    }
  });
}

// ---------------------------------------------------------------- reductions in a fixed order
template <typename T>
inline T dot_fixed(const T* a, const T* b, int64_t n) {
  T lanes[BLOCK];
  for (int j = 0; j < BLOCK; ++j) lanes[j] = T(0);
  int64_t i = 0;
  for (; i + BLOCK <= n; i += BLOCK)
    for (int j = 0; j < BLOCK; ++j) lanes[j] = std::fma(a[i + j], b[i + j], lanes[j]);
  for (int j = 0; i + j < n; ++j) lanes[j] = std::fma(a[i + j], b[i + j], lanes[j]);
  for (int w = BLOCK / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lanes[j] = lanes[j] + lanes[j + w];
  return lanes[0];
}

#if defined(__AVX512F__)
// dot_fixed for float with n a multiple of 16: the same lanes, the same pairwise tree (lane j with
// j + 8, then + 4, + 2, + 1), so the same bits as the scalar code, in a few instructions.
inline float dot_fixed_avx512(const float* a, const float* b, int64_t n) {
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += BLOCK) lanes = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), lanes);
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(lanes),
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

#if defined(__AVX512F__)
// dot_fixed_avx512 of one query against 16 consecutive keys (key k at keys + k * n), n a multiple of
// 16: each key's lanes by the same fmas, then the 16 pairwise trees (j with j + 8, + 4, + 2, + 1)
// taken side by side by shuffles that bring the two operands of each addition into one lane. Every
// addition is the one the single-key code makes (IEEE addition commutes exactly), so each key's dot
// has the same bits as dot_fixed_avx512's, without a horizontal reduction per key.
inline void dot16_keys_avx512(const float* q, const float* keys, int64_t n, float* out) {
  __m512 v[16];
  for (int k = 0; k < 16; ++k) v[k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += BLOCK) {
    const __m512 qi = _mm512_loadu_ps(q + i);
    for (int k = 0; k < 16; ++k) v[k] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(keys + k * n + i), v[k]);
  }
  // lane j + lane j + 8: keys 2i, 2i + 1 -> w[i] = [s8 of key 2i | s8 of key 2i + 1]
  __m512 w[8];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + 4: w[2i], w[2i + 1] -> x[i] = [s4 of keys 4i, 4i + 1, 4i + 2, 4i + 3], one per 128-bit quarter
  __m512 x[4];
  for (int i = 0; i < 4; ++i)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  // + 2 within each quarter: y[0] quarter c = [s2 of key c, s2 of key 4 + c], y[1] keys 8 + c, 12 + c
  __m512 y[2];
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + 1: lane 4c + l holds key 4l + c; one permutation puts key k in lane k
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, z));
}
#endif

#if defined(DARTREE_AVX2)
// the 16 lanes' pairwise tree (j with j + 8, + 4, + 2, + 1) of lanes held as two 8-lane halves
inline float tree16_avx2(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// dot_fixed for float with n a multiple of 16 (lanes 0-7 and 8-15 in two registers)
inline float dot_fixed_avx2(const float* a, const float* b, int64_t n) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += BLOCK) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
  }
  return tree16_avx2(lo, hi);
}

// dot_fixed_avx2 of one query against 4 consecutive keys (key k at keys + k * n), side by side so
// that the fmas of one key do not wait on each other
inline void dot4_keys_avx2(const float* q, const float* keys, int64_t n, float* out) {
  __m256 lo[4], hi[4];
  for (int k = 0; k < 4; ++k) lo[k] = hi[k] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += BLOCK) {
    const __m256 ql = _mm256_loadu_ps(q + i), qh = _mm256_loadu_ps(q + i + 8);
    for (int k = 0; k < 4; ++k) {
      lo[k] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(keys + k * n + i), lo[k]);
      hi[k] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(keys + k * n + i + 8), hi[k]);
    }
  }
  for (int k = 0; k < 4; ++k) out[k] = tree16_avx2(lo[k], hi[k]);
}
#endif

// scores[i] = dot(q, key i) * scale for the committed keys 16 at a time where there are vectors (the
// same bits as dot_heads one key at a time); returns how many it scored (the rest go one by one)
template <typename T>
inline int64_t score_committed(const T* q, const T* kbase, int64_t hd, int64_t p, T scale, T* scores) {
  int64_t done = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (hd % BLOCK == 0) {
      for (; done + 16 <= p; done += 16) {
        dot16_keys_avx512(q, kbase + done * hd, hd, scores + done);
        for (int k = 0; k < 16; ++k) scores[done + k] = scores[done + k] * scale;
      }
    }
  }
#elif defined(DARTREE_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (hd % BLOCK == 0) {
      for (; done + 4 <= p; done += 4) {
        dot4_keys_avx2(q, kbase + done * hd, hd, scores + done);
        for (int k = 0; k < 4; ++k) scores[done + k] = scores[done + k] * scale;
      }
    }
  }
#endif
  return done;
}

template <typename T>
inline T dot_heads(const T* a, const T* b, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (n % BLOCK == 0) return dot_fixed_avx512(a, b, n);
  }
#elif defined(DARTREE_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (n % BLOCK == 0) return dot_fixed_avx2(a, b, n);
  }
#endif
  return dot_fixed(a, b, n);
}

template <typename T>
inline void rmsnorm_row(const T* x, const T* w, T* y, int64_t H, double eps) {
  const T inv = T(1) / std::sqrt(dot_fixed(x, x, H) / T(H) + T(eps));
  for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (x[i] * inv);
}

// 2^n for n in the normal exponent range, built from its bits
template <typename T>
inline T pow2(int64_t n) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  constexpr int mantissa_bits = std::numeric_limits<T>::digits - 1;     // 23 / 52
  constexpr int64_t bias = std::numeric_limits<T>::max_exponent - 1;    // 127 / 1023
  const Bits bits = (Bits)(n + bias) << mantissa_bits;
  T f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// exp_neg's constants, one list for the scalar code and every vector path (their bits must agree):
// log2(e), ln 2 split high / low for the Cody-Waite reduction, and the degree-11 Taylor coefficients
// in Horner order (1/11! first)
constexpr double EXP_LOG2E = 1.4426950408889634, EXP_LN2_HI = -0.693145751953125, EXP_LN2_LO = -1.4286068203094172e-06;
constexpr double EXP_TAYLOR[] = {1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0,
                                 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};

// exp(x) for x <= 0 from correctly rounded operations only (Cody-Waite reduction, degree-11 Taylor
// polynomial in Horner form), so that a vectorised loop and its scalar tail agree bit for bit.
// Relative error ~1e-7 in float, ~1e-13 in double: well inside the fp32 summation tolerance.
template <typename T>
inline T exp_neg(T x) {
  const T lo_limit = sizeof(T) == 4 ? T(-87.0) : T(-708.0);
  x = x < lo_limit ? lo_limit : x;
  const T n = std::nearbyint(x * T(EXP_LOG2E));
  const T r = std::fma(n, T(EXP_LN2_LO), std::fma(n, T(EXP_LN2_HI), x));
  T p = T(EXP_TAYLOR[0]);
  for (size_t i = 1; i < std::size(EXP_TAYLOR); ++i) p = std::fma(p, r, T(EXP_TAYLOR[i]));
  return p * pow2<T>((int64_t)n);  // an exact scaling: n >= -126 (float) / -1022 (double), 2^n is normal
}

template <typename T>
inline T silu(T g) {
  // g * sigmoid(g), with exp only of non-positive arguments: e = exp(-|g|), then g / (1 + e) where
  // g >= 0 and (g * e) / (1 + e) where g < 0
  const T e = exp_neg(g >= T(0) ? -g : g);
  return (g >= T(0) ? g : g * e) / (T(1) + e);
}

#if defined(__AVX512F__)
// exp_neg and silu on 16 floats: the scalar code's operations, lane by lane (roundscale to nearest
// is nearbyint, the power of two is built from the same bits), so a lane gives the scalar bits.
inline __m512 exp_neg16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(float(-87.0)));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(float(EXP_LOG2E))),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(float(EXP_LN2_LO)), _mm512_fmadd_ps(n, _mm512_set1_ps(float(EXP_LN2_HI)), x));
  __m512 p = _mm512_set1_ps(float(EXP_TAYLOR[0]));
  for (size_t i = 1; i < std::size(EXP_TAYLOR); ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(float(EXP_TAYLOR[i])));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

inline __m512 silu16(__m512 g) {
  const __mmask16 pos = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_GE_OQ);
  const __m512 neg_abs = _mm512_mask_sub_ps(g, pos, _mm512_setzero_ps(), g);  // -g where g >= 0, else g
  const __m512 e = exp_neg16(neg_abs);
  const __m512 num = _mm512_mask_mov_ps(_mm512_mul_ps(g, e), pos, g);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}
#endif

#if defined(__AVX512F__)
// weighted_values for float over R registers of the head (dims d0 .. d0 + 16 R), its accumulators kept in
// registers: the committed values in one plain loop, then the visible new rows
template <int R, int64_t HD = 0>  // HD: the head's width where known when compiled (0: hd)
inline void weighted_values16(const float* s, const float* vbase, int64_t hd, int64_t d0, int64_t p, const uint8_t* seen,
                              int64_t W, float total, float* o) {
  __m512 acc[R];
  for (int c = 0; c < R; ++c) acc[c] = _mm512_setzero_ps();
  auto add = [&](float weight, const float* v) {
    const __m512 pi = _mm512_set1_ps(weight);
    for (int c = 0; c < R; ++c) acc[c] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(v + 16 * c), acc[c]);
  };
  const int64_t stride = HD ? HD : hd;
  for (int64_t pos = 0; pos < p; ++pos) add(s[pos], vbase + pos * stride + d0);
  for (int64_t j = 0, i = p; j < W; ++j)
    if (seen[j]) add(s[i++], vbase + (p + j) * stride + d0);
  const __m512 t = _mm512_set1_ps(total);
  for (int c = 0; c < R; ++c) _mm512_storeu_ps(o + d0 + 16 * c, _mm512_div_ps(acc[c], t));
}
#endif

#if defined(DARTREE_AVX2)
// exp_neg16, silu16 and weighted_values16 on 8 lanes
inline __m256 exp_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(float(-87.0)));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(float(EXP_LOG2E))),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(float(EXP_LN2_LO)), _mm256_fmadd_ps(n, _mm256_set1_ps(float(EXP_LN2_HI)), x));
  __m256 p = _mm256_set1_ps(float(EXP_TAYLOR[0]));
  for (size_t i = 1; i < std::size(EXP_TAYLOR); ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(float(EXP_TAYLOR[i])));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline __m256 silu8(__m256 g) {
  const __m256 pos = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
  const __m256 neg_abs = _mm256_blendv_ps(g, _mm256_sub_ps(_mm256_setzero_ps(), g), pos);  // -g where g >= 0
  const __m256 e = exp_neg8(neg_abs);
  const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(g, e), g, pos);
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// weighted_values16 on 8 lanes: R registers of the head (dims d0 .. d0 + 8 R)
template <int R, int64_t HD = 0>  // HD: the head's width where known when compiled (0: hd)
inline void weighted_values8(const float* s, const float* vbase, int64_t hd, int64_t d0, int64_t p, const uint8_t* seen,
                             int64_t W, float total, float* o) {
  __m256 acc[R];
  for (int c = 0; c < R; ++c) acc[c] = _mm256_setzero_ps();
  auto add = [&](float weight, const float* v) {
    const __m256 pi = _mm256_set1_ps(weight);
    for (int c = 0; c < R; ++c) acc[c] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(v + 8 * c), acc[c]);
  };
  const int64_t stride = HD ? HD : hd;
  for (int64_t pos = 0; pos < p; ++pos) add(s[pos], vbase + pos * stride + d0);
  for (int64_t j = 0, i = p; j < W; ++j)
    if (seen[j]) add(s[i++], vbase + (p + j) * stride + d0);
  const __m256 t = _mm256_set1_ps(total);
  for (int c = 0; c < R; ++c) _mm256_storeu_ps(o + d0 + 8 * c, _mm256_div_ps(acc[c], t));
}
#endif

// o[d] = (sum over the query's keys in cache order - the committed [0, p), then its visible new rows p + j - of
// s_i * v_i[d], one fma each from zero) / total. Each d is a chain of its own, so a vector path may take the head
// in parts (each part a pass over the values) and still give every d the scalar chain's bits.
template <typename T>
inline void weighted_values(const T* s, const T* vbase, int64_t p, const uint8_t* seen, int64_t W, T total, T* o, T* acc,
                            int64_t hd) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (hd == 128) return weighted_values16<8, 128>(s, vbase, hd, 0, p, seen, W, total, o);
    if (hd == 64) return weighted_values16<4, 64>(s, vbase, hd, 0, p, seen, W, total, o);
    if (hd % 64 == 0) {
      for (int64_t d0 = 0; d0 < hd; d0 += 64) weighted_values16<4>(s, vbase, hd, d0, p, seen, W, total, o);
      return;
    }
  }
#elif defined(DARTREE_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    // a 128-wide head in one pass although its 16 accumulators spill: two passes read the values twice from L2,
    // measured slower (6.4-6.7 against 5.3-5.4 ns a key at 240 keys, an AMD EPYC Zen 3)
    if (hd == 128) return weighted_values8<16, 128>(s, vbase, hd, 0, p, seen, W, total, o);
    if (hd == 64) return weighted_values8<8, 64>(s, vbase, hd, 0, p, seen, W, total, o);
    if (hd % 64 == 0) {
      for (int64_t d0 = 0; d0 < hd; d0 += 64) weighted_values8<8>(s, vbase, hd, d0, p, seen, W, total, o);
      return;
    }
  }
#endif
  for (int64_t d = 0; d < hd; ++d) acc[d] = 0;
  auto add = [&](T weight, const T* v) {
    for (int64_t d = 0; d < hd; ++d) acc[d] = std::fma(weight, v[d], acc[d]);
  };
  for (int64_t pos = 0; pos < p; ++pos) add(s[pos], vbase + pos * hd);
  for (int64_t j = 0, i = p; j < W; ++j)
    if (seen[j]) add(s[i++], vbase + (p + j) * hd);
  for (int64_t d = 0; d < hd; ++d) o[d] = acc[d] / total;
}

// silu(gate) * up over one row of I values
template <typename T>
inline void swiglu_row(const T* gate, const T* up, T* out, int64_t I) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    for (; i + BLOCK <= I; i += BLOCK)
      _mm512_storeu_ps(out + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(gate + i)), _mm512_loadu_ps(up + i)));
  }
#elif defined(DARTREE_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    for (; i + 8 <= I; i += 8)
      _mm256_storeu_ps(out + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < I; ++i) out[i] = silu(gate[i]) * up[i];
}

// exp_neg in place over n values (the softmax numerators): 16 lanes at a time where there are
// vectors, the scalar code for the rest (the same bits either way)
template <typename T>
inline void exp_neg_inplace(T* s, int64_t n, T shift) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 sh = _mm512_set1_ps(shift);
    for (; i + BLOCK <= n; i += BLOCK) _mm512_storeu_ps(s + i, exp_neg16(_mm512_sub_ps(_mm512_loadu_ps(s + i), sh)));
  }
#elif defined(DARTREE_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(s + i), sh)));
  }
#endif
  for (; i < n; ++i) s[i] = exp_neg(s[i] - shift);
}

// sum of n values in a fixed order that depends only on n: 16 lanes (value i into lane i mod 16),
// then the lanes pairwise (j with j + 8, + 4, + 2, + 1)
template <typename T>
inline T sum_fixed(const T* s, int64_t n) {
  T lanes[BLOCK];
  for (int j = 0; j < BLOCK; ++j) lanes[j] = T(0);
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + BLOCK <= n; i += BLOCK) acc = _mm512_add_ps(acc, _mm512_loadu_ps(s + i));
    _mm512_storeu_ps(lanes, acc);
  }
#elif defined(DARTREE_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (; i + BLOCK <= n; i += BLOCK) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(s + i));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(s + i + 8));
    }
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
  }
#endif
  for (; i + BLOCK <= n; i += BLOCK)
    for (int j = 0; j < BLOCK; ++j) lanes[j] = lanes[j] + s[i + j];
  for (int j = 0; i + j < n; ++j) lanes[j] = lanes[j] + s[i + j];
  for (int w = BLOCK / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lanes[j] = lanes[j] + lanes[j + w];
  return lanes[0];
}

}  // namespace

// ---------------------------------------------------------------- entry points
torch::Tensor pack_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_weight: a [N, K] weight");
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + BLOCK - 1) / BLOCK;
  auto padded = torch::zeros({blocks * BLOCK, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({blocks, BLOCK, K}).transpose(1, 2).contiguous();  // [blocks, K, 16]
}

// y[M, N] = x[M, K] @ W.T (+ residual), W packed by pack_weight.
torch::Tensor product(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous() && x.scalar_type() == packed.scalar_type(),
              "product: contiguous x [M, K] and packed weight of one dtype");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) == K, "product: K mismatch");
  auto y = torch::empty({M, N}, x.options());
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res) TORCH_CHECK(residual->is_contiguous() && residual->size(0) == M && residual->size(1) == N, "product: residual shape");
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "product", [&] {
    product_impl<scalar_t>(x.data_ptr<scalar_t>(), M, K, packed.data_ptr<scalar_t>(), N, y.data_ptr<scalar_t>(),
                           has_res ? residual->data_ptr<scalar_t>() : nullptr);
  });
  return y;
}

torch::Tensor rmsnorm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "rmsnorm: contiguous inputs");
  const int64_t H = x.size(-1), M = x.numel() / H;
  auto y = torch::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rmsnorm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, M, 16, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) rmsnorm_row(xp + r * H, wp, yp + r * H, H, eps);
    });
  });
  return y;
}

// qkv [M, (nh + 2 nkv) hd] -> q [M, nh hd] rotated; rotated k and v written to cache[slot, :, pos].
// cos/sin [M, hd] (Hugging Face's tables at each row's position); q_norm/k_norm [hd] (Qwen3) or empty.
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor q_norm, torch::Tensor k_norm,
                         double eps, int64_t nh, int64_t nkv, torch::Tensor kcache, torch::Tensor vcache, torch::Tensor slots,
                         torch::Tensor cache_pos) {
  const int64_t M = qkv.size(0), hd = cos.size(1), T = kcache.size(2);
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && kcache.is_contiguous() && vcache.is_contiguous(),
              "rope_store: contiguous inputs");
  TORCH_CHECK(qkv.size(1) == (nh + 2 * nkv) * hd && hd % 2 == 0, "rope_store: qkv width");
  auto q = torch::empty({M, nh * hd}, qkv.options());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = cache_pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) TORCH_CHECK(sp[r] >= 0 && sp[r] < kcache.size(0) && pp[r] >= 0 && pp[r] < T, "rope_store: slot/position out of the cache");
  const bool qk_norm = q_norm.numel() > 0;
  AT_DISPATCH_FLOATING_TYPES(qkv.scalar_type(), "rope_store", [&] {
    const scalar_t *src = qkv.data_ptr<scalar_t>(), *cp = cos.data_ptr<scalar_t>(), *snp = sin.data_ptr<scalar_t>();
    const scalar_t* qn = qk_norm ? q_norm.data_ptr<scalar_t>() : nullptr;
    const scalar_t* kn = qk_norm ? k_norm.data_ptr<scalar_t>() : nullptr;
    scalar_t *qp = q.data_ptr<scalar_t>(), *kc = kcache.data_ptr<scalar_t>(), *vc = vcache.data_ptr<scalar_t>();
    const int64_t width = (nh + 2 * nkv) * hd, half = hd / 2;
    at::parallel_for(0, M * (nh + nkv), 8, [&](int64_t a, int64_t b) {
      std::vector<scalar_t> normed(hd);
      for (int64_t t = a; t < b; ++t) {
        const int64_t r = t / (nh + nkv), h = t % (nh + nkv);
        const bool is_q = h < nh;
        const scalar_t* in = src + r * width + h * hd;
        const scalar_t* c = cp + r * hd;
        const scalar_t* s = snp + r * hd;
        if (qk_norm) {
          rmsnorm_row(in, is_q ? qn : kn, normed.data(), hd, eps);
          in = normed.data();
        }
        scalar_t* out = is_q ? qp + r * nh * hd + h * hd : kc + ((sp[r] * nkv + (h - nh)) * T + pp[r]) * hd;
        for (int64_t i = 0; i < half; ++i) {
          const scalar_t a0 = in[i] * c[i], a1 = in[i + half] * s[i];
          out[i] = a0 - a1;
          const scalar_t b0 = in[i + half] * c[i + half], b1 = in[i] * s[i + half];
          out[i + half] = b0 + b1;
        }
        if (!is_q) {
          const scalar_t* v = src + r * width + (nh + nkv) * hd + (h - nh) * hd;
          scalar_t* vo = vc + ((sp[r] * nkv + (h - nh)) * T + pp[r]) * hd;
          for (int64_t i = 0; i < hd; ++i) vo[i] = v[i];
        }
      }
    });
  });
  return q;
}

// Whether attention takes the queries that share a cache together (the per-query path stays for the
// tests that compare the two; both give the same bits)
bool grouped_attention = true;
void set_grouped_attention(bool on) { grouped_attention = on; }

// The largest of s[0, n) (-inf for none), NaNs passed over as ``top = s > top ? s : top`` passes over them one by
// one: lane-wise where there are vectors. A maximum is exact in any order; only a zero's sign could depend on the
// order, and the numerators exp(s - top) are the same for either sign of a zero top.
template <typename T>
inline T max_scores(const T* s, int64_t n) {
  T top = -std::numeric_limits<T>::infinity();
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    if (n >= 16) {
      __m512 m = _mm512_set1_ps(top);
      for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(s + i), m);  // max_ps(a, b): a > b ? a : b
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, m);
      for (int j = 0; j < 16; ++j) top = lanes[j] > top ? lanes[j] : top;
    }
  }
#elif defined(DARTREE_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (n >= 8) {
      __m256 m = _mm256_set1_ps(top);
      for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(s + i), m);  // max_ps(a, b): a > b ? a : b
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, m);
      for (int j = 0; j < 8; ++j) top = lanes[j] > top ? lanes[j] : top;
    }
  }
#endif
  for (; i < n; ++i) top = s[i] > top ? s[i] : top;
  return top;
}

// The softmax numerators of one query, in place: its keys' scores in cache order (the committed [0, p), then its
// visible new rows p + j) times scale, those before ``blocked`` already in s (scored in blocks by the caller), the
// rest by dot_heads; then exp(score - max) by exp_neg_inplace. Returns their sum (sum_fixed); ``n``: the keys.
// Every attention path takes a query's numerators here, so they agree bit for bit.
template <typename T>
inline T softmax_numerators(T* s, const T* q, const T* kbase, int64_t hd, int64_t p, int64_t W, const uint8_t* seen,
                            int64_t blocked, T scale, int64_t& n) {
  n = blocked;
  T top = max_scores(s, blocked);
  auto score = [&](int64_t pos) {
    s[n] = dot_heads(q, kbase + pos * hd, hd) * scale;
    top = s[n] > top ? s[n] : top;
    ++n;
  };
  for (int64_t pos = blocked; pos < p; ++pos) score(pos);
  for (int64_t j = 0; j < W; ++j)
    if (seen[j]) score(p + j);
  exp_neg_inplace(s, n, top);
  return sum_fixed(s, n);
}

#if defined(__AVX512F__) || defined(DARTREE_AVX2)
// A task of the grouped attention: rows [r0, r1) of one run (one slot, one committed length), one KV head, and
// its queries first .. first + count, query q being row r0 + q / group, head kvh * group + q % group.
struct AttentionTask {
  int64_t r0, r1, kvh, first, count;
};

// The runs of rows that share a slot and a committed length, each KV head's queries in tasks of ``per_task``.
inline std::vector<AttentionTask> attention_tasks(const int64_t* sp, const int64_t* pp, int64_t M, int64_t nkv,
                                                  int64_t group, int64_t per_task) {
  std::vector<AttentionTask> tasks;
  for (int64_t r0 = 0; r0 < M;) {
    int64_t r1 = r0 + 1;
    while (r1 < M && sp[r1] == sp[r0] && pp[r1] == pp[r0]) ++r1;
    const int64_t queries = (r1 - r0) * group;
    for (int64_t kvh = 0; kvh < nkv; ++kvh)
      for (int64_t f = 0; f < queries; f += per_task) tasks.push_back({r0, r1, kvh, f, std::min(per_task, queries - f)});
    r0 = r1;
  }
  return tasks;
}

// Where a task's query i reads its q, writes its output and finds the new rows it sees.
inline void locate_queries(const AttentionTask& task, int64_t group, int64_t nh, int64_t hd, int64_t W, const float* qp,
                           float* op, const uint8_t* vis, const float** qrow, float** orow, const uint8_t** seen) {
  for (int64_t i = 0; i < task.count; ++i) {
    const int64_t q = task.first + i, r = task.r0 + q / group, h = task.kvh * group + q % group;
    qrow[i] = qp + r * nh * hd + h * hd;
    orow[i] = op + r * nh * hd + h * hd;
    seen[i] = vis + r * W;
  }
}
#endif

#if defined(__AVX512F__)
// attention for float with head_dim 16 C, queries taken together: one task holds up to 24 / C (row, head)
// queries that share a slot, a committed length p and a KV head (a tree's rows, a prompt chunk's), so each
// block of 16 committed keys and each committed value is read once for all of them while it sits in L1,
// instead of once per query. Every query's arithmetic is the per-query path's, operation for operation:
// its committed keys' scores by dot16_keys_avx512 in blocks of 16, the rest by dot_heads, the same
// maximum, exp_neg_inplace and sum_fixed, then its values accumulated in cache order (the committed ones,
// then its own visible new rows) by the same fmas from zero and divided by the total: the same bits.
template <int C>
void attention_grouped(const float* qp, const float* kc, const float* vc, float* op, const int64_t* sp, const int64_t* pp,
                       const uint8_t* vis, int64_t M, int64_t nh, int64_t nkv, int64_t T, int64_t W, float scale) {
  constexpr int64_t hd = 16 * C, QC = 24 / C;
  const int64_t group = nh / nkv;
  const std::vector<AttentionTask> tasks = attention_tasks(sp, pp, M, nkv, group, QC);
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t a, int64_t b) {
    std::vector<float> scores;
    for (int64_t t = a; t < b; ++t) {
      const AttentionTask& task = tasks[t];
      const int64_t p = pp[task.r0], n_max = p + W;
      const float* kbase = kc + (sp[task.r0] * nkv + task.kvh) * T * hd;
      const float* vbase = vc + (sp[task.r0] * nkv + task.kvh) * T * hd;
      scores.resize(QC * n_max);
      const float* qrow[QC];
      float* orow[QC];
      const uint8_t* seen[QC];
      float total[QC];
      locate_queries(task, group, nh, hd, W, qp, op, vis, qrow, orow, seen);
      int64_t blocked = 0;
      for (; blocked + 16 <= p; blocked += 16)  // a block of 16 keys, read once for every query of the task
        for (int64_t i = 0; i < task.count; ++i) {
          float* s = scores.data() + i * n_max + blocked;
          dot16_keys_avx512(qrow[i], kbase + blocked * hd, hd, s);
          for (int k = 0; k < 16; ++k) s[k] = s[k] * scale;
        }
      for (int64_t i = 0; i < task.count; ++i) {
        int64_t n;
        total[i] = softmax_numerators(scores.data() + i * n_max, qrow[i], kbase, hd, p, W, seen[i], blocked, scale, n);
      }
      __m512 acc[QC][C];
#pragma GCC unroll 24
      for (int64_t i = 0; i < QC; ++i)
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
      for (int64_t pos = 0; pos < p; ++pos) {  // the committed values, each read once for every query
        __m512 v[C];
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vbase + pos * hd + 16 * c);
#pragma GCC unroll 24
        for (int64_t i = 0; i < QC; ++i) {
          if (i < task.count) {
            const __m512 pi = _mm512_set1_ps(scores[i * n_max + pos]);
#pragma GCC unroll 8
            for (int c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(pi, v[c], acc[i][c]);
          }
        }
      }
#pragma GCC unroll 24
      for (int64_t i = 0; i < QC; ++i) {
        if (i >= task.count) continue;
        int64_t k = p;  // the query's own visible new rows, in cache order
        for (int64_t j = 0; j < W; ++j) {
          if (!seen[i][j]) continue;
          const __m512 pi = _mm512_set1_ps(scores[i * n_max + k++]);
#pragma GCC unroll 8
          for (int c = 0; c < C; ++c) acc[i][c] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(vbase + (p + j) * hd + 16 * c), acc[i][c]);
        }
        const __m512 tv = _mm512_set1_ps(total[i]);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(orow[i] + 16 * c, _mm512_div_ps(acc[i][c], tv));
      }
    }
  });
}
#elif defined(DARTREE_AVX2)
// attention for float with head_dim 8 V (64 or 128), queries taken together: one task holds up to QC (row, head)
// queries that share a slot, a committed length p and a KV head, and walks the committed keys and values in
// blocks of KB positions (a block of keys or values, 4 or 8 KiB, stays in L1 while every query of the task
// reads it, instead of each query streaming the whole cache from L2). Every query's arithmetic is the per-query
// path's, operation for operation: its committed keys' scores by dot4_keys_avx2 in fours (score_committed), the
// rest by dot_heads, the same maximum, exp_neg_inplace and sum_fixed; its values accumulated in cache order
// (the committed ones, then its own visible new rows) by the same fmas from zero, the accumulator kept in
// memory between blocks, 8 floats of the head at a time (each float's own chain), and divided by the total:
// the same bits.
template <int V>
void attention_grouped(const float* qp, const float* kc, const float* vc, float* op, const int64_t* sp, const int64_t* pp,
                       const uint8_t* vis, int64_t M, int64_t nh, int64_t nkv, int64_t T, int64_t W, float scale) {
  constexpr int64_t hd = 8 * V, QC = 8, KB = 16;
  const int64_t group = nh / nkv;
  // Fewer queries a task where there are few in all (about two tasks a thread), so that every thread gets some;
  // which task takes a query never changes its bits.
  const int64_t per_task = std::max<int64_t>(1, std::min<int64_t>(QC, M * nh / (2 * at::get_num_threads())));
  const std::vector<AttentionTask> tasks = attention_tasks(sp, pp, M, nkv, group, per_task);
  at::parallel_for(0, (int64_t)tasks.size(), 1, [&](int64_t a, int64_t b) {
    std::vector<float> scores;
    alignas(32) float acc[QC][hd];
    for (int64_t t = a; t < b; ++t) {
      const AttentionTask& task = tasks[t];
      const int64_t p = pp[task.r0], n_max = p + W, blocked = p / 4 * 4;  // score_committed's fours
      const float* kbase = kc + (sp[task.r0] * nkv + task.kvh) * T * hd;
      const float* vbase = vc + (sp[task.r0] * nkv + task.kvh) * T * hd;
      scores.resize(QC * n_max);
      const float* qrow[QC];
      float* orow[QC];
      const uint8_t* seen[QC];
      float total[QC];
      locate_queries(task, group, nh, hd, W, qp, op, vis, qrow, orow, seen);
      for (int64_t k0 = 0; k0 < blocked; k0 += KB)  // a block of keys, read once from L2 for every query of the task
        for (int64_t i = 0; i < task.count; ++i)
          for (int64_t k = k0; k < std::min(k0 + KB, blocked); k += 4) {
            float* s = scores.data() + i * n_max + k;
            dot4_keys_avx2(qrow[i], kbase + k * hd, hd, s);
            for (int j = 0; j < 4; ++j) s[j] = s[j] * scale;
          }
      for (int64_t i = 0; i < task.count; ++i) {
        int64_t n;
        total[i] = softmax_numerators(scores.data() + i * n_max, qrow[i], kbase, hd, p, W, seen[i], blocked, scale, n);
        for (int64_t d = 0; d < hd; ++d) acc[i][d] = 0.0f;
      }
      for (int64_t k0 = 0; k0 < p; k0 += KB) {  // a block of committed values, likewise
        const int64_t k1 = std::min(k0 + KB, p);
        for (int64_t i = 0; i < task.count; ++i) {
          const float* s = scores.data() + i * n_max;
          for (int c0 = 0; c0 < V; c0 += 8) {
            constexpr int HALF = V < 8 ? V : 8;
            __m256 a8[HALF];
            for (int c = 0; c < HALF; ++c) a8[c] = _mm256_load_ps(acc[i] + 8 * (c0 + c));
            for (int64_t pos = k0; pos < k1; ++pos) {
              const __m256 pi = _mm256_set1_ps(s[pos]);
              for (int c = 0; c < HALF; ++c)
                a8[c] = _mm256_fmadd_ps(pi, _mm256_loadu_ps(vbase + pos * hd + 8 * (c0 + c)), a8[c]);
            }
            for (int c = 0; c < HALF; ++c) _mm256_store_ps(acc[i] + 8 * (c0 + c), a8[c]);
          }
        }
      }
      for (int64_t i = 0; i < task.count; ++i) {
        const float* s = scores.data() + i * n_max;
        const __m256 tv = _mm256_set1_ps(total[i]);
        for (int c = 0; c < V; ++c) {
          __m256 a8 = _mm256_load_ps(acc[i] + 8 * c);
          int64_t k = p;  // the query's own visible new rows, in cache order
          for (int64_t j = 0; j < W; ++j) {
            if (!seen[i][j]) continue;
            a8 = _mm256_fmadd_ps(_mm256_set1_ps(s[k++]), _mm256_loadu_ps(vbase + (p + j) * hd + 8 * c), a8);
          }
          _mm256_storeu_ps(orow[i] + 8 * c, _mm256_div_ps(a8, tv));
        }
      }
    }
  });
}
#endif

// Row r (slot s, past p) attends to cache positions [0, p) of slot s and to p + j for each j with
// visible[r, j] != 0 (its new rows: a prompt chunk's causal triangle, a tree's ancestors).
torch::Tensor attention(torch::Tensor q, torch::Tensor kcache, torch::Tensor vcache, torch::Tensor slots, torch::Tensor past,
                        torch::Tensor visible, int64_t nh, double scale) {
  const int64_t M = q.size(0), nkv = kcache.size(1), T = kcache.size(2), hd = kcache.size(3), W = visible.size(1);
  TORCH_CHECK(q.is_contiguous() && visible.is_contiguous() && visible.scalar_type() == torch::kUInt8, "attention: inputs");
  TORCH_CHECK(nh % nkv == 0 && q.size(1) == nh * hd, "attention: head counts");
  auto out = torch::empty_like(q);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = past.data_ptr<int64_t>();
  const uint8_t* vis = visible.data_ptr<uint8_t>();
  for (int64_t r = 0; r < M; ++r) TORCH_CHECK(pp[r] >= 0 && pp[r] + W <= T && sp[r] >= 0 && sp[r] < kcache.size(0), "attention: row outside the cache");
#if defined(__AVX512F__) || defined(DARTREE_AVX2)
  bool grouped = q.scalar_type() == torch::kFloat && (hd == 64 || hd == 128) && grouped_attention;
#if defined(DARTREE_AVX2)
  // Fewer than 8 queries a thread (a one-row step's 9 heads on 2 threads) keep the per-query path on AVX2: one
  // query a task spreads the cache's cold reads over the threads, where grouped tasks of 3 left a thread idle
  // (an AMD EPYC Zen 3; scripts/attention_ab.py measures both paths side by side).
  grouped = grouped && M * nh >= 8 * at::get_num_threads();
#endif
  if (grouped) {
    const float *qp = q.data_ptr<float>(), *kc = kcache.data_ptr<float>(), *vc = vcache.data_ptr<float>();
    // the template argument: the head's vector registers (16 floats each on AVX-512, 8 on AVX2)
    constexpr int64_t lanes = LANES_PER_REGISTER;
    if (hd == 64) attention_grouped<64 / lanes>(qp, kc, vc, out.data_ptr<float>(), sp, pp, vis, M, nh, nkv, T, W, float(scale));
    else attention_grouped<128 / lanes>(qp, kc, vc, out.data_ptr<float>(), sp, pp, vis, M, nh, nkv, T, W, float(scale));
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attention", [&] {
    const scalar_t *qp = q.data_ptr<scalar_t>(), *kc = kcache.data_ptr<scalar_t>(), *vc = vcache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t group = nh / nkv;
    at::parallel_for(0, M * nh, 1, [&](int64_t a, int64_t b) {
      std::vector<scalar_t> scores(pp[a / nh] + W);
      std::vector<scalar_t> acc(hd);
      for (int64_t t = a; t < b; ++t) {
        const int64_t r = t / nh, h = t % nh, kvh = h / group, p = pp[r];
        const uint8_t* seen = vis + r * W;
        // the row's keys in cache order: the committed [0, p), then its visible new rows p + j
        const scalar_t* qrow = qp + r * nh * hd + h * hd;
        const scalar_t* kbase = kc + (sp[r] * nkv + kvh) * T * hd;
        const scalar_t* vbase = vc + (sp[r] * nkv + kvh) * T * hd;
        if ((int64_t)scores.size() < p + W) scores.resize(p + W);
        const int64_t blocked = score_committed(qrow, kbase, hd, p, scalar_t(scale), scores.data());
        int64_t n;
        const scalar_t total = softmax_numerators(scores.data(), qrow, kbase, hd, p, W, seen, blocked, scalar_t(scale), n);
        scalar_t* o = op + r * nh * hd + h * hd;
        weighted_values(scores.data(), vbase, p, seen, W, total, o, acc.data(), hd);
      }
    });
  });
  return out;
}

// gu [M, 2I] (gate then up) -> silu(gate) * up [M, I]
torch::Tensor swiglu(torch::Tensor gu) {
  TORCH_CHECK(gu.is_contiguous() && gu.size(1) % 2 == 0, "swiglu: contiguous [M, 2I]");
  const int64_t M = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({M, I}, gu.options());
  AT_DISPATCH_FLOATING_TYPES(gu.scalar_type(), "swiglu", [&] {
    const scalar_t* g = gu.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, M, 1, [&](int64_t a, int64_t b) {
      for (int64_t r = a; r < b; ++r) {
        swiglu_row(g + r * 2 * I, g + r * 2 * I + I, yp + r * I, I);
      }
    });
  });
  return y;
}

// Whether this build splits work over threads: without -fopenmp ATen's parallel_for (an inline
// omp pragma) runs every kernel on one thread.
bool built_with_openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

#if !defined(DARTREE_NO_MODULE)  // forward_kernels.cpp compiles this file into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Each kernel lets go of the GIL while it computes (as torch's own operators do), so that another
  // Python thread (the server's HTTP loop streaming tokens) runs during a forward rather than
  // between its kernels.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("pack_weight", &pack_weight, "pack a [N, K] weight into [N/16, K, 16] blocks", release());
  m.def("product", &product, "x @ W.T (+ residual) on a packed weight, row-invariant", py::arg("x"), py::arg("packed"),
        py::arg("n"), py::arg("residual") = py::none(), release());
  m.def("rmsnorm", &rmsnorm, "RMSNorm over the last dimension, row-invariant", release());
  m.def("rope_store", &rope_store, "RoPE on q and k, k and v written to the KV cache", release());
  m.def("attention", &attention, "attention over a slot's cache with per-row visibility, row-invariant", release());
  m.def("set_grouped_attention", &set_grouped_attention, "attention of queries sharing a cache together (default) or one by one");
  m.def("swiglu", &swiglu, "silu(gate) * up", release());
  m.def("built_with_openmp", &built_with_openmp, "whether the kernels split their work over torch's threads");
}
#endif
