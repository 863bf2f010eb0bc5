"""The known-answer target of exact replay (``dartree.replay``): at T = 0 the target's choices along
its greedy answer are known, so a round needs no forward to find them."""

from __future__ import annotations

import torch

from .base import Part


class KnownTarget:
    """The ``targets.base.Target`` of one known sequence: prompt + the
    target's answer. A forward returns, for each row, its position as the "hidden state" and the
    teacher-forced tapped states at that position; the output layer turns a position into a one-hot
    choice of the known next token. Rows on the answer's path thus get exactly what the target
    would give them; rows off it get wrong values, but the walk never accepts them (their parent's
    choice is the answer's token, not theirs), so their values never matter."""

    name = "known"
    max_slots = None
    row_invariant = True  # a row's value is looked up, whatever shares the forward
    prefill_chunk = 1 << 62

    def __init__(self, tokens: torch.Tensor, tapped_states: torch.Tensor | None, tapped_layers: list[int]):
        self.tokens = tokens.reshape(-1)
        self.tapped_states = tapped_states
        self.tapped_layers = list(tapped_layers)
        self.capture = tapped_states is not None
        self.width = int(self.tokens.max()) + 1  # the choices' logits need not span the whole vocabulary
        self.lengths: dict[int, int] = {}

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def reserve_slots(self, slots: int) -> int:
        return slots

    def reset_slot(self, slot: int) -> None:
        self.lengths[slot] = 0

    def slot_length(self, slot: int) -> int:
        return self.lengths[slot]

    def forward_parts(self, parts: list[Part]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        out, last = [], self.tokens.numel() - 1
        for part in parts:
            positions = (self.lengths[part.slot] + part.depths.to(self.device)).clamp(max=last)
            self.lengths[part.slot] += part.tokens.numel()
            tapped_states = self.tapped_states[positions] if self.capture and self.tapped_states is not None else None
            out.append((positions[:, None].to(torch.float64), tapped_states))
        return out

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = hidden[:, 0].long()
        choices = self.tokens[(positions + 1).clamp(max=self.tokens.numel() - 1)]
        logits = torch.zeros(positions.numel(), self.width, device=self.device)
        logits[torch.arange(positions.numel(), device=self.device), choices] = 1.0
        return logits

    def keep(self, slot: int, start: int, rows: torch.Tensor) -> None:
        self.lengths[slot] = start + rows.numel()
