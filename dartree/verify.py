"""Tree verification: the ancestor mask, the target's choice at every row (``Sampler``) and the walk
that turns a verified tree into committed tokens. The round (``engine.run_round``) runs the target's
forward over [root, tree] and compacts the cache to the accepted path; ``replay`` (bench/) uses the
same walk on known choices.

The walk makes every method lossless at any temperature: at each node the target's own choice
(argmax, or an independent sample of its distribution) is drawn; we follow the child carrying that
token; the first choice with no matching child becomes the next bonus token. Every committed token
is therefore a draw from the target given the committed prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy
import torch

from .errors import DartreeError
from .trees import DraftTree

# The walk asks the output layer for at most this many rows at once: the drafter's likely path, then
# the other rows it may still reach, most probable first. The output layer is a pass over its whole
# weight (SmolLM2-135M's: 28 MB in Q8_0, 113 MB in fp32) that several rows share for much less than
# their own passes, while each further ask reads it again. Measured on an AMD EPYC Zen 4, 2 threads
# (scripts/bench_quant_products.py; this guest drifts): Q8_0 8 rows 1.4-1.7x the time of 1, 9 rows
# 1.8-2.0x; fp32 1.1-1.4x. With the likely path alone (at most 6 rows) `dartree` at budget 8 asked
# 1.36 times a round on 21 benchmark prompts, filled to 8 rows 1.08 times (the throughput the same
# within this guest's noise); where extra rows cost little (a GPU) the fill is nearly free.
OUTPUT_ROWS_PER_ASK = 8


def ancestor_matrix(tree: DraftTree) -> torch.Tensor:
    """Boolean [N+1, N+1]: row i marks node i and its ancestors (row/col 0 is the root)."""
    n = len(tree) + 1
    vis = numpy.eye(n, dtype=bool)
    # Parents precede children: each node's row is its parent's, finished, plus itself (a row
    # operation in numpy costs a microsecond, a torch call several: this runs every round)
    for row, parent in enumerate(tree.parents.tolist(), start=1):
        vis[row] |= vis[parent]
    return torch.from_numpy(vis).to(tree.tokens.device)


def children_of(tree: DraftTree) -> dict[int, list[int]]:
    """Rows (root = 0, node i = i + 1) -> their child rows, in node order."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents.tolist()):
        kids.setdefault(p, []).append(i + 1)
    return kids


def first_ask(tree: DraftTree) -> list[int]:
    """The rows whose choices the walk asks for first (``ask_rows`` from the root). The round computes
    their logits for every request of the batch in one output-layer product and hands the choices to
    ``walk`` as ``known``."""
    return ask_rows(tree, 0, children_of(tree), set())


def ask_rows(tree: DraftTree, row: int, children_of: dict[int, list[int]], known) -> list[int]:
    """The rows of one ask from ``row`` (at most ``OUTPUT_ROWS_PER_ASK``): the likely path down from it,
    then the other rows below it whose choices are not ``known``, by the drafter's path probability (the
    chance the walk reaches them; node order where the tree carries no scores)."""
    path = likely_path(tree, row, children_of)[:OUTPUT_ROWS_PER_ASK]
    if len(path) == OUTPUT_ROWS_PER_ASK:
        return path
    below, frontier = [], list(children_of.get(row, ()))
    while frontier:  # every row under ``row``
        below += frontier
        frontier = [kid for r in frontier for kid in children_of.get(r, ())]
    taken = set(path)
    rest = [r for r in below if r not in taken and r not in known]
    if tree.log_probs is not None:
        scores = tree.log_probs.tolist()
        rest.sort(key=lambda r: -scores[r - 1])  # stable: ties keep node order
    return path + rest[:OUTPUT_ROWS_PER_ASK - len(path)]


def likely_path(tree: DraftTree, row: int, children_of: dict[int, list[int]]) -> list[int]:
    """Rows from ``row`` down the tree, each step to the child the drafter ranks best (the first
    child when the tree carries no scores): where the walk most likely goes."""
    path = [row]
    scores = tree.log_probs.tolist() if tree.log_probs is not None else None
    while children_of.get(path[-1]):
        kids = children_of[path[-1]]
        path.append(max(kids, key=lambda r: scores[r - 1]) if scores is not None else kids[0])
    return path


def walk_steps(tree: DraftTree, known: dict[int, int] | None = None):
    """The walk as a generator: it yields the rows whose choices it needs next and is sent those
    choices; it returns the accepted rows and the next bonus token (``walk`` drives it with one
    ``choose``; the round drives every request's walk together, so that each ask of the whole batch
    is one output-layer product)."""
    kids = children_of(tree)
    children = {(p, t): i + 1 for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))}
    choice: dict[int, int] = dict(known or {})
    accepted = [0]
    while True:
        row = accepted[-1]
        if row not in choice:
            rows = ask_rows(tree, row, kids, choice)
            choice.update(zip(rows, (yield rows)))
        child = children.get((row, choice[row]))
        if child is None:
            return accepted, choice[row]
        accepted.append(child)


def walk(tree: DraftTree, choose: Callable[[list[int]], list[int]], known: dict[int, int] | None = None) -> tuple[list[int], int]:
    """The walk: from the root, follow the child carrying the target's choice at each row.

    ``choose(rows)`` returns the target's choices at those rows. The walk asks for the drafter's most
    likely path first, filled with the other rows it may reach, most probable first (``ask_rows``: at
    most ``OUTPUT_ROWS_PER_ASK`` rows an ask), and, only when the target leaves the rows it has, for
    those of the new branch: the output layer over every row of a big tree costs as much as several
    target layers on a CPU, yet the walk visits about tau rows. Each row's choice depends only on its
    own logits and is used only after its ancestors' choices led there, so which rows are asked when
    changes nothing (exactly at T = 0; at T > 0 each used draw is still an independent sample of the
    target at that row).

    ``known``: choices already drawn, for the rows of ``first_ask(tree)`` (exactly what the walk's
    first ask would draw, so the walk is the same with or without them).

    Returns the accepted rows (root first) and the next bonus token (the choice at the last one)."""
    steps = walk_steps(tree, known)
    try:
        rows = next(steps)
        while True:
            rows = steps.send(choose(rows))
    except StopIteration as done:
        return done.value


def follow_tree(tree: DraftTree, choices: torch.Tensor) -> tuple[list[int], int]:
    """The walk over known choices [N+1] (the target's token at every row), e.g. in replay."""
    return walk(tree, lambda rows: choices[rows].tolist())


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` (the first of equal maxima, as torch's): on the CPU in float32/float64 by numpy,
    whose argmax over a 49k-token row takes ~5 us where torch's took 55-80 (an AMD EPYC Zen 3, 2 threads):
    a one-row step's choice is then ~0.1 % of the step instead of ~1.5 %."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        return torch.from_numpy(numpy.ascontiguousarray(logits.numpy()).argmax(-1))
    return logits.argmax(-1)


class Sampler:
    """The target's own choice: argmax at temperature 0, else a sample after temperature/top-k/top-p.

    A sample for the token at position p uses one uniform number u_p drawn from a generator seeded
    by (seed, p) alone: the token is the first whose cumulative probability exceeds u_p. Every row
    of a tree that chooses the token at p uses the same u_p, and only the row on the accepted path
    is kept, so each committed token is an exact draw from the target given the committed prefix
    (the u_p are independent), and a request's text depends only on its seed: not on the method, the
    budget, or which requests share its forwards."""

    def __init__(self, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = 0, device="cpu"):
        self.check(temperature, top_k, top_p)
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = top_p
        self.seed = 0 if seed is None else int(seed)
        self.generator = torch.Generator(device="cpu")

    @staticmethod
    def check(temperature, top_k, top_p) -> None:
        """The one place that validates sampling settings (also used before any model is loaded)."""
        if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise DartreeError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise DartreeError(f"top_k (sampling top-k) must be a positive integer or None, got {top_k!r}")
        if top_p is not None and (isinstance(top_p, bool) or not (isinstance(top_p, (int, float)) and 0 < top_p <= 1)):
            raise DartreeError(f"top_p must be in (0, 1], got {top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    # The nucleus (top-p) is looked for among the best 64 tokens, then the best 512, then every token: a full sort
    # of the vocabulary takes ~4.5 ms a row (SmolLM2's 49k tokens, AMD EPYC Zen 3, float64), as much as a one-row
    # step of the model, and the sampler runs on every row a round verifies; a nucleus is mostly a few tokens.
    NUCLEUS_CANDIDATES = (64, 512)

    def support(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One row's distribution as sampled: the token ids it keeps (ascending; None: every token) and their
        unnormalised weights exp((logit - max) / T), float64. top-k keeps every token scoring at least the k-th
        best; top-p then keeps the fewest best tokens (ties by lower id first) whose mass reaches top_p: a token
        stays while the mass of those before it is below top_p."""
        # in place on one float64 copy: each fresh 400 KB temporary costs the system's page faults
        scores = logits.to(torch.float64, copy=True).div_(self.temperature)
        top = scores.max()
        ids = None
        cut_k, cut_p = self._cuts(scores.numel())
        if cut_k:
            kth = scores.topk(self.top_k).values[-1]
            ids = (scores >= kth).nonzero().squeeze(1)
            weights = scores[ids].sub_(top).exp_()
        else:
            weights = scores.sub_(top).exp_()
        if cut_p:
            ids, weights = self._nucleus(ids, weights)
        return ids, weights

    def _cuts(self, vocab: int) -> tuple[bool, bool]:
        """Whether top-k and top-p cut anything from a vocabulary of ``vocab`` tokens."""
        return self.top_k is not None and self.top_k < vocab, self.top_p is not None and self.top_p < 1

    def _nucleus(self, ids: torch.Tensor | None, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``support``'s top-p step over the support (ids, weights); returns the kept part, ids ascending."""
        reach = self.top_p * weights.sum()
        for m in self.NUCLEUS_CANDIDATES + (weights.numel(),):
            complete = True  # the candidates hold every token the nucleus may take
            if m >= weights.numel():
                cand = torch.arange(weights.numel(), device=weights.device)
            else:  # the m best, and every token tied with the m-th: candidates ascending, so ties sort by id
                best, at = weights.topk(m + 1)
                if best[m - 1] == 0:  # fewer than m tokens weigh anything (a grammar's mask): the m best hold them all
                    cand = at[:m][best[:m] > 0].sort().values
                else:
                    cand = at[:m].sort().values if best[m - 1] > best[m] else (weights >= best[m - 1]).nonzero().squeeze(1)
                    complete = False
            ordered, order = weights[cand].sort(descending=True, stable=True)
            mass = ordered.cumsum(0)
            if complete or mass[-1] >= reach:
                break  # else the nucleus reaches past the candidates: more of them
        before = torch.cat((mass.new_zeros(1), mass[:-1]))  # the mass of the tokens before each
        keep = cand[order[before < reach]].sort().values
        return (keep if ids is None else ids[keep]), weights[keep]

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution actually sampled from, [n, V] float64 (for exact tests)."""
        probs = torch.zeros(logits.shape, dtype=torch.float64, device=logits.device)
        for row, out in zip(logits, probs):
            ids, weights = self.support(row)
            if ids is None:
                out.copy_(weights / weights.sum())
            else:
                out[ids] = weights / weights.sum()
        return probs

    def uniform(self, position: int) -> float:
        """u_p: the one uniform number in [0, 1) of the token at ``position``."""
        self.generator.manual_seed((self.seed * 0x9E3779B97F4A7C15 + int(position)) % (1 << 63))
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def __call__(self, logits: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The choices [n] for logits [n, V] of the tokens at ``positions`` [n]."""
        if logits.dim() != 2 or logits.shape[0] != len(positions):
            raise ValueError(f"Sampler: logits [n, V] and n positions, got {tuple(logits.shape)} and {len(positions)}")
        if self.greedy:
            return argmax_rows(logits)
        if not any(self._cuts(logits.shape[-1])):
            # every token kept: ``support``'s weights for all rows at once
            weights = logits.to(torch.float64, copy=True).div_(self.temperature)
            weights.sub_(weights.max(-1, keepdim=True).values).exp_()
            cdf = weights.cumsum(-1)
            u = torch.tensor([self.uniform(p) for p in positions], dtype=torch.float64, device=cdf.device)
            return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)
        choices = []
        for row, position in zip(logits, positions):
            ids, weights = self.support(row)
            cdf = weights.cumsum(0)
            # the first token whose cumulative weight exceeds u_p of the total: scaled by the total so that rounding
            # in the sum cannot step past the last token
            target = torch.tensor([self.uniform(position)], dtype=torch.float64, device=cdf.device) * cdf[-1]
            at = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.numel() - 1)
            choices.append(at if ids is None else ids[at])
        return torch.cat(choices) if choices else torch.zeros(0, dtype=torch.long, device=logits.device)
