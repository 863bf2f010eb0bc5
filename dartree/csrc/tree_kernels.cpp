// DARTree's supertree growth (trees/dartree.py ``grow_supertree``) in one call: every depth's corrected
// logits of the frontier's candidates, their log-softmax, the beam's top-W over (branch, candidate), the
// early stop under the deferred top-B, and the correction head's step for the kept children, without a
// framework call per operation. The Domino GRU head and DSpark's Markov head are written out here; the
// tree that comes out is the Python builder's on the same logits (tests/test_tree_kernels.py, float64).
//
// Shapes (D depths, K candidates a depth, S the head's state size, R its rank):
//   cand_tokens [D, K] int64 draft ids, cand_base [D, K] their base logits;
//   out_rows [D, K, R]: the head's output rows of the candidates;
//   table [V, X]: what the head's step needs of a token, by draft id (Domino: the GRU's input projection
//     of the token's embedding, X = 3S; Markov: the new state itself, W1 of the token, X = S = R);
//   Domino only: hidden_proj [D, R] (W_z z_d), w_state [R, S] (W_s), w_hh [3S, S] (the GRU's hidden weights);
//   root [S]: the root's state.
// Returns tokens, parents (tree rows: 0 is the root, node i is row i + 1), depths (1-based) and scores
// (cumulative log-probabilities), in placement order.
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

constexpr int LANES = 16;

// a dot product over 16 independent lanes (vectorised by the compiler without reassociation), then the
// lanes added pairwise: one fixed order
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T lanes[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int j = 0; j < LANES; ++j) lanes[j] += a[i + j] * b[i + j];
  for (int j = 0; i + j < n; ++j) lanes[j] += a[i + j] * b[i + j];
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  return lanes[0];
}

template <typename T>
inline T sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }

enum Head : int64_t { NONE = 0, DOMINO = 1, MARKOV = 2 };

template <typename T>
struct Grower {
  int64_t D, K, S, R, head, uncorrected;
  const int64_t* cand_tokens;
  const T *cand_base, *out_rows, *table, *hidden_proj, *w_state, *w_hh;
  int64_t X;  // the table's row size

  // corrected logits of the K candidates at depth d for a branch in state h, log-softmaxed (clamped to 0)
  void logprobs(int64_t d, const T* h, T* out, std::vector<T>& act) const {
    const T* base = cand_base + d * K;
    if (head == NONE || d < uncorrected) {
      for (int64_t k = 0; k < K; ++k) out[k] = base[k];
    } else {
      const T* v = h;
      if (head == DOMINO) {  // act = silu(W_z z_d + W_s h)
        for (int64_t r = 0; r < R; ++r) {
          const T a = hidden_proj[d * R + r] + dot(w_state + r * S, h, S);
          act[r] = a * sigmoid(a);
        }
        v = act.data();
      }
      const T* rows = out_rows + d * K * R;
      for (int64_t k = 0; k < K; ++k) out[k] = base[k] + dot(rows + k * R, v, R);
    }
    T top = out[0];
    for (int64_t k = 1; k < K; ++k) top = std::max(top, out[k]);
    T total = 0;
    for (int64_t k = 0; k < K; ++k) total += std::exp(out[k] - top);
    const T shift = top + std::log(total);
    for (int64_t k = 0; k < K; ++k) out[k] = std::min(out[k] - shift, T(0));
  }

  // the state of a parent's path extended by the draft token ``token``
  void advance(const T* parent, int64_t token, T* child, std::vector<T>& gh) const {
    const T* row = table + token * X;
    if (head == MARKOV) {
      std::copy(row, row + S, child);
      return;
    }
    for (int64_t j = 0; j < 3 * S; ++j) gh[j] = dot(w_hh + j * S, parent, S);
    for (int64_t j = 0; j < S; ++j) {  // PyTorch's GRU gate order: r, z, n
      const T r = sigmoid(row[j] + gh[j]);
      const T z = sigmoid(row[S + j] + gh[S + j]);
      const T n = std::tanh(row[2 * S + j] + r * gh[2 * S + j]);
      child[j] = (T(1) - z) * n + z * parent[j];
    }
  }
};

template <typename T>
std::vector<torch::Tensor> grow_impl(const Grower<T>& g, const T* root, int64_t width, int64_t budget, double beta) {
  const int64_t D = g.D, K = g.K, S = std::max<int64_t>(g.S, 1);
  std::vector<T> states(root, root + g.S), next_states, scores{T(0)}, logp, total, act(std::max<int64_t>(g.R, 1)), gh(3 * S);
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
    for (int64_t f = 0; f < F; ++f) g.logprobs(d, states.data() + f * g.S, logp.data() + f * K, act);
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
      for (int64_t i = 0; i < n; ++i)
        g.advance(states.data() + (order[i] / K) * g.S, g.cand_tokens[d * K + order[i] % K], next_states.data() + i * g.S, gh);
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

std::vector<torch::Tensor> grow_supertree(torch::Tensor cand_tokens, torch::Tensor cand_base, int64_t head,
                                          torch::Tensor out_rows, torch::Tensor table, torch::Tensor hidden_proj,
                                          torch::Tensor w_state, torch::Tensor w_hh, torch::Tensor root,
                                          int64_t uncorrected, int64_t width, int64_t budget, double beta) {
  TORCH_CHECK(cand_tokens.dim() == 2 && cand_tokens.scalar_type() == torch::kInt64 && cand_tokens.is_contiguous(),
              "grow_supertree: cand_tokens [D, K] int64");
  TORCH_CHECK(head == NONE || head == DOMINO || head == MARKOV, "grow_supertree: head 0, 1 or 2");
  TORCH_CHECK(width >= 1, "grow_supertree: width >= 1");
  const int64_t D = cand_tokens.size(0), K = cand_tokens.size(1);
  for (auto* t : {&cand_base, &out_rows, &table, &hidden_proj, &w_state, &w_hh, &root})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == cand_base.scalar_type(), "grow_supertree: contiguous tensors of one dtype");
  TORCH_CHECK(cand_base.size(0) == D && cand_base.size(1) == K, "grow_supertree: cand_base [D, K]");
  const int64_t S = root.numel(), R = head == NONE ? 0 : out_rows.size(2), X = head == NONE ? 0 : table.size(1);
  if (head != NONE) {
    TORCH_CHECK(out_rows.size(0) == D && out_rows.size(1) == K, "grow_supertree: out_rows [D, K, R]");
    TORCH_CHECK(X == (head == DOMINO ? 3 * S : S), "grow_supertree: table rows of 3S (Domino) or S (Markov)");
    const int64_t V = table.size(0);
    const int64_t* ct = cand_tokens.data_ptr<int64_t>();
    for (int64_t i = 0; i < D * K; ++i) TORCH_CHECK(ct[i] >= 0 && ct[i] < V, "grow_supertree: candidate outside the table");
  }
  if (head == DOMINO)
    TORCH_CHECK(hidden_proj.size(0) == D && hidden_proj.size(1) == R && w_state.size(0) == R && w_state.size(1) == S &&
                w_hh.size(0) == 3 * S && w_hh.size(1) == S, "grow_supertree: Domino weights' shapes");
  if (head == MARKOV) TORCH_CHECK(R == S, "grow_supertree: a Markov state is its rank");
  std::vector<torch::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(cand_base.scalar_type(), "grow_supertree", [&] {
    Grower<scalar_t> g{D, K, S, R, head, uncorrected, cand_tokens.data_ptr<int64_t>(), cand_base.data_ptr<scalar_t>(),
                       out_rows.data_ptr<scalar_t>(), table.data_ptr<scalar_t>(), hidden_proj.data_ptr<scalar_t>(),
                       w_state.data_ptr<scalar_t>(), w_hh.data_ptr<scalar_t>(), X};
    out = grow_impl<scalar_t>(g, root.data_ptr<scalar_t>(), width, budget, beta);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grow_supertree", &grow_supertree, "DARTree's supertree, grown depth by depth with the head's corrections",
        py::call_guard<py::gil_scoped_release>());
}
