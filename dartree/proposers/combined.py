"""The drafter and the n-gram proposer together, for ``dartree`` with its ``ngram`` setting on: one
drafter call for the round's requests (batched as the drafter alone) and each request's n-gram
tree, handed to the tree method as one proposal, which merges them under one global top-B."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafter import DraftOutput
from ..trees.tree import DraftTree
from .base import register
from .drafter import DraftProposer
from .ngram import NgramProposer


@dataclass
class DraftAndNgram:
    """A round's proposal of both: the drafter's draft (draft ids) and the n-gram tree (target ids)."""

    draft: DraftOutput
    ngram: DraftTree
    d2t = None  # the tree method hands out target ids itself (``trees.dartree``)

    @property
    def bonus(self) -> int:
        return self.draft.bonus

    @property
    def free_part(self) -> DraftTree:
        """What ``free_proposals`` would have offered this round: the n-gram tree."""
        return self.ngram


@register
class DraftAndNgramProposer:
    name = "drafter+ngram"
    reads_tapped_states = True

    def __init__(self, drafter: DraftProposer, ngram: NgramProposer):
        self.drafter, self.ngram = drafter, ngram
        self.head = drafter.head

    @classmethod
    def create(cls, pipeline) -> "DraftAndNgramProposer":
        return cls(DraftProposer.create(pipeline), NgramProposer.create(pipeline))

    @property
    def num_depths(self) -> int:
        return max(self.drafter.num_depths, self.ngram.num_depths)

    @property
    def batch_key(self) -> object:
        return ("drafter+ngram", self.drafter.batch_key)

    @property
    def depth_limit(self) -> int | None:
        return self.drafter.depth_limit

    @depth_limit.setter
    def depth_limit(self, depths: int | None) -> None:  # the drafter's; the n-gram trees are shallow already
        self.drafter.depth_limit = depths

    def reset(self) -> None:
        self.drafter.reset()
        self.ngram.reset()

    def observe(self, tokens: torch.Tensor, tapped_states: torch.Tensor | None) -> None:
        self.drafter.observe(tokens, tapped_states)
        self.ngram.observe(tokens, None)

    def learn(self, tree: DraftTree, accepted: list[int]) -> None:
        self.ngram.learn(tree, accepted)

    def finish(self, prompt: list[int], output: list[int]) -> None:
        self.ngram.finish(prompt, output)

    @classmethod
    def free_proposals(cls, proposers: list["DraftAndNgramProposer"], bonuses: list[int],
                       positions: list[int]) -> list[DraftTree]:
        """Without a drafter call: each request's n-gram tree (a lookup in its own index)."""
        return NgramProposer.propose_batch([p.ngram for p in proposers], bonuses, positions)

    @classmethod
    def propose_batch(cls, proposers: list["DraftAndNgramProposer"], bonuses: list[int],
                      positions: list[int]) -> list[DraftAndNgram]:
        drafts = DraftProposer.propose_batch([p.drafter for p in proposers], bonuses, positions)
        trees = NgramProposer.propose_batch([p.ngram for p in proposers], bonuses, positions)
        return [DraftAndNgram(d, t) for d, t in zip(drafts, trees)]
