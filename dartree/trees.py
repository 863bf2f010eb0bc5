"""Draft-tree builders: one small class per method behind one interface.

A builder turns one round's draft (drafter states and base logits, plus a correction head for the
corrected methods) into a ``DraftTree``. Node i of a tree has row i+1 in the verification batch;
row 0 is the root (the bonus token). Parents always come before their children.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

import torch

from .errors import DartreeError
from .heads import CorrectionHead


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long, row index of the parent (0 = root)
    depths: torch.Tensor  # [N] long, 1..D
    # Optional, from the builders that rank their nodes (dartree): the drafter's path log-probability
    # of each node and the nodes best first, such that every prefix of the ranking is a valid tree.
    log_probs: torch.Tensor | None = None  # [N]
    rank: torch.Tensor | None = None  # [N] node indices

    def prefix(self, size: int) -> "DraftTree":
        """The tree of the ``size`` best-ranked nodes (parents always rank before their children)."""
        if self.rank is None:
            raise DartreeError("this tree carries no ranking; only ranked trees (dartree) can be cut to a prefix")
        if size >= len(self):
            return self
        keep = self.rank[:size].sort().values
        cut = subtree(self.tokens, self.parents, self.depths, keep)
        cut.log_probs = self.log_probs[keep] if self.log_probs is not None else None
        positions = torch.full((len(self),), -1, dtype=torch.long, device=keep.device)
        positions[keep] = torch.arange(keep.numel(), device=keep.device)
        cut.rank = positions[self.rank[:size]]
        return cut

    def __len__(self) -> int:
        return self.tokens.numel()

    def paths(self) -> set[tuple[int, ...]]:
        """Root-to-node token paths: a numbering-free description of the tree."""
        parents, tokens = self.parents.tolist(), self.tokens.tolist()
        found: list[tuple[int, ...]] = []
        for p, t in zip(parents, tokens):
            found.append((found[p - 1] if p > 0 else ()) + (t,))
        return set(found)

    def rows(self, root: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and depths of the verification batch: row 0 is the root (depth 0), row i+1 node i."""
        device = self.tokens.device
        tokens = torch.cat([torch.tensor([root], dtype=torch.long, device=device), self.tokens])
        depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), self.depths])
        return tokens, depths

    @classmethod
    def empty(cls, device="cpu") -> "DraftTree":
        z = torch.zeros(0, dtype=torch.long, device=device)
        return cls(z, z.clone(), z.clone())

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> "DraftTree":
        n = tokens.numel()
        ar = torch.arange(n, device=tokens.device)
        return cls(tokens.long(), ar, ar + 1)

    @classmethod
    def from_lists(cls, tokens, parents, depths, device="cpu") -> "DraftTree":
        mk = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return cls(mk(tokens), mk(parents), mk(depths))


@dataclass(frozen=True)
class TreeSettings:
    """The tree settings and their defaults (the paper's), in one place; each builder declares which
    of them it reads (``TreeBuilder.reads``)."""

    budget: int | str = "auto"  # B: tree nodes verified per round, root not counted; "auto": per round (budget.py)
    width: int = 12  # W: branches kept per depth (dartree)
    top_k: int = 64  # K: candidate tokens per depth (dartree, heap)
    beta: float = -0.2  # depth bonus of the final top-B (dartree, heap)
    max_budget: int = 64  # with budget "auto": the tree is built at this size and cut per round

    HELP = {
        "budget": "tree nodes verified per round, root excluded, or 'auto' (chosen every round from the measured cost model)",
        "max_budget": "with --budget auto: the largest tree built each round",
        "width": "branches kept per depth",
        "top_k": "candidate tokens per depth",
        "beta": "depth bonus of the final top-B, must be <= 0",
    }

    @property
    def auto(self) -> bool:
        return self.budget == "auto"

    @property
    def build_budget(self) -> int:
        """The size builders build at: the budget, or ``max_budget`` when the budget is chosen per round."""
        return self.max_budget if self.auto else self.budget

    def validate(self) -> "TreeSettings":
        if isinstance(self.budget, str) and self.budget != "auto":
            raise DartreeError(f"budget must be an integer >= 1 or 'auto', got {self.budget!r}")
        for name in ("width", "top_k", "max_budget") + (() if self.auto else ("budget",)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DartreeError(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta)):
            raise DartreeError(f"beta must be a finite number <= 0, got {self.beta!r}")
        if self.beta > 0:
            raise DartreeError(
                f"beta must be <= 0, got {self.beta}: with a positive depth bonus a child can outscore its parent, "
                "so the global top-B is no longer a valid (ancestor-closed) tree"
            )
        return self


# ---------------------------------------------------------------- shared pieces


def best_first_marginals(logprobs: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the top-B prefixes under a factorised distribution, by a best-first heap.

    logprobs [D, V] per-depth log-probabilities. A popped node pushes its next sibling and its
    first child, so each pop costs O(log B).
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
    for slot in range(depth_count):
        logits = head.logits(rnd, slot, state)[0]
        token = logits.argmax()
        rows.append(logits)
        tokens.append(token)
        if slot + 1 < depth_count:
            state = head.advance(state, token[None])
    return torch.stack(tokens), torch.stack(rows)


def select_top_b(prune_scores: torch.Tensor, parents: torch.Tensor, budget: int) -> torch.Tensor:
    """Deferred global top-B of a supertree (Lemma 1). Returns kept node positions, sorted.

    prune_scores [N] (score + beta*depth) must never increase from parent to child; ties go to the
    smaller row, so with parents numbered before children the result is ancestor-closed and equals
    the first B pops of a best-first heap on the supertree.
    """
    n = prune_scores.numel()
    has_parent = parents > 0
    parent_scores = prune_scores[(parents - 1).clamp(min=0)]
    if bool((has_parent & (prune_scores > parent_scores)).any()):
        raise DartreeError("deferred top-B needs scores that never increase from parent to child (beta <= 0)")
    if n <= budget:
        return torch.arange(n, device=prune_scores.device)
    order = torch.sort(prune_scores, descending=True, stable=True).indices
    return order[:budget].sort().values


def subtree(tokens, parents, depths, keep: torch.Tensor) -> DraftTree:
    """Restrict a tree to an ancestor-closed, sorted node set, renumbering parent rows."""
    row_map = torch.zeros(tokens.numel() + 1, dtype=torch.long, device=tokens.device)
    row_map[keep + 1] = torch.arange(1, keep.numel() + 1, device=tokens.device)
    return DraftTree(tokens[keep], row_map[parents[keep]], depths[keep])


# ---------------------------------------------------------------- builders


BUILDERS: dict[str, type["TreeBuilder"]] = {}


def register(cls: type["TreeBuilder"]) -> type["TreeBuilder"]:
    """Add a method to the registry: its name, what it needs and which settings it reads are
    declared on the class, and everything else (METHODS, CLI choices, bench grids, report order,
    ``Pipeline.methods``, test parametrisations) derives from here. Order = registration order."""
    if cls.name in BUILDERS:
        raise ValueError(f"method {cls.name!r} registered twice")
    unknown = set(cls.reads) - set(TreeSettings.__dataclass_fields__)
    if unknown:
        raise ValueError(f"method {cls.name!r} reads unknown settings {sorted(unknown)}")
    BUILDERS[cls.name] = cls
    return cls


class TreeBuilder:
    """One method: turns one round's draft into a tree. Subclasses set the class attributes below
    and implement ``build``; ``@register`` makes them a method."""

    name = ""
    uses_drafter = True  # False: no drafter call at all (plain decoding)
    needs_head = False  # True: needs a correction head (Domino or Markov)
    reads: tuple[str, ...] = ()  # the TreeSettings fields this method uses
    ranked = False  # True: its trees carry a ranking whose prefixes are trees (budget "auto" cuts them)

    def __init__(self, settings: TreeSettings):
        self.settings = settings

    def build(self, draft, head: CorrectionHead | None, size: int) -> DraftTree:
        """The tree over draft ids (the draft's output vocabulary), of at most ``size`` nodes."""
        raise NotImplementedError

    def propose(self, draft, head: CorrectionHead | None, size: int | None = None) -> DraftTree:
        """The tree over target ids, ready to verify. ``size``: build at most this many nodes this
        round instead of ``settings.build_budget`` (budget "auto" builds no more than it may verify)."""
        tree = self.build(draft, head, self.settings.build_budget if size is None else size)
        if getattr(draft, "d2t", None) is not None and len(tree):
            tree = replace(tree, tokens=draft.to_target(tree.tokens))
        return tree


@register
class AutoregressiveBuilder(TreeBuilder):
    """No draft at all: each round verifies only the root, i.e. plain decoding."""

    name = "ar"
    uses_drafter = False

    def build(self, draft, head, size):
        return DraftTree.empty()


@register
class DFlashBuilder(TreeBuilder):
    name = "dflash"

    def build(self, draft, head, size):
        return DraftTree.chain(draft.base_logits.argmax(-1))


@register
class DominoBuilder(TreeBuilder):
    name = "domino"
    needs_head = True

    def build(self, draft, head, size):
        tokens, _ = corrected_chain_logits(draft, head)
        return DraftTree.chain(tokens)


@register
class DDTreeBuilder(TreeBuilder):
    name = "ddtree"
    ranked = True
    reads = ("budget",)

    def build(self, draft, head, size):
        return best_first_marginals(draft.base_logits.log_softmax(-1), size)


@register
class DominoDDTreeBuilder(TreeBuilder):
    name = "domino-ddtree"
    ranked = True
    needs_head = True
    reads = ("budget",)

    def build(self, draft, head, size):
        _, logits = corrected_chain_logits(draft, head)
        return best_first_marginals(logits.log_softmax(-1), size)


def candidate_tables(draft, top_k: int) -> torch.Tensor:
    """C_d: the top-K base tokens of every depth, shared by all branches. [D, K]"""
    return draft.base_logits.topk(min(top_k, draft.base_logits.shape[-1]), dim=-1).indices


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
    reads = ("budget", "top_k", "beta")

    def build(self, draft, head, size):
        s = self.settings
        cands = candidate_tables(draft, s.top_k)
        depth_count = cands.shape[0]
        rnd = head.start_round(draft.hidden, draft.base_logits)

        def expand(state, slot):
            lp = head.logits(rnd, slot, state, cands[slot])[0].log_softmax(-1).clamp(max=0)
            lp_sorted, order = lp.sort(descending=True)
            return lp_sorted.tolist(), cands[slot][order].tolist()

        # Per expanded row: (child log-probs sorted, child tokens sorted, state of that row).
        root_state = head.initial_state(draft.bonus)
        root_lps, root_toks = expand(root_state, 0)
        expanded = {0: (root_lps, root_toks, root_state)}
        # entries: (-(score + beta * depth), tie, parent row, depth, rank among the parent's children, parent score)
        heap = [(-(root_lps[0] + s.beta), 0, 0, 1, 0, 0.0)]
        tokens, parents, depths, scores = [], [], [], []
        tie = 1
        while heap and len(tokens) < size:
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


@dataclass
class Supertree:
    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor  # cumulative log-probability of each node's path


def grow_supertree(draft, head: CorrectionHead, top_k: int, quotas, budget: int | None = None, beta: float = 0.0) -> Supertree:
    """Depth-wise batched expansion: every live branch is corrected in one batch per depth.

    ``quotas(slot, placed)`` gives how many (branch, candidate) pairs to keep at a depth; they are
    the global top-n of the [F, K] matrix of cumulative scores (a beam across branches).

    With ``budget`` (the deferred top-B that follows), expansion stops as soon as no deeper node
    can enter that top-B: a descendant scores at most its frontier ancestor's score, plus beta per
    extra depth, and loses ties to the shallower (smaller-row) nodes already placed. The selected
    tree is unchanged; only work that could not matter is skipped.
    """
    cands = candidate_tables(draft, top_k)
    depth_count, k = cands.shape
    rnd = head.start_round(draft.hidden, draft.base_logits)
    states = head.initial_state(draft.bonus)  # [F, S]
    scores = torch.zeros(1, dtype=draft.base_logits.dtype, device=cands.device)  # [F]
    rows = torch.zeros(1, dtype=torch.long, device=cands.device)  # [F] tree rows of the frontier
    out_tokens, out_parents, out_depths, out_scores = [], [], [], []
    placed = 0
    for slot in range(depth_count):
        n = min(quotas(slot, placed), scores.numel() * k)
        if n <= 0:
            break
        logprobs = head.logits(rnd, slot, states, cands[slot]).log_softmax(-1).clamp(max=0)
        total = (scores[:, None] + logprobs).flatten()
        top_scores, flat = total.topk(n)
        branch, cand = flat // k, flat % k
        tokens = cands[slot][cand]
        out_tokens.append(tokens)
        out_parents.append(rows[branch])
        out_depths.append(torch.full((n,), slot + 1, dtype=torch.long, device=cands.device))
        out_scores.append(top_scores)
        rows = torch.arange(placed + 1, placed + 1 + n, device=cands.device)
        placed += n
        scores = top_scores
        if budget is not None and placed >= budget:
            prune = torch.cat([sc + beta * (d + 1) for d, sc in enumerate(out_scores)])
            threshold = prune.topk(budget).values[-1]
            if bool(scores.max() + beta * (slot + 2) <= threshold):
                break
        if slot + 1 < depth_count:
            states = head.advance(states, tokens, rows=branch)
    return Supertree(torch.cat(out_tokens), torch.cat(out_parents), torch.cat(out_depths), torch.cat(out_scores))


@register
class DARTreeBuilder(TreeBuilder):
    """DARTree (pruned): beam of width W per depth, then one deferred global top-B on score + beta*depth."""

    name = "dartree"
    ranked = True
    needs_head = True
    reads = ("budget", "width", "top_k", "beta")

    def build(self, draft, head, size):
        s = self.settings
        st = grow_supertree(draft, head, s.top_k, lambda slot, placed: s.width, budget=size, beta=s.beta)
        prune = st.scores + s.beta * st.depths.to(st.scores.dtype)
        keep = select_top_b(prune, st.parents, size)
        tree = subtree(st.tokens, st.parents, st.depths, keep)
        # The deferred top-B order itself: every prefix is the top-b tree (Lemma 1; ties to the smaller
        # row, which is the parent), so a per-round budget can cut the tree without rebuilding it.
        tree.log_probs = st.scores[keep]
        tree.rank = torch.sort(prune[keep], descending=True, stable=True).indices
        return tree


@register
class DARTreeFixedBuilder(TreeBuilder):
    """DARTree (fixed): a per-depth quota ceil(remaining / remaining depths), exactly B nodes, no pruning."""

    name = "dartree-fixed"
    needs_head = True
    reads = ("budget", "top_k")

    def build(self, draft, head, size):
        budget = size
        depth_count = draft.base_logits.shape[0]

        def quota(slot, placed):
            return -(-(budget - placed) // (depth_count - slot))

        st = grow_supertree(draft, head, self.settings.top_k, quota)
        return DraftTree(st.tokens, st.parents, st.depths)


METHODS: tuple[str, ...] = tuple(BUILDERS)
HEAD_METHODS: tuple[str, ...] = tuple(name for name, b in BUILDERS.items() if b.needs_head)


def available_methods(has_drafter: bool, has_head: bool) -> tuple[str, ...]:
    """The methods a pipeline can run: plain decoding always, drafter methods with a drafter, the
    corrected ones only with a head."""
    return tuple(name for name, b in BUILDERS.items()
                 if (has_drafter or not b.uses_drafter) and (has_head or not b.needs_head))


def make_builder(method: str, settings: TreeSettings | None = None) -> TreeBuilder:
    if method not in BUILDERS:
        raise DartreeError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    settings = settings or TreeSettings()
    settings.validate()
    return BUILDERS[method](settings)
