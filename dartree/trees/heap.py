"""``heap``: the sequential best-first heap with the head on every popped path."""

from __future__ import annotations

import heapq

import torch

from .base import TreeBuilder, register
from .common import candidate_tables, ranked_by_pop_order
from .tree import DraftTree


@register
class HeapBuilder(TreeBuilder):
    """Exact best-first heap; every popped node runs the correction for its own path (sequential).

    Children of a node are its depth's K candidates, scored by the corrected logits normalised over
    those K; priority = path score + beta * depth. It is the baseline DARTree replaces: same result
    when DARTree's beam keeps every node the heap visits, but B dependent correction calls per round.
    """

    name = "heap"
    ranked = True
    needs_head = True
    reads = ("budget", "tree_top_k", "beta")

    def build(self, draft, head, budget):
        s = self.settings
        cands = candidate_tables(draft, s.tree_top_k)
        depth_count = cands.shape[0]
        rnd = head.start_round(draft.hidden, draft.base_logits)

        def expand(state, depth):  # the children of a node at ``depth`` (the root's: 0), at depth + 1
            lp = head.logits(rnd, depth, state, cands[depth])[0].log_softmax(-1).clamp(max=0)
            lp_sorted, order = lp.sort(descending=True)
            return lp_sorted.tolist(), cands[depth][order].tolist()

        # Per expanded row: (child log-probs sorted, child tokens sorted, state of that row).
        root_state = head.initial_state(draft.bonus)
        root_lps, root_toks = expand(root_state, 0)
        expanded = {0: (root_lps, root_toks, root_state)}
        # entries: (-(score + beta * depth), tie, parent row, depth, rank among the parent's children, parent score)
        heap = [(-(root_lps[0] + s.beta), 0, 0, 1, 0, 0.0)]
        tokens, parents, depths, scores = [], [], [], []
        tie = 1
        while heap and len(tokens) < budget:
            _, _, parent, depth, rank, parent_score = heapq.heappop(heap)
            lps, toks, parent_state = expanded[parent]
            token, score = toks[rank], parent_score + lps[rank]
            scores.append(score)
            tokens.append(token)
            parents.append(parent)
            depths.append(depth)
            row = len(tokens)
            if rank + 1 < len(lps):  # the next sibling can only be popped after this one
                sib = parent_score + lps[rank + 1]
                heapq.heappush(heap, (-(sib + s.beta * depth), tie, parent, depth, rank + 1, parent_score))
                tie += 1
            if depth < depth_count:  # this node's own correction: one sequential head call per pop
                state = head.advance(parent_state, torch.tensor([token], device=cands.device))
                child_lps, child_toks = expand(state, depth)
                expanded[row] = (child_lps, child_toks, state)
                child = score + child_lps[0]
                heapq.heappush(heap, (-(child + s.beta * (depth + 1)), tie, row, depth + 1, 0, score))
                tie += 1
        return ranked_by_pop_order(DraftTree.from_lists(tokens, parents, depths, device=cands.device), scores)
