"""The n-gram proposer: speculation without a drafter, from the request's own text.

Per request, an index of every n-gram (n = 1 .. ``max_match``) of the prompt and of everything
committed since, by the positions just after its occurrences, updated per commit in time
proportional to the new tokens. A round looks up the longest suffix of the text (the bonus token
included) that occurred before, takes the continuations that followed its latest ``max_matches``
occurrences (up to ``num_depths`` tokens each) and merges them into one tree: shared prefixes are
one node, and different continuations are branches, not only the latest chain.

Each node carries an estimate of the probability that the target accepts it given its parent, learned
online from what the target accepted in this request (``AcceptanceRates``: by the suffix's match
length, how many occurrences continue through the node and whether it is its parent's only
continuation; SuffixDecoding's frequency score is the prior), and its path log-probability is the
sum along the path: the unit the drafter's trees are ranked in, so the budget's cost model and
global top-B serve both. Proposals are target ids, verified exactly as any other tree: the output is
the target's whatever the proposer proposes.

``ngram-chain`` is the fixed baseline with vLLM's and llama.cpp's semantics (prompt lookup): the
continuation of the latest occurrence of the longest matching suffix, as one chain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..trees.tree import DraftTree
from .base import register
from .suffix_cache import SuffixCache


@dataclass
class AcceptanceRates:
    """Online estimate of a node's conditional acceptance: a Beta-smoothed rate per feature bucket,
    whose prior mean is ``prior_scale`` x the node's share of the occurrences (SuffixDecoding's score)."""

    prior_weight: float = 2.0
    prior_scale: float = 0.6
    accepted: dict = field(default_factory=dict)
    tested: dict = field(default_factory=dict)

    @staticmethod
    def bucket(match: int, count: int, share: float, only_cached: bool = False) -> tuple:
        """A node's features: the match length, the occurrences through it (3 or more alike), whether it
        is its parent's only continuation and whether only other requests' answers (the suffix cache) lead there."""
        return (match, min(count, 3), share >= 1.0, only_cached)

    def probability(self, key: tuple, share: float) -> float:
        """The estimate for a node of bucket ``key`` holding ``share`` of its parent's occurrences."""
        prior = self.prior_scale * share
        p = (self.accepted.get(key, 0.0) + self.prior_weight * prior) / (self.tested.get(key, 0.0) + self.prior_weight)
        return min(max(p, 1e-4), 0.999)

    def learn(self, key: tuple, accepted: bool) -> None:
        self.tested[key] = self.tested.get(key, 0.0) + 1.0
        self.accepted[key] = self.accepted.get(key, 0.0) + float(accepted)


@register
class NgramProposer:
    """One request's n-gram index and acceptance estimate."""

    name = "ngram"
    reads_tapped_states = False
    head = None
    batch_key = "ngram"
    num_depths = 8  # the deepest continuation proposed
    max_match = 4  # the longest suffix looked up
    max_matches = 8  # the latest occurrences whose continuations become branches
    chain = False

    def __init__(self, shared: SuffixCache | None = None):
        self.shared = shared
        self.reset()

    @classmethod
    def create(cls, pipeline) -> "NgramProposer":
        return cls(shared=getattr(pipeline, "suffix_cache", None))

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions just after its occurrences
        self.rates = AcceptanceRates()
        self._features: dict[tuple[int, ...], tuple] = {}  # the last proposal's nodes: path -> feature bucket

    def observe(self, tokens: torch.Tensor, tapped_states: torch.Tensor | None) -> None:
        for t in tokens.tolist():
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(1, min(self.max_match, end) + 1):
                self.index.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def finish(self, prompt: list[int], output: list[int]) -> None:
        """The request ended: its answer joins the server-wide suffix cache, where there is one."""
        if self.shared is not None:
            self.shared.add(prompt, output)

    def learn(self, tree: DraftTree, accepted: list[int]) -> None:
        """What the target did with this round's verified tree (``accepted``: the rows of the accepted
        path, 0 the root): every verified node whose parent was accepted was a test of its estimate."""
        if not self._features or not len(tree):
            return
        kept = set(accepted)
        for row, (parent, path) in enumerate(zip(tree.parents.tolist(), tree.node_paths()), start=1):
            key = self._features.get(path)
            if key is not None and parent in kept:
                self.rates.learn(key, row in kept)
        self._features = {}

    def _continuations(self, bonus: int) -> tuple[int, list[list[int]], int]:
        """The longest suffix of the text (bonus included) seen before, the continuations after its
        latest occurrences (latest first; the request's own, then the suffix cache's where its match
        is as long) and how many of them are the request's own."""
        history = self.tokens + [bonus]
        match, own = 0, []
        for n in range(min(self.max_match, len(history)), 0, -1):
            ends = self.index.get(tuple(history[len(history) - n:]))
            if ends:
                latest = ends[-1:] if self.chain else ends[-self.max_matches:][::-1]
                found = [c for c in (history[e:e + self.num_depths] for e in latest) if c]
                if found:
                    match, own = n, found
                    break
        if self.shared is None or self.chain or len(own) >= self.max_matches:
            return match, own, len(own)
        shared_match, cached = self.shared.continuations(history, self.max_matches - len(own), self.num_depths)
        if shared_match > match:
            return shared_match, cached, 0
        return match, own + (cached if shared_match == match else []), len(own)

    def propose(self, bonus: int) -> DraftTree:
        match, continuations, own = self._continuations(bonus)
        if not continuations:  # the text's suffix never occurred before: nothing to propose
            self._features = {}
            tree = DraftTree.empty()
            tree.log_probs, tree.rank = torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
            return tree
        children: dict[tuple[int, ...], int] = {}  # path -> occurrences through it
        own_paths: set[tuple[int, ...]] = set()  # paths through the request's own text
        for i, c in enumerate(continuations):
            for d in range(1, len(c) + 1):
                children[tuple(c[:d])] = children.get(tuple(c[:d]), 0) + 1
                if i < own:
                    own_paths.add(tuple(c[:d]))
        # in order of depth (parents before children), then by support and first appearance
        order = sorted(children, key=lambda p: (len(p), -children[p]))
        siblings: dict[tuple[int, ...], int] = {}
        for path in order:
            siblings[path[:-1]] = siblings.get(path[:-1], 0) + 1
        self._features = {}
        log_prob: dict[tuple[int, ...], float] = {}
        for path in order:
            parent = path[:-1]
            through = children[path]
            # a sole continuation counts as the whole share (the occurrences that stop short do not lower it)
            share = through / (children[parent] if parent else len(continuations)) if siblings[parent] > 1 else 1.0
            key = AcceptanceRates.bucket(match, through, share, path not in own_paths)
            self._features[path] = key
            log_prob[path] = log_prob.get(parent, 0.0) + math.log(self.rates.probability(key, share))
        # Nodes numbered best first (ties: the earlier in ``order``), so the ranking is the node order:
        # a child never outscores its parent and comes later in ``order``, so every prefix is a tree,
        # and the budget's cut is a slice (``DraftTree.prefix``).
        ranked = sorted(range(len(order)), key=lambda i: -log_prob[order[i]])
        row_of: dict[tuple[int, ...], int] = {}
        tokens, parents, depths, scores = [], [], [], []
        for i in ranked:
            path = order[i]
            row_of[path] = len(tokens) + 1
            tokens.append(path[-1])
            parents.append(row_of[path[:-1]] if len(path) > 1 else 0)
            depths.append(len(path))
            scores.append(log_prob[path])
        tree = DraftTree.from_lists(tokens, parents, depths)
        tree.log_probs = torch.tensor(scores, dtype=torch.float64)
        tree.rank = torch.arange(len(tokens))
        return tree

    @classmethod
    def propose_batch(cls, proposers: list["NgramProposer"], bonuses: list[int], positions: list[int]) -> list[DraftTree]:
        return [p.propose(bonus) for p, bonus in zip(proposers, bonuses)]


@register
class NgramChainProposer(NgramProposer):
    """Prompt lookup as vLLM and llama.cpp do it: the latest occurrence's continuation, one chain."""

    name = "ngram-chain"
    batch_key = "ngram-chain"
    chain = True
