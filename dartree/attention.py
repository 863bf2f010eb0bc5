"""The Hugging Face forward's attention: SDPA, run in float32 for a bf16/fp16 model on a CPU, and the
KV-cache dtype that follows from it. ``loading.load_target`` loads targets with it."""

from __future__ import annotations

import torch

ATTENTION = "dartree_sdpa"


def attention_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """The dtype attention runs in for a model in ``dtype`` on ``device`` (see ``_sdpa_fp32_on_cpu``);
    KV caches store K/V in it."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def kv_cache_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype a KV cache for ``model`` stores K/V in: its attention's dtype when it runs the
    attention registered here (K/V then need no cast at each step), else the model's own dtype
    (a plain SDPA model wants K/V in the query's dtype)."""
    param = next(model.parameters())
    if getattr(model.config, "_attn_implementation", None) == ATTENTION:
        return attention_dtype(param.dtype, param.device)
    return param.dtype


def _sdpa_fp32_on_cpu(module, query, key, value, attention_mask, **kwargs):
    """Hugging Face's SDPA attention, run in float32 when a CPU model is in bf16/fp16: torch's CPU
    flash-attention kernel is ~2.5x slower per call in bf16 than in fp32 (measured 277 vs 114 us per
    layer for one query over 256 keys, SmolLM2-135M, one thread: 8 of 55 ms of a bf16 step), and
    casting q/k/v up costs less than the difference. Elsewhere (and for fp32/fp64) it is plain SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    work = attention_dtype(dtype, query.device)
    if work == dtype:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.to(work)
    # K/V from a cache that stores them in ``work`` already (``target.GrowingLayer``) cast for free.
    out, weights = sdpa_attention_forward(module, query.to(work), key.to(work), value.to(work), attention_mask, **kwargs)
    return out.to(dtype), weights


def register_attention() -> str:
    """The name of dartree's attention for ``from_pretrained(attn_implementation=...)``, registered with transformers."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION, _sdpa_fp32_on_cpu)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION
