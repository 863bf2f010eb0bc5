"""``domino``: the head-corrected greedy chain."""

from __future__ import annotations

from . import grow_kernel
from .base import TreeBuilder, register
from .tree import DraftTree


@register
class DominoBuilder(TreeBuilder):
    name = "domino"
    needs_head = True

    def build(self, draft, head, budget):
        tokens, _ = grow_kernel.corrected_chain(draft, head)  # compiled, where it runs
        return DraftTree.chain(tokens)
