"""``ar``: plain autoregressive decoding (no draft)."""

from __future__ import annotations

from .base import TreeBuilder, register
from .tree import DraftTree


@register
class AutoregressiveBuilder(TreeBuilder):
    """No draft at all: each round verifies only the root, i.e. plain decoding."""

    name = "ar"
    proposer = None

    def build(self, draft, head, budget):
        return DraftTree.empty()
