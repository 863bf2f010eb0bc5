"""``ddtree``: the best-first tree over the drafter's per-depth marginals."""

from __future__ import annotations

from . import grow_kernel
from .base import TreeBuilder, register


@register
class DDTreeBuilder(TreeBuilder):
    name = "ddtree"
    ranked = True
    reads = ("budget",)

    def build(self, draft, head, budget):
        return grow_kernel.best_first_marginals(draft.base_logits.log_softmax(-1), budget)  # compiled, where it runs
