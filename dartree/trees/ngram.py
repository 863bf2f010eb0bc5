"""``ngram`` and ``ngram-chain``: speculation without a drafter, from the request's own text
(``proposers.ngram``). Their proposals are finished trees of target ids; the methods only cut them."""

from __future__ import annotations

from .base import TreeBuilder, register


@register
class NgramBuilder(TreeBuilder):
    """The n-gram proposer's tree of the continuations of every recent occurrence of the text's
    longest repeated suffix, ranked by their learned acceptance; budget auto verifies the prefix
    that pays on this machine's cost model, as for the drafter's trees."""

    name = "ngram"
    proposer = "ngram"
    ranked = True
    reads = ("budget",)

    def build(self, draft, head, budget):
        return draft.prefix(budget) if len(draft) else draft


@register
class NgramChainBuilder(TreeBuilder):
    """Prompt lookup with vLLM's and llama.cpp's semantics: the latest occurrence's continuation
    (up to 8 tokens), verified whole every round; the baseline row for ``ngram``."""

    name = "ngram-chain"
    proposer = "ngram-chain"

    def build(self, draft, head, budget):
        return draft
