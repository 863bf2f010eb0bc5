"""The target on the Hugging Face forward: any decoder-only causal LM, one request (slot) at a time.

It implements ``targets.base.Target``: a prompt runs into an empty cache with the model's own
causal mask; a draft tree (or a single root) is appended to the cache with an ancestor-only
additive mask at positions start + depth; ``keep`` compacts the cache to the accepted path; the
tapped layers' states come from forward hooks (equal to HF ``hidden_states[i+1]``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..attention import kv_cache_dtype
from ..errors import DartreeError
from ..taps import LayerTap, decoder_layers
from .base import Part


class GrowingLayer(DynamicLayer):
    """A KV-cache layer that grows like a vector: K/V live in a buffer with spare capacity and
    ``keys`` / ``values`` are views of its filled part. Hugging Face's ``DynamicLayer`` concatenates,
    copying the whole cache at every step: measured 10 % of a one-token step of SmolLM2-135M at a
    256-token context on one CPU thread. Compaction writes into the views and narrows them.

    ``storage_dtype`` keeps K/V in another dtype than the model computes them in: float32 for a
    bf16/fp16 model on the CPU, whose attention runs in float32 (``attention.kv_cache_dtype``), so
    the attention reads the cache as it is instead of casting all of it at every step (measured
    58 % of a 64-row bf16 decoding step at a 600-token context). bf16 -> fp32 is exact, so the
    outputs are the same."""

    def __init__(self, storage_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(**kwargs)
        self.storage_dtype = storage_dtype

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf = self._vbuf = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = 0 if self._kbuf is None else self.keys.shape[-2]
        need = length + key_states.shape[-2]
        if self._kbuf is None or need > self._kbuf.shape[-2]:
            capacity = max(2 * need, need + 256)
            shape = (*key_states.shape[:-2], capacity, key_states.shape[-1])
            kbuf = key_states.new_empty(shape, dtype=self.storage_dtype or key_states.dtype)
            vbuf = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]),
                                          dtype=self.storage_dtype or value_states.dtype)
            if length:
                kbuf[..., :length, :] = self.keys
                vbuf[..., :length, :] = self.values
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[..., length:need, :] = key_states
        self._vbuf[..., length:need, :] = value_states
        self.keys, self.values = self._kbuf[..., :need, :], self._vbuf[..., :need, :]
        return self.keys, self.values


    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (batched generation drops the sequences that have ended)."""
        if self._kbuf is None:
            return
        length = self.keys.shape[-2]
        self._kbuf, self._vbuf = self._kbuf.index_select(0, rows), self._vbuf.index_select(0, rows)
        self.keys, self.values = self._kbuf[..., :length, :], self._vbuf[..., :length, :]


def growing_cache(config, storage_dtype: torch.dtype | None = None) -> DynamicCache:
    """A DynamicCache whose full-attention layers are ``GrowingLayer`` (others stay as they are)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(storage_dtype) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def all_growing(cache: DynamicCache) -> bool:
    """Whether every layer of ``cache`` is a ``GrowingLayer`` (none is sliding-window or otherwise
    special), so that its rows can be stacked and selected."""
    return all(isinstance(layer, GrowingLayer) for layer in cache.layers)


class HFTarget:
    """The target on the Hugging Face forward (any decoder-only causal LM); see ``targets.base``.
    Not row-invariant: the forward's float sums depend on the row count."""

    name = "hf"
    max_slots = 1  # batching requests needs the lean forward's K/V store
    row_invariant = False
    prefill_chunk = 1 << 62  # a prompt goes in as one forward, as Hugging Face's generate does

    def __init__(self, model: nn.Module, tapped_layers: list[int] | tuple[int, ...] = ()):
        self.model = model.eval()
        self.config = model.config
        decoder_layers(model)  # a clear error for a model without the decoder layout
        self.tapped_layers = [int(i) for i in tapped_layers]
        self._tap = LayerTap(model, self.tapped_layers)
        self.capture = bool(self.tapped_layers)
        self.cache: DynamicCache | None = None
        self._mask_buffer: torch.Tensor | None = None  # tree_mask's, reused across rounds
        self._mask_window: tuple[int, int, int] | None = None  # (rows, first, last column) it filled last

    @property
    def capture(self) -> bool:
        """Whether forwards collect the tapped states (only the drafter methods need them)."""
        return self._tap.enabled

    @capture.setter
    def capture(self, value: bool) -> None:
        self._tap.enabled = bool(value)

    def _tapped_states(self) -> torch.Tensor | None:
        """[n, m*H] tapped states of the last forward (batch 1), in tapped-layer order."""
        if not self.capture or not self.tapped_layers:
            return None
        return self._tap.pop()[0][0]

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def cache_length(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    def _append(self, tokens: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows appended to the cache (``mask``: additive [1, 1, n, past + n], None for one row):
        final-normed states [n, H] and tapped states."""
        start = self.cache_length
        positions = (start + depths)[None]
        out = self.model.model(input_ids=tokens[None], position_ids=positions, attention_mask=mask, cache=self.cache,
                               use_cache=True)
        return out.last_hidden_state[0], self._tapped_states()

    # ------------------------------------------------------------- the Target contract (one slot)
    def reserve_slots(self, slots: int) -> int:
        return 1

    def reset_slot(self, slot: int) -> None:
        self.cache = None

    def slot_length(self, slot: int) -> int:
        return self.cache_length

    @torch.no_grad()
    def forward_parts(self, parts: list[Part]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One request's rows: a prompt into an empty cache (the model's own causal mask), else a
        tree (or a single root) appended to the cache."""
        if len(parts) != 1:
            raise DartreeError(f"the Hugging Face forward runs one request per forward, got {len(parts)}")
        part = parts[0]
        if self.cache is None:
            self.cache = growing_cache(self.config, kv_cache_dtype(self.model))
            out = self.model.model(input_ids=part.tokens[None], cache=self.cache, use_cache=True)
            return [(out.last_hidden_state[0], self._tapped_states())]
        n = part.tokens.numel()
        return [self._append(part.tokens, part.depths, self.tree_mask(part.visible) if n > 1 else None)]

    def keep(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Keep the K/V of new rows ``rows`` (indices from ``start``) at start.. and crop."""
        n_keep = rows.numel()
        contiguous = bool(torch.equal(rows, torch.arange(n_keep, device=rows.device)))
        for layer in self.cache.layers:
            if layer.keys is None:
                continue
            if not contiguous:
                idx = start + rows
                layer.keys[:, :, start : start + n_keep] = layer.keys.index_select(2, idx)
                layer.values[:, :, start : start + n_keep] = layer.values.index_select(2, idx)
            layer.keys = layer.keys[:, :, : start + n_keep]
            layer.values = layer.values[:, :, : start + n_keep]

    def tree_mask(self, visibility: torch.Tensor) -> torch.Tensor:
        """Additive mask [1, 1, n, past + n] from a boolean ancestor matrix [n, n].

        The mask is a view of one buffer kept across rounds (grown, with room to spare, when a round
        needs more rows or columns): a round clears the window the previous round filled and fills
        its own, instead of allocating and zeroing [n, past + n] anew."""
        past = self.cache_length
        n = visibility.shape[0]
        buf = self._mask_buffer
        if buf is None or buf.shape[0] < n or buf.shape[1] < past + n or buf.dtype != self.dtype or buf.device != self.device:
            rows = max(n, 65 if buf is None else buf.shape[0])  # room for the paper's B = 64 and the root
            cols = max(2 * (past + n), 512 if buf is None else buf.shape[1])
            buf = self._mask_buffer = torch.zeros(rows, cols, dtype=self.dtype, device=self.device)
        elif self._mask_window is not None:
            rows, lo, hi = self._mask_window
            buf[:rows, lo:hi] = 0
        buf[:n, past : past + n].masked_fill_(~visibility, torch.finfo(self.dtype).min)
        self._mask_window = (n, past, past + n)
        return buf[None, None, :n, : past + n]

    def close(self) -> None:
        self._tap.close()
