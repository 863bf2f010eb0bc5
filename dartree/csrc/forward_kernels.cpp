// The lean forward (targets/lean.py ``forward``) in one compiled call: the same kernels (lean_kernels.cpp's norms,
// RoPE, attention and SwiGLU; quant_kernels.cpp's integer products, or lean_kernels.cpp's float32 products), called
// in the same order on the same arguments, so the same bits as the Python loop, without its ~9 calls a layer
// from Python (measured on an AMD EPYC Zen 3, 2 threads: a one-row step of SmolLM2-135M without its output layer
// 4.76 -> 4.43 ms and 5.23 -> 4.69 ms; `ar` 1.13x). The weights are bound once (``Forward``); each call hands over
// only the rows.
//
// Both kernel sources are compiled into this module, each in a namespace of its own (their helpers share names),
// with their own Python modules left out (DARTREE_NO_MODULE). Their headers are included here first, so that
// the includes inside the namespaces are no-ops.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define DARTREE_NO_MODULE 1
namespace lean_k {
#include "lean_kernels.cpp"
}
namespace quant_k {
#include "quant_kernels.cpp"
}

namespace {

using Parts = std::vector<torch::Tensor>;  // one product's weight: one packed weight, or parts of different types
using Sizes = std::vector<int64_t>;         // ... and each part's output size

struct Forward {
  // per layer: packed products (quantised records, or float32 blocks), their output sizes, the norms
  std::vector<Parts> qkv, o, gate_up, down;
  std::vector<torch::Tensor> input_norm, post_norm, q_norm, k_norm;
  std::vector<Sizes> qkv_n, o_n, gate_up_n, down_n;
  torch::Tensor final_norm;
  bool quantized;
  int64_t heads, kv_heads;
  double eps, scale;

  torch::Tensor product(const torch::Tensor& x, const torch::Tensor& w, int64_t n, c10::optional<torch::Tensor> res) const {
    return quantized ? quant_k::qproduct(x, w, n, res) : lean_k::product(x, w, n, res);
  }

  // a weight stored in parts of different types (a GGUF file's q and k in Q4_K beside its v in Q6_K): each part's
  // outputs are its own rows' products, side by side (an output's value does not depend on the others)
  torch::Tensor product(const torch::Tensor& x, const Parts& w, const Sizes& n, c10::optional<torch::Tensor> res) const {
    if (w.size() == 1) return product(x, w[0], n[0], res);
    TORCH_CHECK(!res.has_value(), "forward: a product in parts takes no residual");
    std::vector<torch::Tensor> outs;
    for (size_t p = 0; p < w.size(); ++p) outs.push_back(product(x, w[p], n[p], c10::nullopt));
    return torch::cat(outs, 1);
  }

  // x [n, H] the embedded rows; k, v the store [layers, slots, kv heads, capacity, head_dim]; the rest as
  // ``lean.Rows``. Returns the final-normed states and the tapped layers' outputs side by side (or an
  // undefined tensor without tapped layers).
  std::vector<torch::Tensor> run(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k, torch::Tensor v,
                                 torch::Tensor slots, torch::Tensor cache_positions, torch::Tensor past,
                                 torch::Tensor visible, std::vector<int64_t> tapped_layers) const {
    const int64_t L = (int64_t)qkv.size();
    TORCH_CHECK(k.dim() == 5 && v.dim() == 5 && k.size(0) == L && v.size(0) == L && k.is_contiguous() && v.is_contiguous(),
                "forward: the K/V store [", L, " layers, slots, kv heads, capacity, head_dim]");
    std::vector<torch::Tensor> tapped(tapped_layers.size());
    for (int64_t i = 0; i < L; ++i) {
      const torch::Tensor kc = k.select(0, i), vc = v.select(0, i);
      torch::Tensor h = lean_k::rmsnorm(x, input_norm[i], eps);
      const torch::Tensor q = lean_k::rope_store(product(h, qkv[i], qkv_n[i], c10::nullopt), cos, sin, q_norm[i], k_norm[i],
                                                 eps, heads, kv_heads, kc, vc, slots, cache_positions);
      const torch::Tensor a = lean_k::attention(q, kc, vc, slots, past, visible, heads, scale);
      x = product(a, o[i], o_n[i], x);
      h = lean_k::rmsnorm(x, post_norm[i], eps);
      x = product(lean_k::swiglu(product(h, gate_up[i], gate_up_n[i], c10::nullopt)), down[i], down_n[i], x);
      for (size_t t = 0; t < tapped_layers.size(); ++t)
        if (tapped_layers[t] == i) tapped[t] = x;
    }
    torch::Tensor states;
    if (!tapped.empty()) {
      for (size_t t = 0; t < tapped.size(); ++t)
        TORCH_CHECK(tapped[t].defined(), "forward: tapped layer ", tapped_layers[t], " is not one of the ", L, " layers");
      states = torch::cat(tapped, -1);
    }
    return {lean_k::rmsnorm(x, final_norm, eps), states};
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Forward>(m, "Forward", "a lean target's forward with its weights bound once")
      .def(py::init([](std::vector<Parts> qkv, std::vector<Parts> o, std::vector<Parts> gate_up,
                       std::vector<Parts> down, std::vector<Sizes> qkv_n, std::vector<Sizes> o_n,
                       std::vector<Sizes> gate_up_n, std::vector<Sizes> down_n, std::vector<torch::Tensor> input_norm,
                       std::vector<torch::Tensor> post_norm, std::vector<torch::Tensor> q_norm,
                       std::vector<torch::Tensor> k_norm, torch::Tensor final_norm, bool quantized, int64_t heads,
                       int64_t kv_heads, double eps, double scale) {
             const size_t L = qkv.size();
             TORCH_CHECK(o.size() == L && gate_up.size() == L && down.size() == L && qkv_n.size() == L && o_n.size() == L &&
                             gate_up_n.size() == L && down_n.size() == L && input_norm.size() == L &&
                             post_norm.size() == L && q_norm.size() == L && k_norm.size() == L,
                         "Forward: one of each weight a layer");
             for (const auto* role : {&qkv, &o, &gate_up, &down})
               for (const Parts& w : *role) TORCH_CHECK(!w.empty(), "Forward: a weight of no parts");
             for (size_t i = 0; i < L; ++i)
               TORCH_CHECK(qkv[i].size() == qkv_n[i].size() && o[i].size() == o_n[i].size() &&
                               gate_up[i].size() == gate_up_n[i].size() && down[i].size() == down_n[i].size(),
                           "Forward: one output size a part");
             return Forward{qkv, o, gate_up, down, input_norm, post_norm, q_norm, k_norm, qkv_n, o_n, gate_up_n, down_n,
                            final_norm, quantized, heads, kv_heads, eps, scale};
           }))
      .def("run", &Forward::run, "the forward over the rows: (final-normed states, tapped states or None)",
           py::call_guard<py::gil_scoped_release>());
}
