"""``dflash``: the drafter's greedy block as a chain."""

from __future__ import annotations

from .base import TreeBuilder, register
from .tree import DraftTree


@register
class DFlashBuilder(TreeBuilder):
    name = "dflash"

    def build(self, draft, head, budget):
        return DraftTree.chain(draft.base_logits.argmax(-1))
