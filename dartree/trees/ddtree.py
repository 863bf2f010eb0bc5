"""``ddtree``: the best-first tree over the drafter's per-depth marginals."""

from __future__ import annotations

from .base import TreeBuilder, register
from .common import best_first_marginals


@register
class DDTreeBuilder(TreeBuilder):
    name = "ddtree"
    ranked = True
    reads = ("budget",)

    def build(self, draft, head, budget):
        return best_first_marginals(draft.base_logits.log_softmax(-1), budget)
