"""Pieces several builders use: best-first marginal trees, the corrected chain, the global top-B."""

from __future__ import annotations

import heapq
import math

import torch

from ..errors import DartreeError
from ..heads import CorrectionHead
from .tree import DraftTree


def best_first_marginals(logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the top-B prefixes under a factorised distribution, by a best-first heap.

    logprobs [D, V] per-depth log-probabilities. A popped node pushes its next sibling and its
    first child, so each pop costs O(log B). The builders take ``grow_kernel.best_first_marginals``
    where it runs (the same pops in the same order); this is its reference.
    """
    depth_count = logprobs.shape[0]
    k = min(budget, logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    lp, ids = top_lp.tolist(), top_ids.tolist()
    tokens, parents, depths, scores = [], [], [], []
    # (-score, tie, parent row, depth, rank, parent score)
    heap = [(-lp[0][0], 0, 0, 1, 0, 0.0)]
    tie = 1
    while heap and len(tokens) < budget:
        _, _, parent, depth, rank, parent_score = heapq.heappop(heap)
        score = parent_score + lp[depth - 1][rank]
        scores.append(score)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        row = len(tokens)
        if rank + 1 < k:
            sib = parent_score + lp[depth - 1][rank + 1]
            heapq.heappush(heap, (-sib, tie, parent, depth, rank + 1, parent_score))
            tie += 1
        if depth < depth_count:
            child = score + lp[depth][0]
            heapq.heappush(heap, (-child, tie, row, depth + 1, 0, score))
            tie += 1
    return ranked_by_pop_order(DraftTree.from_lists(tokens, parents, depths, device=logprobs.device), scores)


def ranked_by_pop_order(tree: DraftTree, scores: list[float]) -> DraftTree:
    """A best-first heap pops parents before children and better nodes first: its pop order is a
    ranking whose every prefix is a valid tree."""
    tree.log_probs = torch.tensor(scores, dtype=torch.float64, device=tree.tokens.device)
    tree.rank = torch.arange(len(tree), device=tree.tokens.device)
    return tree


def corrected_chain_logits(draft, head: CorrectionHead) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain where every depth is corrected by the path so far (full vocabulary).

    Returns the chain tokens [D] and the corrected logits [D, V] along it.
    """
    rnd = head.start_round(draft.hidden, draft.base_logits)
    state = head.initial_state(draft.bonus)
    rows, tokens = [], []
    depth_count = draft.base_logits.shape[0]
    for depth in range(depth_count):  # the token at depth + 1, after the path to depth
        logits = head.logits(rnd, depth, state)[0]
        token = logits.argmax()
        rows.append(logits)
        tokens.append(token)
        if depth + 1 < depth_count:
            state = head.advance(state, token[None])
    return torch.stack(tokens), torch.stack(rows)


def select_top_b(prune: list[float], parents: list[int], budget: int) -> list[int]:
    """Deferred global top-B of a supertree (Lemma 1). Returns kept node positions, sorted.

    prune [N] (score + beta*depth) must never increase from parent to child; ties go to the smaller
    row, so with parents numbered before children the result is ancestor-closed and equals the first
    B pops of a best-first heap on the supertree. On lists: a supertree of a few dozen nodes, every
    round, costs less in Python's stable sort than in tensor calls.
    """
    if any(p > 0 and score > prune[p - 1] for score, p in zip(prune, parents)):
        raise DartreeError("deferred top-B needs scores that never increase from parent to child (beta <= 0)")
    if len(prune) <= budget:
        return list(range(len(prune)))
    return sorted(sorted(range(len(prune)), key=lambda i: -prune[i])[:budget])  # stable: ties to the smaller row


def merge_ranked(trees: list[DraftTree], budget: int, beta: float = 0.0) -> DraftTree:
    """One ranked tree of the union of ranked trees over the same root (target ids): a path in several
    keeps the best of its log-probabilities, nodes are ranked by log-probability + beta * depth (a child
    never outranks its parent: each tree's log-probabilities never increase along a path, and so
    does their maximum), and the best ``budget`` of the union are kept: one global top-B over every source."""
    sources = [t for t in trees if len(t)]
    if len(sources) == 1 and _depth_ordered_and_distinct(sources[0]):
        # one source (the n-gram tree found nothing): its nodes are the union's, in the union's own order
        # (by depth, stable); only the scores and the ranking are made as below
        one = sources[0]
        return _rank_and_cut(DraftTree(one.tokens, one.parents, one.depths, one.log_probs.to(torch.float64)), budget, beta)
    best: dict[tuple[int, ...], float] = {}
    for tree in trees:
        for path, lp in zip(tree.node_paths(), tree.log_probs.tolist()):
            best[path] = max(best.get(path, -math.inf), lp)
    order = sorted(best, key=len)  # parents before children (stable: each tree's own order within a depth)
    row = {path: i + 1 for i, path in enumerate(order)}
    device = trees[0].tokens.device if trees else "cpu"
    merged = DraftTree.from_lists([p[-1] for p in order], [row[p[:-1]] if len(p) > 1 else 0 for p in order],
                                  [len(p) for p in order], device=device)
    merged.log_probs = torch.tensor([best[p] for p in order], dtype=torch.float64, device=device)
    return _rank_and_cut(merged, budget, beta)


def _depth_ordered_and_distinct(tree: DraftTree) -> bool:
    """Nodes in nondecreasing depth and no two siblings with one token (so no path twice)."""
    pairs = list(zip(tree.parents.tolist(), tree.tokens.tolist()))
    return len(set(pairs)) == len(pairs) and bool((tree.depths[1:] >= tree.depths[:-1]).all())


def _rank_and_cut(merged: DraftTree, budget: int, beta: float) -> DraftTree:
    prune = merged.log_probs + beta * merged.depths.to(torch.float64)
    merged.rank = torch.sort(prune, descending=True, stable=True).indices
    return merged.prefix(budget) if len(merged) else merged


def candidate_tables(draft, tree_top_k: int) -> torch.Tensor:
    """C_d: the top-K base tokens of every depth, shared by all branches. [D, K]"""
    return draft.base_logits.topk(min(tree_top_k, draft.base_logits.shape[-1]), dim=-1).indices
