"""The lean target forward: the whole decoder as plain functions over weights prepared once.

For the decoder families dartree ships and tests (Llama: SmolLM2; Qwen3) on a CPU in float32 or
float64, the target runs without the Hugging Face module stack:

- ``LeanWeights``: fused QKV and gate/up weights, every product's weight packed once into the
  kernels' block layout, the final norm, the output layer, and Hugging Face's own RoPE tables;
- ``KVStore``: one preallocated K/V store for ``slots`` requests ([layers, slots, kv heads,
  capacity, head dim]), grown by doubling when a request needs more room;
- ``forward``: one pass over any rows of any slots, each row with its own position, its cache
  position and what it sees (the slot's committed cache, then its own new rows: a prompt chunk's
  causal triangle or a draft tree's ancestors), the tapped layers' states collected on the way;
- ``LeanTarget``: the ``targets.base.Target`` on them, many requests (slots) per forward.

Every kernel (``csrc/lean_kernels.cpp``) gives a row the same bits whatever the row count and
whatever other rows share the forward, so a tree verification computes exactly the logits of a
one-token step: at temperature 0 every method reproduces the lean ``ar`` token for token by
construction, not by the luck of a margin. Any other model, dtype or device keeps the Hugging
Face forward (``targets.hf.HFTarget``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import kernels
from ..errors import DartreeError
from ..taps import check_tapped_layers, decoder_layers
from .base import Part

FAMILIES = ("llama", "qwen3")  # config.model_type values the lean forward implements
PREFILL_CHUNK = 256  # prompt rows per forward: bounds the visibility matrix (rows are invariant, so chunks change nothing)
# How the weight products run. "exact": the compiled row-invariant kernels in the model's dtype (a
# row's bits do not depend on the other rows: the product's promise). "bfloat16": inputs rounded to
# bf16, multiplied by bf16 weights in torch's own kernels (oneDNN: AMX / AVX-512-BF16 where the CPU
# has them, several times faster for many rows), accumulated and returned in float32; norms, RoPE,
# attention, the K/V store and the residual stream stay float32. Not row-invariant and not the
# float32 target's bits: for work that need not be exact (the drafter's training data).
PRODUCTS = ("exact", "bfloat16")


def from_gguf(model: nn.Module) -> bool:
    """Whether ``model`` is a ``quantized.model_from_gguf`` module: its weights other than the norms are only in its
    GGUF file (the module's are on the meta device), which the quantised target reads."""
    return bool(getattr(model, "dartree_weights_in_gguf", False))


def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot run on the lean forward (None when it can)."""
    cfg = model.config
    param = next(model.parameters())
    if getattr(cfg, "model_type", None) not in FAMILIES:
        return f"model type {getattr(cfg, 'model_type', None)!r} (the lean forward implements {', '.join(FAMILIES)})"
    if param.device.type != "cpu" and not from_gguf(model):  # (a module from a GGUF file: its weights are the file's)
        return f"device {param.device.type} (the lean forward is for the CPU)"
    if param.dtype not in (torch.float32, torch.float64):
        return f"dtype {param.dtype} (the lean forward is float32/float64)"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "biased projections"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])) or getattr(cfg, "use_sliding_window", False):
        return "sliding-window layers"
    if not kernels.available():
        return "no compiled kernels on this machine"
    return None


@dataclass
class LayerWeights:
    qkv: torch.Tensor      # packed [q; k; v]
    o: torch.Tensor        # packed o_proj
    gate_up: torch.Tensor  # packed [gate; up]
    down: torch.Tensor     # packed down_proj
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor   # [head_dim] (Qwen3) or empty
    k_norm: torch.Tensor


class LeanWeights:
    """A Hugging Face Llama/Qwen3 model's weights in the lean forward's layout (made once)."""

    integer_products = False  # the products run on block-quantised weights (``QuantizedWeights``)

    def __init__(self, model: nn.Module, products: str = "exact"):
        reason = unsupported_reason(model)
        if reason is not None:
            raise DartreeError(f"the lean forward does not run this target: {reason}")
        if products not in PRODUCTS:
            raise DartreeError(f"products must be one of {', '.join(PRODUCTS)}, got {products!r}")
        ext = kernels.load()
        self.products = products
        self._ext = ext  # the compiled module, loaded once: ``product`` runs four times a layer
        cfg = model.config
        self.model = model
        self.hidden = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.heads
        self.intermediate = cfg.intermediate_size
        self.eps = float(cfg.rms_norm_eps)
        self.scale = self.head_dim ** -0.5
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
        self.dtype = next(model.parameters()).dtype
        empty = torch.empty(0, dtype=self.dtype)
        self.layers: list[LayerWeights] = []
        with torch.no_grad():
            for i, block in enumerate(decoder_layers(model)):
                att, mlp = block.self_attn, block.mlp
                qn = getattr(att, "q_norm", None)
                kn = getattr(att, "k_norm", None)
                self.layers.append(LayerWeights(
                    self.prepare("qkv", i, lambda: torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])),
                    self.prepare("o", i, lambda: att.o_proj.weight),
                    self.prepare("gate_up", i, lambda: torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    self.prepare("down", i, lambda: mlp.down_proj.weight),
                    block.input_layernorm.weight.detach().contiguous(),
                    block.post_attention_layernorm.weight.detach().contiguous(),
                    qn.weight.detach().contiguous() if qn is not None else empty,
                    kn.weight.detach().contiguous() if kn is not None else empty))
            self.final_norm = model.model.norm.weight.detach().contiguous()
            out = model.get_output_embeddings()
            self.vocab = out.weight.shape[0]
            self.output = self.prepare("output", None, lambda: out.weight)
        self.embedding = model.get_input_embeddings()
        self._cos = self._sin = None

    @property
    def row_invariant(self) -> bool:
        """Whether a row's outputs are independent of the other rows of a forward."""
        return self.products == "exact"

    @property
    def products_name(self) -> str:
        """How the products run, as the target's name says it (``LeanTarget.name``)."""
        return "fp32" if self.products == "exact" else self.products

    def prepare(self, role: str, layer: int | None, float_weight) -> torch.Tensor:
        """The product weight of ``role`` ("qkv", "o", "gate_up", "down"; "output": the output layer,
        ``layer`` None) from the model's float weight (``float_weight()``), in this class's layout."""
        w = float_weight().detach()
        return self._ext.pack_weight(w) if self.products == "exact" else w.to(torch.bfloat16).contiguous()

    def compiled_forward(self):
        """The layer loop bound to these weights in one compiled call (``kernels.load_forward``; made once),
        or None where it does not run: bfloat16 products, or no compiled module."""
        if "_bound" not in self.__dict__:
            self._bound = None
            module = kernels.load_forward() if self.integer_products or self.products == "exact" else None
            if module is not None:
                sizes = {"qkv": (self.heads + 2 * self.kv_heads) * self.head_dim, "o": self.hidden,
                         "gate_up": 2 * self.intermediate, "down": self.hidden}
                # per layer and role, the weight's parts (one, or a quantised file's parts of different types):
                # a quantised part's packed records, or the float32 packed blocks themselves
                weights, outputs = {}, {}
                for role, size in sizes.items():
                    parts = [self.weight_parts(getattr(layer, role), size) for layer in self.layers]
                    weights[role] = [[w for w, _ in layer_parts] for layer_parts in parts]
                    outputs[role] = [[n for _, n in layer_parts] for layer_parts in parts]
                norms = {name: [getattr(layer, name) for layer in self.layers]
                         for name in ("input_norm", "post_norm", "q_norm", "k_norm")}
                self._bound = module.Forward(weights["qkv"], weights["o"], weights["gate_up"], weights["down"],
                                             outputs["qkv"], outputs["o"], outputs["gate_up"], outputs["down"],
                                             norms["input_norm"], norms["post_norm"], norms["q_norm"], norms["k_norm"],
                                             self.final_norm, self.integer_products, self.heads, self.kv_heads, self.eps,
                                             self.scale)
        return self._bound

    def weight_parts(self, weight, n: int) -> list[tuple[torch.Tensor, int]]:
        """A product's weight as the compiled loop takes it: (packed part, its output size) for each part."""
        return [(weight, n)]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hugging Face's own cos/sin [n, head_dim] at ``positions`` (tables grown by doubling)."""
        # Requests are checked against the context before they run (``check_context_length``); the cost
        # model's timing may go past it on a tiny model, as Hugging Face's forward allows.
        need = int(positions.max()) + 1
        if self._cos is None or self._cos.shape[0] < need:
            size = max(need, min(self.max_positions, max(2 * (0 if self._cos is None else self._cos.shape[0]), 1024)))
            ids = torch.arange(size)[None]
            with torch.no_grad():
                cos, sin = self.model.model.rotary_emb(torch.zeros(1, dtype=self.dtype), ids)
            self._cos, self._sin = cos[0].to(self.dtype).contiguous(), sin[0].to(self.dtype).contiguous()
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def product(self, x: torch.Tensor, weight: torch.Tensor, n: int, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ W.T (+ residual) -> [M, n], W prepared for ``products``."""
        if self.products == "exact":
            return self._ext.product(x, weight, n, residual)
        y = nn.functional.linear(x.to(torch.bfloat16), weight).to(self.dtype)
        return y if residual is None else y.add_(residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer over final-normed rows [..., H] (row-invariant with exact products)."""
        flat = hidden.reshape(-1, self.hidden).contiguous()
        return self.product(flat, self.output, self.vocab).reshape(*hidden.shape[:-1], self.vocab)


class KVStore:
    """K/V of ``slots`` requests in one store [layers, slots, kv heads, capacity, head dim]; ``lengths``
    holds each slot's committed length. Grown by doubling (the rows of every slot kept)."""

    def __init__(self, weights: LeanWeights, slots: int = 1, capacity: int = 512):
        self.weights = weights
        self.slots = slots
        self.lengths = [0] * slots
        shape = (len(weights.layers), slots, weights.kv_heads, capacity, weights.head_dim)
        # never zero-filled: attention reads a slot's committed rows and the rows its forward has just
        # written, nothing else, so the pages of positions no request has reached stay unallocated
        # (a store sized for a long prompt in one slot costs memory only where it is written)
        self.k = torch.empty(shape, dtype=weights.dtype)
        self.v = torch.empty(shape, dtype=weights.dtype)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, need: int) -> None:
        """Make room for ``need`` positions in every slot."""
        if need <= self.capacity:
            return
        size = min(max(need, 2 * self.capacity), max(self.weights.max_positions, need))
        self._reallocate(self.slots, size)

    def _reallocate(self, slots: int, capacity: int) -> None:
        """New K/V of ``slots`` slots and ``capacity`` positions holding each slot's committed rows (the
        rest stays unwritten, see __init__)."""
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], slots, old.shape[2], capacity, old.shape[4]))
            for slot, length in enumerate(self.lengths):
                new[:, slot, :, :length] = old[:, slot, :, :length]
            setattr(self, name, new)

    def add_slots(self, slots: int) -> None:
        """Hold at least ``slots`` requests (the slots already held keep their rows)."""
        if slots <= self.slots:
            return
        self._reallocate(slots, self.capacity)
        self.lengths += [0] * (slots - self.slots)
        self.slots = slots

    def keep(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Keep the K/V of new rows ``rows`` (indices from ``start``) at ``start``.. and commit them."""
        n = rows.numel()
        if n and not torch.equal(rows, torch.arange(n)):
            src = start + rows
            for t in (self.k, self.v):
                t[:, slot, :, start:start + n] = t[:, slot, :, :].index_select(2, src)
        self.lengths[slot] = start + n


@dataclass
class Rows:
    """The rows of one forward: each row's token, slot, RoPE position, cache position, the committed
    length it sees, and which of its request's new rows it sees (``visible`` [n, width] uint8; new
    row j of a request lives at cache position ``past + j``)."""

    tokens: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    cache_positions: torch.Tensor
    past: torch.Tensor
    visible: torch.Tensor

    @staticmethod
    def one_request(tokens: torch.Tensor, slot: int, past: int, depths: torch.Tensor, visible: torch.Tensor) -> "Rows":
        n = tokens.numel()
        return Rows(tokens, torch.full((n,), slot, dtype=torch.long), past + depths, past + torch.arange(n),
                    torch.full((n,), past, dtype=torch.long), visible.to(torch.uint8).contiguous())


@torch.no_grad()
def forward(weights: LeanWeights, store: KVStore, rows: Rows, tapped_layers: list[int] = (),
            compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decoder pass over ``rows``: their K/V written into the store at their cache positions,
    final-normed states [n, H] returned with the tapped layers' outputs [n, len(tapped_layers) * H] (None
    without tapped_layers). Plain functions over prepared weights: a few compiled calls per layer, run by
    one compiled call (``LeanWeights.compiled_forward``) where it is built; ``compiled=False`` loops here
    (the reference the tests hold it to, bit for bit)."""
    w = weights
    cos, sin = w.rope(rows.positions)
    x = w.embedding(rows.tokens).to(w.dtype).contiguous()
    bound = w.compiled_forward() if compiled else None
    if bound is not None:  # the same kernels in the same order, in one call
        return tuple(bound.run(x, cos, sin, store.k, store.v, rows.slots, rows.cache_positions, rows.past, rows.visible,
                               list(tapped_layers)))
    ext = kernels.load()
    tapped = {}
    hidden = w.hidden
    k_layers, v_layers = store.k.unbind(0), store.v.unbind(0)  # each layer's K/V view, made in one call
    for i, layer in enumerate(w.layers):
        k_cache, v_cache = k_layers[i], v_layers[i]
        h = ext.rmsnorm(x, layer.input_norm, w.eps)
        qkv = w.product(h, layer.qkv, (w.heads + 2 * w.kv_heads) * w.head_dim)
        q = ext.rope_store(qkv, cos, sin, layer.q_norm, layer.k_norm, w.eps, w.heads, w.kv_heads, k_cache, v_cache,
                           rows.slots, rows.cache_positions)
        a = ext.attention(q, k_cache, v_cache, rows.slots, rows.past, rows.visible, w.heads, w.scale)
        x = w.product(a, layer.o, hidden, x)
        h = ext.rmsnorm(x, layer.post_norm, w.eps)
        x = w.product(ext.swiglu(w.product(h, layer.gate_up, 2 * w.intermediate)), layer.down, hidden, x)
        if i in tapped_layers:
            tapped[i] = x
    tapped_states = torch.cat([tapped[i] for i in tapped_layers], dim=-1) if tapped_layers else None
    return ext.rmsnorm(x, w.final_norm, w.eps), tapped_states


class LeanOutput(nn.Module):
    """The target's output layer on the packed weight; ``weight`` is the model's own (the drafter
    borrows it, as it borrows the embedding), or, for a target built straight from its GGUF file (no
    float32 weights), the file's output weight dequantised on first use: its values, bit for bit."""

    def __init__(self, weights: LeanWeights, head: nn.Module):
        super().__init__()
        self._weights = weights
        if head.weight.device.type == "meta":
            self._dequantized = None
        else:
            self.weight = head.weight

    def __getattr__(self, name):
        if name == "weight" and "_dequantized" in self.__dict__:
            if self.__dict__["_dequantized"] is None:
                from .. import quant

                self.__dict__["_dequantized"] = nn.Parameter(quant.dequantize(self._weights.output), requires_grad=False)
            return self.__dict__["_dequantized"]
        return super().__getattr__(name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dtype != self._weights.dtype or torch.is_grad_enabled() and hidden.requires_grad:
            return nn.functional.linear(hidden, self.weight)
        return self._weights.logits(hidden)


class LeanTarget:
    """The ``targets.base.Target`` on the lean forward: any number of slots in one K/V store, one
    forward over the rows of many slots. Row-invariant with the "exact" products."""

    name = "lean"
    max_slots = None
    prefill_chunk = PREFILL_CHUNK

    def __init__(self, model: nn.Module, tapped_layers: list[int] | tuple[int, ...] = (), weights: LeanWeights | None = None,
                 products: str = "exact"):
        self.model = model.eval()
        self.config = model.config
        self.weights = weights or LeanWeights(model, products)
        check_tapped_layers(tapped_layers, len(self.weights.layers))
        self.tapped_layers = [int(i) for i in tapped_layers]
        self.capture = bool(self.tapped_layers)
        self.store = KVStore(self.weights, slots=1)
        self._lm_head = LeanOutput(self.weights, model.get_output_embeddings())
        self.row_invariant = self.weights.row_invariant
        # the fp32 forward keeps the name its cost models are cached under; others say their products
        self.name = "lean" if self.weights.products_name == "fp32" else f"lean-{self.weights.products_name}"

    @property
    def embed_tokens(self) -> nn.Embedding:
        """The token embedding the forward uses (the file's Q8_0 rows on a quantised target, where they are
        the checkpoint's), for the drafter and its head."""
        return self.weights.embedding

    @property
    def lm_head(self) -> nn.Module:
        return self._lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.weights.dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def close(self) -> None:
        pass

    # ------------------------------------------------------------- the Target contract
    def reserve_slots(self, slots: int) -> int:
        self.store.add_slots(slots)
        return slots

    def reset_slot(self, slot: int) -> None:
        self.store.lengths[slot] = 0

    def slot_length(self, slot: int) -> int:
        return self.store.lengths[slot]

    @torch.no_grad()
    def forward_parts(self, parts: list[Part]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """ONE forward over the rows of every part, split back per part: final-normed states [n, H]
        and tapped states."""
        store = self.store
        width = max(p.tokens.numel() for p in parts)
        rows = []
        for p in parts:
            n, past = p.tokens.numel(), store.lengths[p.slot]
            visible = torch.zeros(n, width, dtype=torch.uint8)
            visible[:, :n] = p.visible.cpu()
            rows.append(Rows(p.tokens.cpu(), torch.full((n,), p.slot, dtype=torch.long), past + p.depths.cpu(),
                             torch.arange(past, past + n), torch.full((n,), past, dtype=torch.long), visible))
        # every row's visibility spans ``width`` new rows after its own slot's committed length
        store.reserve(max(store.lengths[p.slot] for p in parts) + width)
        batch = rows[0] if len(rows) == 1 else Rows(*(torch.cat(t) for t in zip(*(
            (r.tokens, r.slots, r.positions, r.cache_positions, r.past, r.visible) for r in rows))))
        hidden, tapped = forward(self.weights, store, batch, self.tapped_layers if self.capture else ())
        out, at = [], 0
        for p in parts:
            n = p.tokens.numel()
            store.lengths[p.slot] += n
            out.append((hidden[at:at + n], tapped[at:at + n] if tapped is not None else None))
            at += n
        return out

    def keep(self, slot: int, start: int, rows: torch.Tensor) -> None:
        self.store.keep(slot, start, rows.cpu())
