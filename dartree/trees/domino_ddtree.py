"""``domino-ddtree``: the best-first tree over the corrected chain's marginals."""

from __future__ import annotations

from . import grow_kernel
from .base import TreeBuilder, register


@register
class DominoDDTreeBuilder(TreeBuilder):
    name = "domino-ddtree"
    ranked = True
    needs_head = True
    reads = ("budget",)

    def build(self, draft, head, budget):
        _, logits = grow_kernel.corrected_chain(draft, head)  # compiled, where it runs
        return grow_kernel.best_first_marginals(logits.log_softmax(-1), budget)  # compiled, where it runs
