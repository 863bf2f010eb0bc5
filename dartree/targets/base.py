"""The target contract: what the round asks of the model that verifies the drafts.

A target holds the K/V of one or more requests, each in its own **slot**, and runs ONE forward
over new rows of any of its slots. That is all the round (``dartree.engine``) needs:

- ``reserve_slots(n) -> int``: hold up to ``n`` requests at once; returns how many it will hold
  (``max_slots`` caps it: the Hugging Face forward holds one).
- ``reset_slot(slot)``: empty a slot for a new request. ``slot_length(slot) -> int``: its
  committed length (rows in its cache that the next forward sees).
- ``forward_parts(parts) -> [(hidden [n, H], tapped_states [n, m*H] | None), ...]``: one forward over
  every ``Part`` (a slot's ``n`` new rows, appended after its committed length; row i at position
  ``slot_length + depths[i]``, seeing the committed rows and the new rows ``visible[i]`` marks).
  Returns, per part, the final-normed hidden states and, when ``capture`` is on and
  ``tapped_layers`` is not empty, the tapped layers' outputs concatenated in layer order (the
  drafter's context). The new rows are appended to the slot (its length grows by ``n``) until
  ``keep`` keeps some of them.
- ``lm_head(hidden [r, H]) -> logits [r, V]``: the output layer, over only the rows the walk asks
  for (most rows of a tree are never looked at).
- ``keep(slot, start, rows)``: commit the new rows ``rows`` (indices from ``start``, in order) as
  the slot's positions ``start..start + len(rows) - 1``; every other new row is dropped.

Attributes: ``name`` (which forward, as records and cost models name it), ``max_slots`` (None: any
number), ``prefill_chunk`` (prompt rows one forward takes when a request prefills alone),
``tapped_layers``, ``capture`` (the round turns it on when a request's proposer reads the tapped
states), ``device``, and ``row_invariant``: True where a row's outputs do not depend on what else
shares the forward (its row count, other requests' rows) - then a tree verification computes
exactly the logits of a one-token step, and every method reproduces the target's own greedy
decoding token for token. Where it is False (the Hugging Face forward: float summation order
depends on the shapes), agreement is measured, not claimed.

Proposers that borrow the target's embedding and output layer (the drafter) read
``embed_tokens`` and ``lm_head`` from targets that have a model; the round never does.

The implementations: ``hf.py`` (any Hugging Face causal LM, one slot), ``lean.py`` (Llama/Qwen3 on
the CPU on the compiled row-invariant kernels, many slots), ``known.py`` (replay: the answer is
looked up, not computed). ``prefill`` and ``forward_tree`` below are written once, on the contract.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..errors import DartreeError


@dataclass
class Part:
    """One slot's new rows in a forward: tokens [n], depths [n] (RoPE offsets from the slot's
    committed length) and what each row sees of the slot's new rows (boolean [n, n])."""

    slot: int
    tokens: torch.Tensor
    depths: torch.Tensor
    visible: torch.Tensor

    @classmethod
    def causal(cls, slot: int, tokens: torch.Tensor) -> "Part":
        """A prompt chunk: each row sees the rows before it."""
        n = tokens.numel()
        return cls(slot, tokens, torch.arange(n, device=tokens.device),
                   torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril())


@runtime_checkable
class Target(Protocol):
    name: str
    max_slots: int | None
    row_invariant: bool
    prefill_chunk: int
    tapped_layers: list[int]
    capture: bool
    lm_head: Callable[[torch.Tensor], torch.Tensor]

    @property
    def device(self) -> torch.device: ...

    def reserve_slots(self, slots: int) -> int: ...

    def reset_slot(self, slot: int) -> None: ...

    def slot_length(self, slot: int) -> int: ...

    def forward_parts(self, parts: list[Part]) -> list[tuple[torch.Tensor, torch.Tensor | None]]: ...

    def keep(self, slot: int, start: int, rows: torch.Tensor) -> None: ...


@torch.no_grad()
def prefill(target: Target, input_ids: torch.Tensor, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Empty ``slot`` and run ``input_ids`` [P] into it in chunks of ``target.prefill_chunk``.
    Returns the logits [V] at the last prompt position and the tapped states [P, m*H] (None when
    the target captures none)."""
    ids = input_ids.reshape(-1)
    target.reserve_slots(slot + 1)
    target.reset_slot(slot)
    tapped, hidden = [], None
    for s in range(0, ids.numel(), target.prefill_chunk):
        chunk = ids[s:s + target.prefill_chunk]
        start = target.slot_length(slot)
        ((hidden, states),) = target.forward_parts([Part.causal(slot, chunk)])
        target.keep(slot, start, torch.arange(chunk.numel(), device=chunk.device))
        tapped.append(states)
    states = None if tapped[0] is None else (torch.cat(tapped) if len(tapped) > 1 else tapped[0])
    return target.lm_head(hidden[-1:])[0], states


@torch.no_grad()
def forward_tree(target: Target, tokens: torch.Tensor, depths: torch.Tensor, visible: torch.Tensor | None = None,
                 slot: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward over [root, nodes...] appended to ``slot`` (``visible``: the boolean ancestor
    matrix [n, n]; None: the rows form a chain). Returns logits [n, V] and tapped states; the rows
    stay uncommitted until ``target.keep``."""
    n = tokens.numel()
    if visible is None:
        visible = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()
    ((hidden, states),) = target.forward_parts([Part(slot, tokens, depths, visible)])
    return target.lm_head(hidden), states


def check_context_length(config, prompt_len: int, max_new_tokens: int, margin: int) -> None:
    """A clear error when prompt + max_new_tokens + one draft block does not fit the target's context."""
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
