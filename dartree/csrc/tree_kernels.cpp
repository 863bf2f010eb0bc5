// DARTree's supertree growth (trees/dartree.py ``grow_supertree``) in one call: every depth's corrected
// logits of the frontier's candidates, their log-softmax, the beam's top-W over (branch, candidate), the
// early stop under the deferred top-B, and the correction head's step for the kept children, without a
// framework call per operation. The Domino GRU head and DSpark's Markov head are written out here; the
// tree that comes out is the Python builder's on the same logits (tests/test_tree_kernels.py, float64).
//
// Shapes (D depths, K candidates a depth, S the head's state size, R its rank):
//   cand_tokens [D, K] int64 draft ids, cand_base [D, K] their base logits;
//   out_rows_t [D, R, K]: the head's output rows of the candidates, transposed;
//   table [V, X]: what the head's step needs of a token, by draft id (Domino: the GRU's input projection
//     of the token's embedding, X = 3S; Markov: the new state itself, W1 of the token, X = S = R);
//   Domino only: hidden_proj [D, R] (W_z z_d), w_state_t [S, R] (W_s transposed), w_hh_t [S, 3S] (the GRU's
//     hidden weights transposed);
//   root [S]: the root's state.
// Returns tokens, parents (tree rows: 0 is the root, node i is row i + 1), depths (1-based) and scores
// (cumulative log-probabilities), in placement order.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

enum Head : int64_t { NONE = 0, DOMINO = 1, MARKOV = 2 };

// y[f, :] (+)= x[f, :] @ WT for F rows: WT [I, J] row-major (a weight stored transposed), the sum over i in
// order, vectorised over j; each row of WT is read once for all F rows (it stays in L1 across them)
template <typename T>
inline void rows_times(const T* x, int64_t F, int64_t I, const T* wt, int64_t J, T* y, bool accumulate) {
  if (!accumulate) std::fill(y, y + F * J, T(0));
  for (int64_t i = 0; i < I; ++i) {
    const T* w = wt + i * J;
    for (int64_t f = 0; f < F; ++f) {
      const T a = x[f * I + i];
      T* out = y + f * J;
      for (int64_t j = 0; j < J; ++j) out[j] += a * w[j];
    }
  }
}

#if defined(__AVX512F__) || defined(__AVX2__)
// rows_times for float32 with the outputs held in registers while the rows of WT stream by: tiles of FB rows x two
// vectors of columns (AVX-512: 12 rows x 32 columns, 24 of its 32 registers; AVX2: 6 rows x 16 columns, 12 of
// its 16). Each output is the same sum as rows_times' (over i in order, a product then a sum, no fused
// multiply-add), so the same bits, several times faster: rows_times stores y back for every i (measured on an
// AMD EPYC Zen 3, the Domino head's GRU product 12 x 256 x 768: the compiled supertree 1.75 -> 0.66 ms).
#if defined(__AVX512F__)
struct Lanes {
  using V = __m512;
  static constexpr int N = 16, FB = 12;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
};
#else
struct Lanes {
  using V = __m256;
  static constexpr int N = 8, FB = 6;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
};
#endif

// Columns j0..j1 (whole tiles of 2N) of the product.
inline void rows_times_tiles(const float* x, int64_t F, int64_t I, const float* wt, int64_t J, float* y, bool accumulate,
                             int64_t j_begin, int64_t j_end) {
  using L = Lanes;
  constexpr int FB = L::FB, N = L::N;
  for (int64_t f0 = 0; f0 < F; f0 += FB) {
    const int nf = (int)std::min<int64_t>(FB, F - f0);
    for (int64_t j0 = j_begin; j0 < j_end; j0 += 2 * N) {
      L::V acc[FB][2];
#pragma GCC unroll 12
      for (int f = 0; f < FB; ++f) {
        if (f < nf) {
          float* out = y + (f0 + f) * J + j0;
          acc[f][0] = accumulate ? L::load(out) : L::zero();
          acc[f][1] = accumulate ? L::load(out + N) : L::zero();
        }
      }
      for (int64_t i = 0; i < I; ++i) {
        const L::V w0 = L::load(wt + i * J + j0), w1 = L::load(wt + i * J + j0 + N);
#pragma GCC unroll 12
        for (int f = 0; f < FB; ++f) {
          if (f < nf) {
            const L::V a = L::set1(x[(f0 + f) * I + i]);
            acc[f][0] = L::add(acc[f][0], L::mul(a, w0));
            acc[f][1] = L::add(acc[f][1], L::mul(a, w1));
          }
        }
      }
#pragma GCC unroll 12
      for (int f = 0; f < FB; ++f) {
        if (f < nf) {
          float* out = y + (f0 + f) * J + j0;
          L::store(out, acc[f][0]);
          L::store(out + N, acc[f][1]);
        }
      }
    }
  }
}

// Above this many multiply-adds a product called outside a parallel region (one request's tree, grown alone)
// splits its column tiles over the threads: each output is still one thread's sum over i in order, so the
// bits are those of the one-thread product. Below it a parallel region costs more than it saves. Measured
// on an AMD EPYC Zen 4 (2 threads, the shipped Domino head, K = 64, W = 12, up to 64 nodes): see
// docs/results/zen4/README.md ("The tree grower on both threads").
constexpr int64_t SPLIT_MACS = 1 << 19;

inline void rows_times(const float* x, int64_t F, int64_t I, const float* wt, int64_t J, float* y, bool accumulate) {
  constexpr int64_t TILE = 2 * Lanes::N;
  const int64_t JT = J / TILE * TILE;
  if (F * I * J >= SPLIT_MACS && JT >= 2 * TILE && !at::in_parallel_region() && at::get_num_threads() > 1) {
    at::parallel_for(0, JT / TILE, 1, [&](int64_t t0, int64_t t1) {
      rows_times_tiles(x, F, I, wt, J, y, accumulate, t0 * TILE, t1 * TILE);
    });
  } else {
    rows_times_tiles(x, F, I, wt, J, y, accumulate, 0, JT);
  }
  if (JT == J) return;
  for (int64_t f = 0; f < F; ++f) {  // the last columns as rows_times does them
    float* out = y + f * J;
    if (!accumulate) std::fill(out + JT, out + J, 0.0f);
    for (int64_t i = 0; i < I; ++i) {
      const float a = x[f * I + i];
      const float* w = wt + i * J;
      for (int64_t j = JT; j < J; ++j) out[j] += a * w[j];
    }
  }
}
#endif

// ATen's vectorised sigmoid / tanh / silu, in place on n values
template <typename T>
inline at::Tensor view(T* p, int64_t n) {
  return at::from_blob(p, {n}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

template <typename T>
struct Grower {
  int64_t D, K, S, R, head, uncorrected;
  const int64_t* cand_tokens;
  const T *cand_base, *out_rows_t, *table, *hidden_proj, *w_state_t, *w_hh_t;
  int64_t X;  // the table's row size
  int64_t out_rows_stride;  // between depths' out_rows_t: R * K, or 0 where every depth has the whole vocabulary

  // corrected logits of the K candidates at depth d for F branches in states h [F, S], log-softmaxed
  // (clamped to 0), into out [F, K]
  void logprobs(int64_t d, const T* h, int64_t F, T* out, std::vector<T>& act) const {
    corrected(d, h, F, out, act);
    for (int64_t f = 0; f < F; ++f) {
      T* o = out + f * K;
      T top = o[0];
      for (int64_t k = 1; k < K; ++k) top = std::max(top, o[k]);
      T total = 0;
      for (int64_t k = 0; k < K; ++k) total += std::exp(o[k] - top);
      const T shift = top + std::log(total);
      for (int64_t k = 0; k < K; ++k) o[k] = std::min(o[k] - shift, T(0));
    }
  }

  // the corrected logits themselves (base + the head's correction), into out [F, K]
  void corrected(int64_t d, const T* h, int64_t F, T* out, std::vector<T>& act) const {
    const T* base = cand_base + d * K;
    for (int64_t f = 0; f < F; ++f) std::copy(base, base + K, out + f * K);
    if (head != NONE && d >= uncorrected)
      rows_times(correction_input(d, h, F, act), F, R, out_rows_t + d * out_rows_stride, K, out, true);  // + out_rows . v
  }

  // what the output rows multiply at depth d, [F, R]: Domino silu(W_z z_d + W_s h) (in ``act``), Markov the state
  const T* correction_input(int64_t d, const T* h, int64_t F, std::vector<T>& act) const {
    if (head != DOMINO) return h;
    act.resize(F * R);
    rows_times(h, F, S, w_state_t, R, act.data(), false);
    for (int64_t f = 0; f < F; ++f)
      for (int64_t r = 0; r < R; ++r) act[f * R + r] += hidden_proj[d * R + r];
    auto a = view(act.data(), F * R);
    c10::ParallelGuard serial(true);  // see advance: the same bits alone and in a batch
    at::silu_(a);
    return act.data();
  }

  // the states of n children: child c extends parent state parents[c] (rows of ``states``) by draft token tokens[c]
  void advance(const T* states, const std::vector<int64_t>& parents, const std::vector<int64_t>& tokens, T* children,
               std::vector<T>& scratch) const {
    const int64_t n = (int64_t)parents.size();
    if (head == MARKOV) {
      for (int64_t c = 0; c < n; ++c) std::copy(table + tokens[c] * X, table + tokens[c] * X + S, children + c * S);
      return;
    }
    // gh = W_hh h of each child's parent (gathered first), then PyTorch's GRU gates (r, z, n)
    scratch.resize(n * S + n * 3 * S);
    T* h = scratch.data();
    T* gh = h + n * S;
    for (int64_t c = 0; c < n; ++c) std::copy(states + parents[c] * S, states + (parents[c] + 1) * S, h + c * S);
    // our own product, not ATen's mm: a BLAS may sum in another order with another thread count, and a
    // tree must not depend on how many requests share the call
    rows_times(h, n, S, w_hh_t, 3 * S, gh, false);
    for (int64_t c = 0; c < n; ++c) {  // r and z pre-activations in place, n's input part into ``children``
      const T* gi = table + tokens[c] * X;
      T* g = gh + c * 3 * S;
      for (int64_t j = 0; j < 2 * S; ++j) g[j] += gi[j];
    }
    for (int64_t c = 0; c < n; ++c) {
      auto rz = view(gh + c * 3 * S, 2 * S);
      c10::ParallelGuard serial(true);  // see below
      at::sigmoid_(rz);
    }
    for (int64_t c = 0; c < n; ++c) {
      const T* gi = table + tokens[c] * X;
      T* g = gh + c * 3 * S;
      T* out = children + c * S;
      for (int64_t j = 0; j < S; ++j) out[j] = gi[2 * S + j] + g[j] * g[2 * S + j];
    }
    auto cand = view(children, n * S);
    // ATen's elementwise ops split a long tensor over the threads, and each chunk's tail takes the scalar
    // function, whose bits can differ from the vector one: held to one thread (as inside a batch's parallel
    // region), a lone request's values are the same as in a batch whatever its width
    c10::ParallelGuard serial(true);
    at::tanh_(cand);
    for (int64_t c = 0; c < n; ++c) {
      const T* g = gh + c * 3 * S;
      const T* parent = h + c * S;
      T* out = children + c * S;
      for (int64_t j = 0; j < S; ++j) out[j] = (T(1) - g[S + j]) * out[j] + g[S + j] * parent[j];
    }
  }
};

template <typename T>
std::vector<torch::Tensor> grow_impl(const Grower<T>& g, const T* root, int64_t width, int64_t budget, double beta) {
  const int64_t D = g.D, K = g.K;
  std::vector<T> states(root, root + g.S), next_states, scores{T(0)}, logp, total, act, gh;
  std::vector<int64_t> rows{0};  // tree rows of the frontier
  std::vector<int64_t> tokens, parents, depths;
  std::vector<T> out_scores, prune;
  std::vector<int64_t> order;
  int64_t placed = 0;
  for (int64_t d = 0; d < D; ++d) {  // the frontier at depth d grows the nodes at depth d + 1
    const int64_t F = (int64_t)scores.size();
    const int64_t n = std::min(width, F * K);
    if (n <= 0) break;
    logp.resize(F * K);
    g.logprobs(d, states.data(), F, logp.data(), act);
    total.resize(F * K);
    for (int64_t i = 0; i < F * K; ++i) total[i] = scores[i / K] + logp[i];
    order.resize(F * K);
    std::iota(order.begin(), order.end(), 0);
    // the top n, best first; equal scores in flat order (branch, then candidate)
    std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int64_t a, int64_t b) {
      return total[a] > total[b] || (total[a] == total[b] && a < b);
    });
    std::vector<T> new_scores(n);
    next_states.resize(n * g.S);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t branch = order[i] / K, cand = order[i] % K;
      tokens.push_back(g.cand_tokens[d * K + cand]);
      parents.push_back(rows[branch]);
      depths.push_back(d + 1);
      out_scores.push_back(total[order[i]]);
      prune.push_back(total[order[i]] + T(beta) * T(d + 1));
      new_scores[i] = total[order[i]];
    }
    rows.resize(n);
    std::iota(rows.begin(), rows.end(), placed + 1);
    placed += n;
    if (budget > 0 && placed >= budget) {  // stop once no deeper node can enter the top-B
      std::vector<T> ranked(prune);
      std::nth_element(ranked.begin(), ranked.begin() + (budget - 1), ranked.end(), std::greater<T>());
      const T threshold = ranked[budget - 1];
      const T best = *std::max_element(new_scores.begin(), new_scores.end());
      if (best + T(beta) * T(d + 2) <= threshold) break;
    }
    if (d + 1 < D && g.head != NONE) {
      std::vector<int64_t> from(n), toks(n);
      for (int64_t i = 0; i < n; ++i) from[i] = order[i] / K, toks[i] = g.cand_tokens[d * K + order[i] % K];
      g.advance(states.data(), from, toks, next_states.data(), gh);
      states.swap(next_states);
    }
    scores.swap(new_scores);
  }
  const int64_t N = (int64_t)tokens.size();
  auto lopt = torch::TensorOptions().dtype(torch::kInt64);
  auto tok = torch::empty({N}, lopt), par = torch::empty({N}, lopt), dep = torch::empty({N}, lopt);
  auto sc = torch::empty({N}, torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
  std::copy(tokens.begin(), tokens.end(), tok.data_ptr<int64_t>());
  std::copy(parents.begin(), parents.end(), par.data_ptr<int64_t>());
  std::copy(depths.begin(), depths.end(), dep.data_ptr<int64_t>());
  std::copy(out_scores.begin(), out_scores.end(), sc.template data_ptr<T>());
  return {tok, par, dep, sc};
}

// The top k of v [V]: the larger value first, equal values by the smaller index, NaN above every number (as
// torch.topk ranks it), into ids [k], best first. First a floor under the k-th best number: the smallest of k
// chunks' maxima (NaN passed over; each chunk holds a number at least that large, so k values are), then the
// values not below it and the NaNs (a few times k on a drafter's logits) are ranked. Two passes over v, vectors
// where there are, instead of a sort or a heap fed most of the row.
template <typename T>
void top_k_ids(const T* v, int64_t V, int64_t k, int64_t* ids, std::vector<int64_t>& kept) {
  const T inf = std::numeric_limits<T>::infinity();
  T floor_value = inf;
  for (int64_t c = 0; c < k; ++c) {
    const int64_t a = c * V / k, b = (c + 1) * V / k;
    T top = -inf;
    int64_t i = a;
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, float>) {
      if (b - a >= 16) {
        __m512 m = _mm512_set1_ps(-inf);
        for (; i + 16 <= b; i += 16) m = _mm512_max_ps(_mm512_loadu_ps(v + i), m);  // a NaN in v gives m
        top = _mm512_reduce_max_ps(m);
      }
    }
#endif
    for (; i < b; ++i) top = v[i] > top ? v[i] : top;
    floor_value = std::min(floor_value, top);
  }
  kept.clear();
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    const __m512 f = _mm512_set1_ps(floor_value);
    for (; i + 16 <= V; i += 16)  // not (value < floor): at or above it, or NaN
      for (__mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), f, _CMP_NLT_UQ); m; m &= m - 1)
        kept.push_back(i + __builtin_ctz(m));
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 f = _mm256_set1_ps(floor_value);
    for (; i + 8 <= V; i += 8)
      for (int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), f, _CMP_NLT_UQ)); m; m &= m - 1)
        kept.push_back(i + __builtin_ctz(m));
  }
#endif
  for (; i < V; ++i)
    if (!(v[i] < floor_value)) kept.push_back(i);
  const auto better = [v](int64_t a, int64_t b) {
    const bool na = std::isnan(v[a]), nb = std::isnan(v[b]);
    if (na || nb) return na && (!nb || a < b);
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  };
  std::partial_sort(kept.begin(), kept.begin() + k, kept.end(), better);
  std::copy(kept.begin(), kept.begin() + k, ids);
}

// What grow_supertrees takes of one request's draft, in one call: each depth's k candidates (the top k base
// logits, ``top_k_ids``: trees/common.py ``candidate_tables``, whose torch.topk leaves equal logits' order
// open), their base logits, and the head's output rows of them transposed.
// base [D, V]; out_rows [V, R] -> cand_tokens [D, k] int64, cand_base [D, k], out_rows_t [D, R, k]. The depths
// split over the threads.
std::vector<torch::Tensor> candidates(torch::Tensor base, torch::Tensor out_rows, int64_t k) {
  TORCH_CHECK(base.dim() == 2 && base.is_contiguous() && (base.scalar_type() == torch::kFloat || base.scalar_type() == torch::kDouble),
              "candidates: base [D, V] contiguous float32 or float64");
  const int64_t D = base.size(0), V = base.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "candidates: 1 <= k <= V");
  TORCH_CHECK(out_rows.dim() == 2 && out_rows.size(0) == V && out_rows.is_contiguous() && out_rows.scalar_type() == base.scalar_type(),
              "candidates: out_rows [V, R], contiguous, base's dtype");
  const int64_t R = out_rows.size(1);
  auto tokens = torch::empty({D, k}, torch::TensorOptions().dtype(torch::kInt64));
  auto values = torch::empty({D, k}, base.options());
  auto rows_t = torch::empty({D, R, k}, base.options());
  AT_DISPATCH_FLOATING_TYPES(base.scalar_type(), "candidates", [&] {
    using T = scalar_t;
    at::parallel_for(0, D, 1, [&](int64_t d0, int64_t d1) {
      std::vector<int64_t> kept;
      for (int64_t d = d0; d < d1; ++d) {
        const T* v = base.data_ptr<T>() + d * V;
        int64_t* ids = tokens.data_ptr<int64_t>() + d * k;
        top_k_ids(v, V, k, ids, kept);
        T* val = values.data_ptr<T>() + d * k;
        for (int64_t j = 0; j < k; ++j) val[j] = v[ids[j]];
        T* rt = rows_t.data_ptr<T>() + d * R * k;
        for (int64_t j = 0; j < k; ++j) {
          const T* w = out_rows.data_ptr<T>() + ids[j] * R;
          for (int64_t r = 0; r < R; ++r) rt[r * k + j] = w[r];
        }
      }
    });
  });
  return {tokens, values, rows_t};
}

// Domino's hidden projection of a request's drafter states: hidden [D, H] @ w_z_t [H, R] -> [D, R] (W_z z_d of every
// depth, ``DominoHead.start_round``'s), by ``rows_times``: the sum over H in order, the same bits every call.
torch::Tensor hidden_projection(torch::Tensor hidden, torch::Tensor w_z_t) {
  TORCH_CHECK(hidden.dim() == 2 && w_z_t.dim() == 2 && hidden.size(1) == w_z_t.size(0) && hidden.is_contiguous() &&
              w_z_t.is_contiguous() && hidden.scalar_type() == w_z_t.scalar_type(),
              "hidden_projection: hidden [D, H], w_z_t [H, R], contiguous, one dtype");
  auto out = torch::empty({hidden.size(0), w_z_t.size(1)}, hidden.options());
  AT_DISPATCH_FLOATING_TYPES(hidden.scalar_type(), "hidden_projection", [&] {
    rows_times(hidden.data_ptr<scalar_t>(), hidden.size(0), hidden.size(1), w_z_t.data_ptr<scalar_t>(), w_z_t.size(1),
               out.data_ptr<scalar_t>(), false);
  });
  return out;
}

// Domino's root state from the bonus token's row of the token table (draft id ``row``): the GRU's step from the
// zero state, whose hidden projection is zero, so r does not enter: (1 - sigmoid(i_z)) * tanh(i_n). One call
// instead of half a dozen tensor operations from Python (a third of a millisecond a round, cold after a target
// forward). The same values as ``DominoHead.initial_state`` up to rounding (tests/test_tree_kernels.py), the
// same bits every call.
torch::Tensor domino_root(torch::Tensor table, int64_t row) {
  TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.size(1) % 3 == 0, "domino_root: table [V, 3S] contiguous");
  TORCH_CHECK(row >= 0 && row < table.size(0), "domino_root: row outside the table");
  const int64_t S = table.size(1) / 3;
  auto out = torch::empty({S}, table.options());
  AT_DISPATCH_FLOATING_TYPES(table.scalar_type(), "domino_root", [&] {
    const scalar_t* gi = table.data_ptr<scalar_t>() + row * 3 * S;
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t j = 0; j < S; ++j)
      o[j] = (scalar_t(1) - scalar_t(1) / (scalar_t(1) + std::exp(-gi[S + j]))) * std::tanh(gi[2 * S + j]);
  });
  return out;
}

// One request's arguments checked.
void check_grow(const torch::Tensor& cand_tokens, const torch::Tensor& cand_base, int64_t head, const torch::Tensor& out_rows_t,
                const torch::Tensor& table, const torch::Tensor& hidden_proj, const torch::Tensor& w_state_t,
                const torch::Tensor& w_hh_t, const torch::Tensor& root, int64_t width) {
  TORCH_CHECK(cand_tokens.dim() == 2 && cand_tokens.scalar_type() == torch::kInt64 && cand_tokens.is_contiguous(),
              "grow_supertree: cand_tokens [D, K] int64");
  TORCH_CHECK(head == NONE || head == DOMINO || head == MARKOV, "grow_supertree: head 0, 1 or 2");
  TORCH_CHECK(width >= 1, "grow_supertree: width >= 1");
  const int64_t D = cand_tokens.size(0), K = cand_tokens.size(1);
  for (auto* t : {&cand_base, &out_rows_t, &table, &hidden_proj, &w_state_t, &w_hh_t, &root})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == cand_base.scalar_type(), "grow_supertree: contiguous tensors of one dtype");
  TORCH_CHECK(cand_base.size(0) == D && cand_base.size(1) == K, "grow_supertree: cand_base [D, K]");
  const int64_t S = root.numel(), R = head == NONE ? 0 : out_rows_t.size(1), X = head == NONE ? 0 : table.size(1);
  if (head != NONE) {
    TORCH_CHECK(out_rows_t.size(0) == D && out_rows_t.size(2) == K, "grow_supertree: out_rows_t [D, R, K]");
    TORCH_CHECK(X == (head == DOMINO ? 3 * S : S), "grow_supertree: table rows of 3S (Domino) or S (Markov)");
    const int64_t V = table.size(0);
    const int64_t* ct = cand_tokens.data_ptr<int64_t>();
    for (int64_t i = 0; i < D * K; ++i) TORCH_CHECK(ct[i] >= 0 && ct[i] < V, "grow_supertree: candidate outside the table");
  }
  if (head == DOMINO)
    TORCH_CHECK(hidden_proj.size(0) == D && hidden_proj.size(1) == R && w_state_t.size(0) == S && w_state_t.size(1) == R &&
                w_hh_t.size(0) == S && w_hh_t.size(1) == 3 * S, "grow_supertree: Domino weights' shapes");
  if (head == MARKOV) TORCH_CHECK(R == S, "grow_supertree: a Markov state is its rank");
}

template <typename T>
Grower<T> grower(const torch::Tensor& cand_tokens, const torch::Tensor& cand_base, int64_t head, const torch::Tensor& out_rows_t,
                 const torch::Tensor& table, const torch::Tensor& hidden_proj, const torch::Tensor& w_state_t,
                 const torch::Tensor& w_hh_t, const torch::Tensor& root, int64_t uncorrected) {
  const int64_t D = cand_tokens.size(0), K = cand_tokens.size(1), S = root.numel();
  const int64_t R = head == NONE ? 0 : out_rows_t.size(1), X = head == NONE ? 0 : table.size(1);
  return Grower<T>{D, K, S, R, head, uncorrected, cand_tokens.data_ptr<int64_t>(), cand_base.data_ptr<T>(),
                   out_rows_t.data_ptr<T>(), table.data_ptr<T>(), hidden_proj.data_ptr<T>(), w_state_t.data_ptr<T>(),
                   w_hh_t.data_ptr<T>(), X, R * K};
}

// The head-corrected greedy chain over the whole (draft) vocabulary (trees/common.py
// ``corrected_chain_logits``, what ``domino`` and ``domino-ddtree`` build from): at each depth the corrected
// logits of every token, their argmax (the first of equal maxima, as torch's), and the head's step by it.
// base [D, V]; out_rows_t [R, V] (the head's output rows transposed, every depth the same); the rest as above.
// Returns the chain's draft ids [D] and its corrected logits [D, V].
std::vector<torch::Tensor> corrected_chain(torch::Tensor base, int64_t head, torch::Tensor out_rows_t, torch::Tensor table,
                                           torch::Tensor hidden_proj, torch::Tensor w_state_t, torch::Tensor w_hh_t,
                                           torch::Tensor root, int64_t uncorrected) {
  TORCH_CHECK(base.dim() == 2 && base.is_contiguous(), "corrected_chain: base [D, V] contiguous");
  TORCH_CHECK(head == DOMINO || head == MARKOV, "corrected_chain: head 1 or 2");
  for (auto* t : {&out_rows_t, &table, &hidden_proj, &w_state_t, &w_hh_t, &root})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == base.scalar_type(), "corrected_chain: contiguous tensors of one dtype");
  const int64_t D = base.size(0), V = base.size(1), S = root.numel(), R = out_rows_t.size(0), X = table.size(1);
  TORCH_CHECK(out_rows_t.dim() == 2 && out_rows_t.size(1) == V && table.size(0) == V, "corrected_chain: out_rows_t [R, V], table [V, X]");
  TORCH_CHECK(X == (head == DOMINO ? 3 * S : S), "corrected_chain: table rows of 3S (Domino) or S (Markov)");
  if (head == DOMINO)
    TORCH_CHECK(hidden_proj.size(0) == D && hidden_proj.size(1) == R && w_state_t.size(0) == S && w_state_t.size(1) == R &&
                w_hh_t.size(0) == S && w_hh_t.size(1) == 3 * S, "corrected_chain: Domino weights' shapes");
  if (head == MARKOV) TORCH_CHECK(R == S, "corrected_chain: a Markov state is its rank");
  auto logits = torch::empty({D, V}, base.options());
  auto tokens = torch::empty({D}, torch::TensorOptions().dtype(torch::kInt64));
  AT_DISPATCH_FLOATING_TYPES(base.scalar_type(), "corrected_chain", [&] {
    using T = scalar_t;
    const Grower<T> g{D, V, S, R, head, uncorrected, nullptr, base.data_ptr<T>(), out_rows_t.data_ptr<T>(), table.data_ptr<T>(),
                      hidden_proj.data_ptr<T>(), w_state_t.data_ptr<T>(), w_hh_t.data_ptr<T>(), X, 0};
    std::vector<T> state(root.data_ptr<T>(), root.data_ptr<T>() + S), next(S), act, scratch;
    T* out = logits.data_ptr<T>();
    int64_t* tok = tokens.data_ptr<int64_t>();
    for (int64_t d = 0; d < D; ++d) {
      T* row = out + d * V;
      const T* base_row = base.data_ptr<T>() + d * V;
      const T* v = d >= uncorrected ? g.correction_input(d, state.data(), 1, act) : nullptr;
      // the whole vocabulary's rows (R x V, megabytes) split over the threads by columns: each column's sum
      // runs over r in order on one thread, the same whatever the thread count; a thread's columns stay in
      // its cache from one depth to the next
      at::parallel_for(0, V, 2048, [&](int64_t c0, int64_t c1) {
        std::copy(base_row + c0, base_row + c1, row + c0);
        if (v == nullptr) return;
        for (int64_t r = 0; r < R; ++r) {
          const T a = v[r];
          const T* w = g.out_rows_t + r * V;
          for (int64_t c = c0; c < c1; ++c) row[c] += a * w[c];
        }
      });
      int64_t best = 0;
      for (int64_t c = 1; c < V; ++c)
        if (row[c] > row[best]) best = c;
      tok[d] = best;
      if (d + 1 < D) {
        g.advance(state.data(), {0}, {best}, next.data(), scratch);
        state.swap(next);
      }
    }
  });
  return {tokens, logits};
}

// Requests' supertrees (one head, its tables shared; each request its own candidates, logits, hidden
// projection, root state and budget), the requests split over the threads. Each tree is computed by the
// same code whatever the count (one request included: the only entry point), so a request's tree is the
// same, node for node and bit for bit, however many share the call; a request alone has the threads to
// itself, and its larger products split their columns over them (``rows_times``: the same bits).
std::vector<std::vector<torch::Tensor>> grow_supertrees(std::vector<torch::Tensor> cand_tokens, std::vector<torch::Tensor> cand_base,
                                                        int64_t head, std::vector<torch::Tensor> out_rows_t, torch::Tensor table,
                                                        std::vector<torch::Tensor> hidden_proj, torch::Tensor w_state_t,
                                                        torch::Tensor w_hh_t, std::vector<torch::Tensor> roots, int64_t uncorrected,
                                                        int64_t width, std::vector<int64_t> budgets, double beta) {
  const int64_t B = (int64_t)cand_tokens.size();
  TORCH_CHECK(cand_base.size() == (size_t)B && out_rows_t.size() == (size_t)B && hidden_proj.size() == (size_t)B &&
              roots.size() == (size_t)B && budgets.size() == (size_t)B, "grow_supertrees: one entry a request in every list");
  for (int64_t b = 0; b < B; ++b)
    check_grow(cand_tokens[b], cand_base[b], head, out_rows_t[b], table, hidden_proj[b], w_state_t, w_hh_t, roots[b], width);
  std::vector<std::vector<torch::Tensor>> out(B);
  if (B == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(cand_base[0].scalar_type(), "grow_supertrees", [&] {
    const auto grow_one = [&](int64_t b) {
      auto g = grower<scalar_t>(cand_tokens[b], cand_base[b], head, out_rows_t[b], table, hidden_proj[b], w_state_t, w_hh_t,
                                roots[b], uncorrected);
      out[b] = grow_impl<scalar_t>(g, roots[b].data_ptr<scalar_t>(), width, budgets[b], beta);
    };
    if (B == 1) {  // not through parallel_for: inside it (even over one item) a product could not split
      grow_one(0);
    } else {
      at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) grow_one(b);
      });
    }
  });
  return out;
}

// DDTree's best-first tree over per-depth marginals (trees/common.py ``best_first_marginals``), the same
// pops in the same order: top_lp [D, k] (float64: the Python heap sums Python floats) and top_ids [D, k] are
// each depth's k best log-probabilities and tokens, best first. A popped node pushes its next sibling and
// its first child; the heap orders by score, then by push order (the Python heap's tie counter). Returns
// tokens, parents (tree rows), depths and scores, in pop order (which is the ranking).
std::vector<torch::Tensor> best_first(torch::Tensor top_lp, torch::Tensor top_ids, int64_t budget) {
  TORCH_CHECK(top_lp.dim() == 2 && top_lp.scalar_type() == torch::kFloat64 && top_lp.is_contiguous(),
              "best_first: top_lp [D, k] float64");
  TORCH_CHECK(top_ids.sizes() == top_lp.sizes() && top_ids.scalar_type() == torch::kInt64 && top_ids.is_contiguous(),
              "best_first: top_ids [D, k] int64");
  const int64_t D = top_lp.size(0), k = top_lp.size(1);
  const double* lp = top_lp.data_ptr<double>();
  const int64_t* ids = top_ids.data_ptr<int64_t>();
  struct Entry {
    double key;  // minus the score
    int64_t tie, parent, depth, rank;
    double parent_score;
  };
  auto later = [](const Entry& a, const Entry& b) { return a.key > b.key || (a.key == b.key && a.tie > b.tie); };
  std::vector<Entry> heap;
  std::vector<int64_t> tokens, parents, depths;
  std::vector<double> scores;
  if (D > 0 && k > 0) heap.push_back({-lp[0], 0, 0, 1, 0, 0.0});
  int64_t tie = 1;
  while (!heap.empty() && (int64_t)tokens.size() < budget) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Entry e = heap.back();
    heap.pop_back();
    const double score = e.parent_score + lp[(e.depth - 1) * k + e.rank];
    scores.push_back(score);
    tokens.push_back(ids[(e.depth - 1) * k + e.rank]);
    parents.push_back(e.parent);
    depths.push_back(e.depth);
    const int64_t row = (int64_t)tokens.size();
    if (e.rank + 1 < k) {
      heap.push_back({-(e.parent_score + lp[(e.depth - 1) * k + e.rank + 1]), tie++, e.parent, e.depth, e.rank + 1, e.parent_score});
      std::push_heap(heap.begin(), heap.end(), later);
    }
    if (e.depth < D) {
      heap.push_back({-(score + lp[e.depth * k]), tie++, row, e.depth + 1, 0, score});
      std::push_heap(heap.begin(), heap.end(), later);
    }
  }
  const int64_t N = (int64_t)tokens.size();
  auto lopt = torch::TensorOptions().dtype(torch::kInt64);
  auto tok = torch::empty({N}, lopt), par = torch::empty({N}, lopt), dep = torch::empty({N}, lopt);
  auto sc = torch::empty({N}, torch::TensorOptions().dtype(torch::kFloat64));
  std::copy(tokens.begin(), tokens.end(), tok.data_ptr<int64_t>());
  std::copy(parents.begin(), parents.end(), par.data_ptr<int64_t>());
  std::copy(depths.begin(), depths.end(), dep.data_ptr<int64_t>());
  std::copy(scores.begin(), scores.end(), sc.data_ptr<double>());
  return {tok, par, dep, sc};
}

}  // namespace

// rows_times on float32 tensors, for the tests: x [F, I], wt [I, J], y [F, J] updated in place (the path this build
// takes: AVX-512, AVX2 or the plain loop; each must give the bits of the sum over i in order, a product then a sum)
void rows_times_f32(torch::Tensor x, torch::Tensor wt, torch::Tensor y, bool accumulate) {
  TORCH_CHECK(x.dim() == 2 && wt.dim() == 2 && y.dim() == 2 && x.size(1) == wt.size(0) && y.size(0) == x.size(0) &&
              y.size(1) == wt.size(1), "rows_times_f32: x [F, I], wt [I, J], y [F, J]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && wt.scalar_type() == torch::kFloat32 && y.scalar_type() == torch::kFloat32 &&
              x.is_contiguous() && wt.is_contiguous() && y.is_contiguous(), "rows_times_f32: contiguous float32");
  rows_times(x.data_ptr<float>(), x.size(0), x.size(1), wt.data_ptr<float>(), wt.size(1), y.data_ptr<float>(), accumulate);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_times_f32", &rows_times_f32, "the head's float32 row products (for the tests)");
  m.def("hidden_projection", &hidden_projection, "Domino's hidden projection W_z z_d of a request's drafter states");
  m.def("domino_root", &domino_root, "Domino's root state from the bonus token's row of the token table");
  m.def("candidates", &candidates, "each depth's top-k candidates, their base logits and the head's output rows of "
        "them transposed: what grow_supertrees takes of a request's draft");
  m.def("grow_supertrees", &grow_supertrees, "requests' DARTree supertrees, grown depth by depth with the head's "
        "corrections, in one call with the requests over the threads",
        py::call_guard<py::gil_scoped_release>());
  m.def("best_first", &best_first, "DDTree's best-first tree over per-depth marginals: tokens, parents, depths, "
        "scores in pop order", py::call_guard<py::gil_scoped_release>());
  m.def("corrected_chain", &corrected_chain, "the head-corrected greedy chain over the whole draft vocabulary: its "
        "draft ids and corrected logits", py::call_guard<py::gil_scoped_release>());
}
