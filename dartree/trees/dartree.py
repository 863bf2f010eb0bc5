"""``dartree`` and ``dartree-fixed``: the wide supertree grown depth by depth, every branch corrected
in one batch, then one global top-B."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..heads import CorrectionHead
from .base import TreeBuilder, register
from . import grow_kernel
from .common import candidate_tables, merge_ranked, select_top_b
from .tree import DraftTree


@dataclass
class Supertree:
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor  # cumulative log-probability of each node's path


def grow_supertree(draft, head: CorrectionHead, tree_top_k: int, quotas, budget: int | None = None, beta: float = 0.0) -> Supertree:
    """Depth-wise batched expansion: every live branch is corrected in one batch per depth.

    ``quotas(depth, placed)`` gives how many (branch, candidate) pairs to keep at depth + 1 (the
    children of the frontier at ``depth``, the root's 0), ``placed`` nodes placed so far; they are
    the global top-n of the [F, K] matrix of cumulative scores (a beam across branches).

    With ``budget`` (the deferred top-B that follows), expansion stops as soon as no deeper node
    can enter that top-B: a descendant scores at most its frontier ancestor's score, plus beta per
    extra depth, and loses ties to the shallower (smaller-row) nodes already placed. The selected
    tree is unchanged; only work that could not matter is skipped.
    """
    cands = candidate_tables(draft, tree_top_k)
    depth_count, k = cands.shape
    rnd = head.start_round(draft.hidden, draft.base_logits)
    states = head.initial_state(draft.bonus)  # [F, S]
    scores = torch.zeros(1, dtype=draft.base_logits.dtype, device=cands.device)  # [F]
    rows = torch.zeros(1, dtype=torch.long, device=cands.device)  # [F] tree rows of the frontier
    out_tokens, out_parents, out_depths, out_scores = [], [], [], []
    placed = 0
    for depth in range(depth_count):  # the frontier at depth grows the nodes at depth + 1
        n = min(quotas(depth, placed), scores.numel() * k)
        if n <= 0:
            break
        logprobs = head.logits(rnd, depth, states, cands[depth]).log_softmax(-1).clamp(max=0)
        total = (scores[:, None] + logprobs).flatten()
        top_scores, flat = total.topk(n)
        branch, cand = flat // k, flat % k
        tokens = cands[depth][cand]
        out_tokens.append(tokens)
        out_parents.append(rows[branch])
        out_depths.append(torch.full((n,), depth + 1, dtype=torch.long, device=cands.device))
        out_scores.append(top_scores)
        rows = torch.arange(placed + 1, placed + 1 + n, device=cands.device)
        placed += n
        scores = top_scores
        if budget is not None and placed >= budget:
            prune = torch.cat([sc + beta * (d + 1) for d, sc in enumerate(out_scores)])
            threshold = prune.topk(budget).values[-1]
            if bool(scores.max() + beta * (depth + 2) <= threshold):
                break
        if depth + 1 < depth_count:
            states = head.advance(states, tokens, rows=branch)
    return Supertree(torch.cat(out_tokens), torch.cat(out_parents), torch.cat(out_depths), torch.cat(out_scores))


def grow_supertrees(drafts: list, head: CorrectionHead, tree_top_k: int, width: int, budgets: list[int],
                    beta: float = 0.0) -> list[Supertree]:
    """``grow_supertree`` (beam of ``width`` per depth, early stop under each request's deferred
    top-B) for several requests' drafts at once: every live branch of every request is corrected in
    one batch per depth. Each request keeps the same number of branches at a depth (the quota is
    ``width`` and a depth's candidates outnumber it), so the batch needs no padding; a request whose
    expansion can no longer change its top-B leaves the batch."""
    device = drafts[0].base_logits.device
    cands = torch.stack([candidate_tables(d, tree_top_k) for d in drafts])  # [R, D, K]
    requests, depth_count, k = cands.shape
    rounds = [head.start_round(d.hidden, d.base_logits) for d in drafts]
    states = torch.cat([head.initial_state(d.bonus) for d in drafts])  # [L * F, S], F = 1 at the root
    live = torch.arange(requests, device=device)  # requests still growing
    scores = torch.zeros(requests, 1, dtype=drafts[0].base_logits.dtype, device=device)  # [L, F]
    rows = torch.zeros(requests, 1, dtype=torch.long, device=device)  # [L, F] tree rows of the frontier
    budget = torch.tensor(budgets, device=device)
    outputs: list[tuple[torch.Tensor, ...]] = []  # per depth: (live, tokens, parents, scores), [L, n] each
    prune = torch.empty(requests, 0, dtype=scores.dtype, device=device)  # [R, placed]
    placed = 0
    for depth in range(depth_count):  # the frontier at depth grows the nodes at depth + 1
        frontier = scores.shape[1]
        n = min(width, frontier * k)
        logprobs = head.logits_batch([rounds[i] for i in live.tolist()], depth, states, cands[live, depth])
        logprobs = logprobs.log_softmax(-1).clamp(max=0).view(live.numel(), frontier, k)
        total = (scores[:, :, None] + logprobs).flatten(1)  # [L, F * K]
        top_scores, flat = total.topk(n, dim=1)
        branch, cand = flat // k, flat % k
        tokens = cands[live, depth].gather(1, cand)
        outputs.append((live, tokens, rows.gather(1, branch), top_scores))
        rows = torch.arange(placed + 1, placed + 1 + n, device=device).expand(live.numel(), n)
        placed += n
        scores = top_scores
        grown = torch.full((requests, n), float("-inf"), dtype=scores.dtype, device=device)
        grown[live] = top_scores + beta * (depth + 1)
        prune = torch.cat([prune, grown], dim=1)
        # a request stops once no deeper node can enter its top-B (as grow_supertree)
        keep = torch.ones(live.numel(), dtype=torch.bool, device=device)
        full = budget[live] <= placed
        if bool(full.any()):
            ranked = prune[live].sort(dim=1, descending=True).values
            threshold = ranked.gather(1, (budget[live].clamp(max=placed) - 1)[:, None])[:, 0]
            keep = ~(full & (scores.max(dim=1).values + beta * (depth + 2) <= threshold))
        if depth + 1 == depth_count or not bool(keep.any()):
            break
        parent_rows = (torch.arange(live.numel(), device=device)[:, None] * frontier + branch)[keep].flatten()
        states = head.advance(states, tokens[keep].flatten(), rows=parent_rows)
        live, scores, rows = live[keep], scores[keep], rows[keep]
    trees = []
    for i in range(requests):
        parts = [(tok[row], par[row], sc[row], d) for d, (who, tok, par, sc) in enumerate(outputs)
                 for row in (who == i).nonzero().flatten().tolist()]
        trees.append(Supertree(torch.cat([t for t, _, _, _ in parts]), torch.cat([p for _, p, _, _ in parts]),
                               torch.cat([torch.full((t.numel(),), d + 1, dtype=torch.long, device=device) for t, _, _, d in parts]),
                               torch.cat([s for _, _, s, _ in parts])))
    return trees


def _ranked_top_b(st: Supertree, budget: int, beta: float) -> DraftTree:
    """The deferred global top-B of a supertree, ranked (every prefix of the rank is a tree). Worked on
    lists: a few dozen nodes, every round."""
    prune = (st.scores + beta * st.depths.to(st.scores.dtype)).tolist()  # in the scores' own precision
    parents, scores = st.parents.tolist(), st.scores.tolist()
    keep = select_top_b(prune, parents, budget)
    row = {old + 1: new + 1 for new, old in enumerate(keep)}
    row[0] = 0
    device = st.tokens.device
    tokens, depths = st.tokens.tolist(), st.depths.tolist()
    tree = DraftTree.from_lists([tokens[i] for i in keep], [row[parents[i]] for i in keep], [depths[i] for i in keep],
                                device=device)
    tree.log_probs = torch.tensor([scores[i] for i in keep], dtype=st.scores.dtype, device=device)
    # The deferred top-B order itself: every prefix is the top-b tree (Lemma 1; ties to the smaller
    # row, which is the parent), so a per-round budget can cut the tree without rebuilding it.
    kept_prune = [prune[i] for i in keep]
    tree.rank = torch.tensor(sorted(range(len(keep)), key=lambda j: -kept_prune[j]), dtype=torch.long, device=device)
    return tree


@register
class DARTreeBuilder(TreeBuilder):
    """DARTree (pruned): beam of width W per depth, then one deferred global top-B on score + beta*depth."""

    name = "dartree"
    ranked = True
    needs_head = True
    reads = ("budget", "width", "tree_top_k", "beta", "ngram")

    def __init__(self, settings):
        super().__init__(settings)
        # with ngram on, each round's proposal is the drafter's draft and the n-gram tree (proposers/combined.py)
        self.proposer = "drafter+ngram" if settings.ngram else "drafter"

    def build(self, draft, head, budget):
        if hasattr(draft, "ngram"):  # a DraftAndNgram proposal
            return self.build_many([self], [draft], head, [budget])[0]
        s = self.settings
        grown = grow_kernel.grow_supertree(draft, head, s.tree_top_k, s.width, budget, s.beta)  # compiled, where it runs
        if grown is not None:
            st = Supertree(*grown)
        else:
            st = grow_supertree(draft, head, s.tree_top_k, lambda depth, placed: s.width, budget=budget, beta=s.beta)
        return _ranked_top_b(st, budget, s.beta)

    @staticmethod
    def build_many(builders, drafts, head, budgets):
        if drafts and hasattr(drafts[0], "ngram"):  # the drafter's trees (as target ids) and the n-gram trees, merged
            trees = DARTreeBuilder.build_many(builders, [d.draft for d in drafts], head, budgets)
            return [merge_ranked([replace(t, tokens=d.draft.to_target(t.tokens)), d.ngram], n, b.settings.beta)
                    for b, d, t, n in zip(builders, drafts, trees, budgets)]
        s = builders[0].settings  # one group shares its settings (trees.build_trees)
        if len(builders) == 1:
            return [builders[0].build(drafts[0], head, budgets[0])]
        grown = grow_kernel.grow_supertrees(drafts, head, s.tree_top_k, s.width, budgets, s.beta)  # compiled: one call
        if grown is not None:
            return [_ranked_top_b(Supertree(*g), n, s.beta) for g, n in zip(grown, budgets)]
        grown = grow_supertrees(drafts, head, s.tree_top_k, s.width, budgets, beta=s.beta)
        return [_ranked_top_b(st, n, s.beta) for st, n in zip(grown, budgets)]


@register
class DARTreeFixedBuilder(TreeBuilder):
    """DARTree (fixed): a per-depth quota ceil(remaining / remaining depths), exactly B nodes, no pruning."""

    name = "dartree-fixed"
    needs_head = True
    reads = ("budget", "tree_top_k")

    def build(self, draft, head, budget):
        depth_count = draft.base_logits.shape[0]

        def quota(depth, placed):
            return -(-(budget - placed) // (depth_count - depth))

        st = grow_supertree(draft, head, self.settings.tree_top_k, quota)
        return DraftTree(st.tokens, st.parents, st.depths)
