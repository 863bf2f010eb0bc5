"""Block-diffusion drafter backbone (DFlash on-disk format), its correction head and its draft output.

The drafter is a stack of Qwen3-style decoder layers whose queries come only from the draft block
([bonus, MASK, ..., MASK]) while keys/values are the fused target context followed by the block
("KV injection"). Attention is non-causal. The drafter has no embedding of its own: it borrows the
target's, which stays frozen. Its output layer is the target's lm_head too (as in every published
DFlash / Domino checkpoint), unless it carries a reduced draft vocabulary as EAGLE-3 drafters do:
its own ``lm_head.weight`` [V_d, H] over the V_d most frequent target-written tokens and ``d2t`` [V_d]
(target id = draft id + d2t[draft id]), with ``draft_vocab_size`` in config.json. Base logits, the
correction heads and the tree builders then work on draft ids; ``DraftOutput.to_target`` maps the
finished tree's tokens back, so verification only ever sees target ids. The proposer that runs it
once per round is ``proposers.drafter.DraftProposer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .errors import CheckpointError, require
from .heads import CorrectionHead, DominoHead, MarkovHead, to_target_ids

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    shift_label: bool = False
    projector_type: str | None = None  # None (DFlash), "domino" or "markov"
    pure_draft_prefix_len: int = 1
    emb_dim: int = 256
    gru_hidden_dim: int = 1024
    markov_rank: int = 0
    draft_vocab_size: int | None = None  # reduced output vocabulary (own lm_head + d2t); None: the target's
    extra: dict = field(default_factory=dict)  # unknown fields, written back unchanged on save

    @property
    def output_vocab_size(self) -> int:
        """Rows of the base logits: the draft vocabulary when reduced, else the target's."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def num_draft_depths(self) -> int:
        """D: with shifted labels every block position predicts a future token; otherwise position 0 does not."""
        return self.block_size if self.shift_label else self.block_size - 1

    @classmethod
    def from_dict(cls, raw: dict) -> "DrafterConfig":
        raw = dict(raw)
        dflash = dict(raw.pop("dflash_config", None) or {})
        try:
            hidden = int(raw.pop("hidden_size"))
            heads = int(raw.pop("num_attention_heads"))
            rope = raw.pop("rope_parameters", None) or {}
            projector = dflash.pop("projector_type", None)
            if projector == "causal_v5":  # legacy name of the Domino head
                projector = "domino"
            markov_rank = int(dflash.pop("markov_rank", raw.pop("markov_rank", 0)) or 0)
            if projector is None and markov_rank > 0:
                projector = "markov"
            num_layers = int(raw.pop("num_hidden_layers"))
            num_target_layers = int(raw.pop("num_target_layers"))
            layer_ids = dflash.pop("target_layer_ids", None)
            if layer_ids is None:
                layer_ids = default_target_layer_ids(num_target_layers, num_layers)
            cfg = cls(
                hidden_size=hidden,
                intermediate_size=int(raw.pop("intermediate_size")),
                num_hidden_layers=num_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(raw.pop("num_key_value_heads", heads)),
                head_dim=int(raw.pop("head_dim", None) or hidden // heads),
                vocab_size=int(raw.pop("vocab_size")),
                block_size=int(raw.pop("block_size")),
                num_target_layers=num_target_layers,
                mask_token_id=int(dflash.pop("mask_token_id")),
                target_layer_ids=[int(i) for i in layer_ids],
                rms_norm_eps=float(raw.pop("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.pop("rope_theta", rope.get("rope_theta", 1_000_000.0))),
                attention_bias=bool(raw.pop("attention_bias", False)),
                shift_label=bool(dflash.pop("shift_label", False)),
                projector_type=projector,
                pure_draft_prefix_len=int(dflash.pop("pure_draft_prefix_len", 1)),
                emb_dim=int(dflash.pop("emb_dim", 256)),
                gru_hidden_dim=int(dflash.pop("gru_hidden_dim", 1024)),
                markov_rank=markov_rank,
                draft_vocab_size=int(raw.pop("draft_vocab_size")) if raw.get("draft_vocab_size") else None,
            )
        except KeyError as exc:
            raise CheckpointError(
                f"drafter config.json lacks the field {exc.args[0]!r}; a DFlash-format drafter needs "
                "hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size, "
                "block_size, num_target_layers and dflash_config.mask_token_id"
            ) from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"drafter config.json has a field of the wrong type: {exc}") from None
        require(
            cfg.draft_vocab_size is None or 1 <= cfg.draft_vocab_size <= cfg.vocab_size,
            f"draft_vocab_size must be between 1 and vocab_size ({cfg.vocab_size}), got {cfg.draft_vocab_size}",
            CheckpointError,
        )
        require(cfg.block_size >= 2, f"block_size must be at least 2, got {cfg.block_size}", CheckpointError)
        require(
            cfg.projector_type in (None, "domino", "markov"),
            f"unknown dflash_config.projector_type {cfg.projector_type!r}; expected 'domino', 'markov' or none",
            CheckpointError,
        )
        raw.pop("architectures", None)
        raw.pop("auto_map", None)
        cfg.extra = {"top": raw, "dflash_config": dflash}
        return cfg

    def to_dict(self) -> dict:
        arch = {"domino": "DominoDraftModel", "markov": "DSparkDraftModel"}.get(self.projector_type, "DFlashDraftModel")
        dflash = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "shift_label": self.shift_label,
        }
        if self.projector_type == "domino":
            dflash.update(
                projector_type="domino",
                emb_dim=self.emb_dim,
                gru_hidden_dim=self.gru_hidden_dim,
                pure_draft_prefix_len=self.pure_draft_prefix_len,
            )
        elif self.projector_type == "markov":
            dflash.update(projector_type="markov", markov_rank=self.markov_rank)
        dflash.update(self.extra.get("dflash_config", {}))
        out = dict(self.extra.get("top", {}))
        out.update(
            architectures=[arch],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            attention_bias=self.attention_bias,
            layer_types=["full_attention"] * self.num_hidden_layers,
            tie_word_embeddings=False,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config=dflash,
        )
        if self.draft_vocab_size:
            out["draft_vocab_size"] = self.draft_vocab_size
        return out


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Uniformly spaced tapped layers between 1 and L-3 (the published default)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32) if dtype in (torch.float16, torch.bfloat16) else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape [..., L, head_dim] for integer positions [..., L]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    freqs = positions.to(torch.float64)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class DrafterCache:
    """Per-layer K/V of the fused context. Block K/V never stay: the proposer crops after each call."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=-2)
            v = torch.cat([self.values[layer], v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, length: int) -> None:
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                self.keys[i], self.values[i] = k[..., :length, :], v[..., :length, :]


@dataclass
class PackedBlocks:
    """Visibility of many blocks packed into one query sequence (training): block j sees the context
    positions ``ctx_visible[j * block_size + i]`` marks and its own ``block_size`` keys, never another
    block's. Passed as ``attn_mask`` in place of the dense [Q, C + Q] mask, whose Q x Q block part is
    all but its diagonal masked: scores are computed only where something can be seen, so the work
    grows with Q * (C + block_size) instead of Q * (C + Q)."""

    ctx_visible: torch.Tensor  # [Q, C] bool (True = visible)
    block_size: int


def packed_block_attention(q, k, v, blocks: PackedBlocks) -> torch.Tensor:
    """Attention of [B, H, Q, hd] queries over [B, H, C + Q, hd] keys/values (context, then the packed
    blocks) under ``blocks``; one softmax over both parts, so it is the dense masked attention."""
    b, h, n_q, d = q.shape
    n_ctx, blk = k.shape[2] - n_q, blocks.block_size
    n_blocks = n_q // blk
    scale = d ** -0.5
    s_ctx = (q @ k[:, :, :n_ctx].transpose(-1, -2)).mul_(scale).masked_fill_(~blocks.ctx_visible, float("-inf"))
    q_b = q.reshape(b, h, n_blocks, blk, d)
    k_b = k[:, :, n_ctx:].reshape(b, h, n_blocks, blk, d)
    v_b = v[:, :, n_ctx:].reshape(b, h, n_blocks, blk, d)
    s_own = (q_b @ k_b.transpose(-1, -2)).mul_(scale).reshape(b, h, n_q, blk)
    p = torch.cat([s_ctx, s_own], dim=-1).softmax(-1)
    p_ctx, p_own = p[..., :n_ctx], p[..., n_ctx:].reshape(b, h, n_blocks, blk, blk)
    return p_ctx @ v[:, :, :n_ctx] + (p_own @ v_b).reshape(b, h, n_q, d)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x, ctx, cos_q, sin_q, cos_k, sin_k, cache: DrafterCache | None, layer: int, mask):
        cfg = self.cfg
        b, q_len, _ = x.shape
        c_len = ctx.shape[1]
        kv_in = torch.cat([ctx, x], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, cfg.num_attention_heads, cfg.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, c_len + q_len, cfg.num_key_value_heads, cfg.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, c_len + q_len, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        q = q * cos_q + rotate_half(q) * sin_q
        k = k * cos_k + rotate_half(k) * sin_k
        if cache is not None:
            k, v = cache.append(layer, k, v)
        groups = cfg.num_attention_heads // cfg.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if isinstance(mask, PackedBlocks):
            out = packed_block_attention(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, x, ctx, rope, cache, layer, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, *rope, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def build_head(cfg: DrafterConfig) -> CorrectionHead | None:
    """The correction head a drafter config declares (``projector_type``), or None."""
    if cfg.projector_type == "domino":
        return DominoHead(cfg.hidden_size, cfg.gru_hidden_dim, cfg.emb_dim, cfg.output_vocab_size, cfg.pure_draft_prefix_len)
    if cfg.projector_type == "markov":
        return MarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.output_vocab_size)
    return None


RELEASED = ("the drafter's float32 weights were released once its lean copies were made (dartree.load does so to "
            "save memory); load it with keep_drafter_weights=True to run its Hugging Face forward or change its weights")


class DrafterModel(nn.Module):
    """The drafter weights: backbone (+ optional correction head), named as in the published format."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.mask_embedding: nn.Parameter | None = None
        self.lm_head: nn.Linear | None = None
        if cfg.draft_vocab_size:
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self.head: CorrectionHead | None = build_head(cfg)

    @property
    def float_weights_released(self) -> bool:
        """Whether ``lean_drafter.release_float_weights`` dropped the Linears' float weights (``dartree.load``
        does where the drafter runs on the lean forward): only the lean copies remain."""
        return self.fc.weight.device.type == "meta"

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (the identity without a reduced vocabulary)."""
        return to_target_ids(self.d2t, draft_ids)

    def target_to_draft(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] draft id of every target id, -1 where the draft vocabulary lacks it."""
        out = torch.full((vocab_size,), -1, dtype=torch.long, device=self.norm.weight.device)
        ids = torch.arange(self.config.output_vocab_size, device=out.device)
        out[self.draft_to_target(ids)] = ids
        return out

    def block_embeddings(self, embed_tokens: nn.Embedding, first_tokens: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        """[N] anchor tokens -> [N, block_size, H] embeddings of [anchor, MASK, ...] (the config's block
        size unless one is given)."""
        cfg = self.config
        block_size = cfg.block_size if block_size is None else block_size
        anchor = embed_tokens(first_tokens)[:, None, :]
        if self.mask_embedding is not None:
            mask = self.mask_embedding.to(anchor.dtype)
        else:
            mask = embed_tokens(torch.tensor([cfg.mask_token_id], device=first_tokens.device))[0]
        masks = mask.expand(first_tokens.shape[0], block_size - 1, -1)
        return torch.cat([anchor, masks], dim=1)

    def fuse_context(self, tapped_states: torch.Tensor) -> torch.Tensor:
        """[.., C, m*H] concatenated tapped target states -> [.., C, H] injected context."""
        return self.hidden_norm(self.fc(tapped_states))

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, Q, H]
        tapped_states: torch.Tensor,  # [B, C, m*H]
        ctx_positions: torch.Tensor,  # [C] or [B, C]
        block_positions: torch.Tensor,  # [Q] or [B, Q]
        cache: DrafterCache | None = None,
        attn_mask: torch.Tensor | PackedBlocks | None = None,  # [B or 1, 1, Q, cache + C + Q], bool (True = visible), or packed blocks
    ) -> torch.Tensor:
        cfg = self.config
        require(not self.float_weights_released, RELEASED)
        ctx = self.fuse_context(tapped_states)
        dtype = block_embeds.dtype
        cos_q, sin_q = rope_cos_sin(block_positions, cfg.head_dim, cfg.rope_theta, dtype)
        cos_k, sin_k = rope_cos_sin(torch.cat([ctx_positions, block_positions], dim=-1), cfg.head_dim, cfg.rope_theta, dtype)
        # broadcast over heads: [B?, 1, L, hd]
        rope = tuple(t.unsqueeze(-3) for t in (cos_q, sin_q, cos_k, sin_k))
        x = block_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope, cache, i, attn_mask)
        return self.norm(x)


# ---------------------------------------------------------------- one draft call per round


@dataclass
class DraftOutput:
    """What the backbone proposes for one round: D hidden states and their base logits."""

    bonus: int  # a target id
    hidden: torch.Tensor  # [D, H] final-normed drafter states (z_d)
    base_logits: torch.Tensor  # [D, V_d] lm_head(z_d), over draft ids
    d2t: torch.Tensor | None = None  # [V_d] offsets to target ids; None: draft ids are target ids

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return to_target_ids(self.d2t, draft_ids)
