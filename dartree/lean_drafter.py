"""The drafter's forward without the module stack: plain functions over weights prepared once.

A round's drafter call (``proposers.drafter.draft_batch``) on a CPU in float32 runs here instead of
``DrafterModel.forward``: the same computation (fuse the new tapped target states into context
rows, write their K/V, run the block [bonus, MASK, ...] through the layers with attention over the
context and the whole block, final norm, output layer), on the lean forward's compiled kernels
(``csrc/lean_kernels.cpp``: norms, RoPE with the K/V write, attention, SwiGLU) and on products
chosen by ``DRAFTER_PRODUCTS``. Each request keeps its context K/V in a ``KVStore`` of its own; a
batched call runs every product once over all requests' rows and the attention per request.

The drafter only steers which tokens are tried, so its arithmetic never touches the output's
exactness; it is still deterministic and row-invariant (a request's draft has the same bits alone
or batched), and it stays close to ``DrafterModel.forward`` (tests/test_lean_drafter.py bounds the
difference; docs/results/lean-round measures the held-out acceptance it gives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import kernels, quant
from .drafter import RELEASED, DrafterModel, rope_cos_sin
from .errors import require

# How the drafter's products run: "q8_0" (weights quantised per block of 32 at load, integer
# products, csrc/quant_kernels.cpp) or "float32" (the lean kernels' fp32 products). Measured on an
# AMD EPYC Zen 4 (2 threads, scripts/time_lean_round.py): a steady one-request call 1.03 ms on q8_0
# against 2.35 ms on float32; the held-out acceptance is the same within 0.01 (docs/results/lean-round).
DRAFTER_PRODUCTS = ("q8_0", "float32")


def lean_drafter_reason(model: DrafterModel) -> str | None:
    """Why ``model`` cannot run on the lean drafter forward (None when it can)."""
    param = model.norm.weight  # never released (``release_float_weights`` keeps the norms)
    if param.device.type != "cpu":
        return f"device {param.device.type}"
    if param.dtype != torch.float32:
        return f"dtype {param.dtype} (the lean drafter is float32)"
    if model.config.attention_bias:
        return "biased projections"
    if model.config.head_dim % 16:
        return f"head_dim {model.config.head_dim} (a multiple of 16 is needed)"
    if not kernels.available():
        return "no compiled kernels on this machine"
    return None


@dataclass
class DrafterLayerWeights:
    qkv: object      # [q; k; v] prepared for ``product``
    kv: object       # [k; v]: the context rows need no queries
    o: object
    gate_up: object  # [gate; up]
    down: object
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor


class LeanDrafterWeights:
    """A ``DrafterModel``'s weights in the lean layout, with its output layer (its own reduced one,
    or the target's ``lm_head``); also what ``targets.lean.KVStore`` reads to size a store."""

    def __init__(self, model: DrafterModel, lm_head: nn.Module, products: str = "q8_0"):
        if products not in DRAFTER_PRODUCTS:
            raise ValueError(f"drafter products are one of {', '.join(DRAFTER_PRODUCTS)}, got {products!r}")
        cfg = model.config
        require(not model.float_weights_released, RELEASED)
        self.model, self.products = model, products
        self.key = _key(model, lm_head, products)  # what they were made from (``up_to_date``)
        self._ext = kernels.load()
        self._qext = quant.load() if products == "q8_0" else None
        self.hidden, self.heads, self.kv_heads, self.head_dim = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.intermediate, self.eps, self.theta = cfg.intermediate_size, float(cfg.rms_norm_eps), float(cfg.rope_theta)
        self.scale = self.head_dim ** -0.5
        self.dtype = torch.float32
        self.max_positions = 1 << 20
        with torch.no_grad():
            self.fc = self.prepare(model.fc.weight)
            self.hidden_norm = model.hidden_norm.weight.detach().contiguous()
            self.layers = []
            for layer in model.layers:
                att, mlp = layer.self_attn, layer.mlp
                self.layers.append(DrafterLayerWeights(
                    self.prepare(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])),
                    self.prepare(torch.cat([att.k_proj.weight, att.v_proj.weight])),
                    self.prepare(att.o_proj.weight),
                    self.prepare(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    self.prepare(mlp.down_proj.weight),
                    layer.input_layernorm.weight.detach().contiguous(),
                    layer.post_attention_layernorm.weight.detach().contiguous(),
                    att.q_norm.weight.detach().contiguous(),
                    att.k_norm.weight.detach().contiguous()))
            self.final_norm = model.norm.weight.detach().contiguous()
            self.vocab = lm_head.weight.shape[0]
            self.output = self.prepare(lm_head.weight)
        self._cos = self._sin = None

    def prepare(self, weight: torch.Tensor):
        weight = weight.detach().to(torch.float32).contiguous()
        if self.products == "q8_0" and weight.shape[1] % quant.BLOCK == 0:
            return quant.quantize_q8_0(weight, self._qext)
        return self._ext.pack_weight(weight), weight.shape[0]

    def product(self, x: torch.Tensor, weight, residual: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(weight, quant.QuantWeight):
            return quant.qproduct(x, weight, residual, self._qext)
        packed, n = weight
        return self._ext.product(x, packed, n, residual)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's cos/sin [n, head_dim] (``drafter.rope_cos_sin``'s values), tables grown by doubling."""
        need = int(positions.max()) + 1
        if self._cos is None or self._cos.shape[0] < need:
            size = max(need, 2 * (0 if self._cos is None else self._cos.shape[0]), 1024)
            cos, sin = rope_cos_sin(torch.arange(size), self.head_dim, self.theta, self.dtype)
            self._cos, self._sin = cos.contiguous(), sin.contiguous()
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)


def _prepared_linears(model: DrafterModel, lm_head: nn.Module) -> list[nn.Module]:
    """The modules whose weights ``LeanDrafterWeights`` copies into its own layout."""
    linears = [model.fc]
    for layer in model.layers:
        att, mlp = layer.self_attn, layer.mlp
        linears += [att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return linears + [lm_head]


def _key(model: DrafterModel, lm_head: nn.Module, products: str) -> tuple:
    """What the lean weights are made of: the output layer, the products, and each prepared weight
    (replaced, or changed in place as ``load_state_dict`` does: its version counter moves; its storage,
    should a replacement reuse a freed one's id)."""
    return (id(lm_head), products) + tuple((id(m.weight), m.weight._version, m.weight.data_ptr())
                                           for m in _prepared_linears(model, lm_head))


def lean_weights_of(model: DrafterModel, lm_head: nn.Module, products: str = DRAFTER_PRODUCTS[0]) -> LeanDrafterWeights:
    """The lean weights of ``model`` (prepared on first use, kept on the model: one copy per drafter;
    prepared again when a weight they copy changes, e.g. training's evaluation loading new weights)."""
    cached = model.__dict__.get("_lean_weights")
    if cached is None or cached.key != _key(model, lm_head, products):
        cached = model.__dict__["_lean_weights"] = LeanDrafterWeights(model, lm_head, products)
    return cached


def up_to_date(weights: LeanDrafterWeights, lm_head: nn.Module) -> LeanDrafterWeights:
    """``weights``, or the drafter's lean weights made again where a weight they copy has changed since
    (training's evaluation loads new weights into a drafter whose proposers already hold lean weights)."""
    if weights.key == _key(weights.model, lm_head, weights.products):
        return weights
    return lean_weights_of(weights.model, lm_head, weights.products)


def release_float_weights(model: DrafterModel, lm_head: nn.Module) -> int:
    """Drop the float32 weights the lean copies were made from (the drafter's own Linears, its own
    reduced output layer; never a target's ``lm_head``): for inference on the lean forward they are a
    second copy (the bundled drafter's 38 MB beside its 10 MB of Q8_0 records). Each becomes a ``meta``
    tensor of its shape, so the module still describes the model; its Hugging Face forward and preparing
    new lean weights then raise a ``DartreeError`` that says how to keep them. The lean weights are made first where they are not
    yet. Returns the bytes dropped."""
    lean = lean_weights_of(model, lm_head)
    owned = {id(m) for m in model.modules()}
    dropped = 0
    for linear in _prepared_linears(model, lm_head):
        weight = linear.weight
        if id(linear) not in owned or weight.device.type == "meta":
            continue
        dropped += weight.numel() * weight.element_size()
        linear.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
    lean.key = _key(model, lm_head, lean.products)  # the same weights, now held only by the lean copies
    model.__dict__["_lean_weights"] = lean
    return dropped


@torch.no_grad()
def lean_draft_forward(weights: LeanDrafterWeights, stores: list, block_embeds: torch.Tensor,
                       tapped_states: list[torch.Tensor], starts: list[int]) -> torch.Tensor:
    """One drafter call for R requests: request i's new tapped states [C_i, m*H] (positions
    start_i - C_i .. start_i - 1) become context K/V in its store (``targets.lean.KVStore``, one slot,
    committed), then its block [Q, H] (``block_embeds`` [R, Q, H]) at positions start_i .. start_i + Q - 1
    runs through the layers seeing the committed context and its whole block. Returns the final-normed
    block states [R, Q, H]; the blocks' K/V are not committed (the next call writes over them)."""
    ext, w = weights._ext, weights
    requests, q_len, hidden = block_embeds.shape
    new = [s.shape[0] for s in tapped_states]
    for store, start in zip(stores, starts):
        store.reserve(start + q_len)
    has_context = sum(new) > 0
    zero = torch.zeros(q_len, dtype=torch.long)
    every = torch.ones(q_len, q_len, dtype=torch.uint8)
    # context rows: fused once, their K/V written into each request's store at their positions
    if has_context:
        states = torch.cat(tapped_states) if requests > 1 else tapped_states[0]
        ctx = ext.rmsnorm(w.product(states.to(torch.float32).contiguous(), w.fc), w.hidden_norm, w.eps)
        ctx_pos = torch.cat([torch.arange(s - n, s) for s, n in zip(starts, new)])
        cos_c, sin_c = w.rope(ctx_pos)
    block_pos = torch.cat([torch.arange(s, s + q_len) for s in starts])
    cos_b, sin_b = w.rope(block_pos)
    x = block_embeds.reshape(requests * q_len, hidden).to(torch.float32).contiguous()
    for i, layer in enumerate(w.layers):
        if has_context:
            kv = w.product(ctx, layer.kv)
            row = 0
            for store, n, start in zip(stores, new, starts):
                if n:
                    rows = slice(row, row + n)
                    ext.rope_store(kv[rows].contiguous(), cos_c[rows].contiguous(), sin_c[rows].contiguous(), layer.q_norm,
                                   layer.k_norm, w.eps, 0, w.kv_heads, store.k[i], store.v[i],
                                   torch.zeros(n, dtype=torch.long), torch.arange(start - n, start))
                row += n
        h = ext.rmsnorm(x, layer.input_norm, w.eps)
        qkv = w.product(h, layer.qkv)
        outs = []
        for r, (store, start) in enumerate(zip(stores, starts)):
            rows = slice(r * q_len, (r + 1) * q_len)
            q = ext.rope_store(qkv[rows].contiguous(), cos_b[rows].contiguous(), sin_b[rows].contiguous(), layer.q_norm,
                               layer.k_norm, w.eps, w.heads, w.kv_heads, store.k[i], store.v[i], zero,
                               torch.arange(start, start + q_len))
            outs.append(ext.attention(q, store.k[i], store.v[i], zero, torch.full((q_len,), start, dtype=torch.long),
                                      every, w.heads, w.scale))
        a = torch.cat(outs) if requests > 1 else outs[0]
        x = w.product(a, layer.o, x)
        h = ext.rmsnorm(x, layer.post_norm, w.eps)
        x = w.product(ext.swiglu(w.product(h, layer.gate_up)), layer.down, x)
    for store, start in zip(stores, starts):
        store.lengths[0] = start
    return ext.rmsnorm(x, w.final_norm, w.eps).view(requests, q_len, hidden)


def lean_logits(weights: LeanDrafterWeights, hidden: torch.Tensor) -> torch.Tensor:
    """The drafter's output layer over rows [..., H]."""
    flat = hidden.reshape(-1, weights.hidden).contiguous()
    return weights.product(flat, weights.output).view(*hidden.shape[:-1], weights.vocab)
