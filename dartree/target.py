"""Target adapter: any Hugging Face causal LM, driven through its KV cache.

It does four things: prefill the prompt, run ONE forward over a whole draft tree (ancestor-only
additive mask, position = start + depth), compact the KV cache to the accepted path, and collect
the hidden states of chosen decoder layers with forward hooks (equal to HF ``hidden_states[i+1]``),
which the drafter uses as its context.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .errors import DartreeError
from .attention import kv_cache_dtype
from .taps import LayerTap, decoder_layers


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


class TargetAdapter:
    """The target adapter on the Hugging Face forward (any decoder-only causal LM)."""

    kind = "hf"

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

    def _features(self) -> torch.Tensor | None:
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

    # ------------------------------------------------------------- forwards
    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [P]. Returns the logits [V] at the last prompt position and features [P, m*H]."""
        self.cache = growing_cache(self.config, kv_cache_dtype(self.model))
        out = self.model(input_ids=input_ids[None], cache=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1], self._features()

    @torch.no_grad()
    def forward_tree(self, tokens: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over [root, nodes...] appended to the cache.

        tokens [n], depths [n] (root depth 0), mask: additive [1, 1, n, past + n], or None for a
        single root token (plain autoregressive step). Returns logits [n, V] and features [n, m*H].
        """
        hidden, features = self.forward_tree_hidden(tokens, depths, mask)
        return self.lm_head(hidden), features

    @torch.no_grad()
    def forward_tree_hidden(self, tokens: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_tree`` without the output layer: final-normed states [n, H] (``lm_head`` of a row
        gives its logits), so that verification pays the output layer only for rows it visits."""
        start = self.cache_length
        positions = (start + depths)[None]
        out = self.model.model(input_ids=tokens[None], position_ids=positions, attention_mask=mask, cache=self.cache,
                               use_cache=True)
        return out.last_hidden_state[0], self._features()

    # ------------------------------------------------------------- the round's interface (one slot)
    prefill_chunk = 1 << 62  # a prompt goes in as one forward, as Hugging Face's generate does

    def reserve_slots(self, slots: int) -> int:
        """The Hugging Face forward holds one request (batching needs the lean forward)."""
        return 1

    def reset_slot(self, slot: int) -> None:
        self.cache = None

    def slot_length(self, slot: int) -> int:
        return self.cache_length

    @torch.no_grad()
    def forward_parts(self, parts) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The round's forward over one request's rows (``engine.Part``): a prompt into an empty
        cache (the model's own causal mask), else a tree (or a single root) appended to the cache."""
        if len(parts) != 1:
            raise DartreeError(f"the Hugging Face forward runs one request per forward, got {len(parts)}")
        part = parts[0]
        if self.cache is None:
            self.cache = growing_cache(self.config, kv_cache_dtype(self.model))
            out = self.model.model(input_ids=part.tokens[None], cache=self.cache, use_cache=True)
            return [(out.last_hidden_state[0], self._features())]
        n = part.tokens.numel()
        return [self.forward_tree_hidden(part.tokens, part.depths, self.tree_mask(part.visible) if n > 1 else None)]

    def keep(self, slot: int, start: int, keep: torch.Tensor) -> None:
        self.compact(start, keep)

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

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep the K/V of tree rows ``keep`` (indices into the appended window) at start.. and crop."""
        n_keep = keep.numel()
        contiguous = bool(torch.equal(keep, torch.arange(n_keep, device=keep.device)))
        for layer in self.cache.layers:
            if layer.keys is None:
                continue
            if not contiguous:
                idx = start + keep
                layer.keys[:, :, start : start + n_keep] = layer.keys.index_select(2, idx)
                layer.values[:, :, start : start + n_keep] = layer.values.index_select(2, idx)
            layer.keys = layer.keys[:, :, : start + n_keep]
            layer.values = layer.values[:, :, : start + n_keep]

    def close(self) -> None:
        self._tap.close()


def check_context_length(config, prompt_len: int, max_new_tokens: int, margin: int) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return
    if prompt_len >= limit:
        raise DartreeError(f"the prompt has {prompt_len} tokens but the target's context is {limit} tokens; shorten the prompt")
    if prompt_len + max_new_tokens + margin > limit:
        raise DartreeError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) + one draft block ({margin}) exceeds "
            f"the target's context of {limit} tokens; lower max_new_tokens to at most {max(limit - prompt_len - margin, 0)}"
        )
