"""Tree verification: one stage, ``verify``, that turns a draft tree into committed tokens.

It owns the root row, the ancestor mask, the target's one forward over [root, tree], the target's
choice at every row (``Sampler``), the walk, and the compaction of the target's KV cache to the
accepted path. ``replay`` (bench/) uses the same walk on known choices.

The walk makes every method lossless at any temperature: at each node the target's own choice
(argmax, or an independent sample of its distribution) is drawn; we follow the child carrying that
token; the first choice with no matching child becomes the next bonus token. Every committed token
is therefore a draw from the target given the committed prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .errors import DartreeError
from .trees import DraftTree

if TYPE_CHECKING:
    from .target import TargetAdapter

# The walk asks the output layer for at most this many rows of a likely path at once; a round
# commits about tau (~2-3) rows, and a further batch, when the walk gets that far, costs one more
# pass over the output weights. Measured (fp32, one CPU thread, SmolLM2-135M's 49k-row output layer):
# 21 ms for 6 rows against 29 ms for 17; `dflash`, whose likely path is its whole 17-row chain,
# 131 -> 125 ms a verify; `dartree` trees, whose likely path is short, unchanged.
OUTPUT_ROWS_PER_ASK = 6


def ancestor_matrix(tree: DraftTree) -> torch.Tensor:
    """Boolean [N+1, N+1]: row i marks node i and its ancestors (row/col 0 is the root)."""
    n = len(tree) + 1
    vis = torch.eye(n, dtype=torch.bool, device=tree.tokens.device)
    if n == 1:
        return vis
    # Parents precede children, so filling depth by depth copies finished parent rows.
    for depth in range(1, int(tree.depths.max()) + 1):
        rows = torch.nonzero(tree.depths == depth).flatten() + 1
        vis[rows] |= vis[tree.parents[rows - 1]]
    return vis


@dataclass
class Verified:
    """What one verification commits."""

    accepted_rows: list[int]  # rows of [root, tree] on the accepted path, root first
    tokens: list[int]  # the committed tokens: the accepted draft tokens, then the next bonus token
    next_bonus: int
    features: torch.Tensor | None  # tapped target states of the accepted rows (the drafter's next context)

    @property
    def acceptance_length(self) -> int:
        """tau of the round: accepted draft tokens + the bonus."""
        return len(self.accepted_rows)


@torch.no_grad()
def verify(target: "TargetAdapter", root: int, tree: DraftTree, sampler: "Sampler") -> Verified:
    """Verify ``tree`` (rooted at the bonus token ``root``, the next token not yet in the target's
    cache) with ONE target forward, walk it with the target's own choices, and compact the cache to
    the accepted path. Every committed token is the target's own choice given the committed prefix,
    so the output is exactly what the target alone would write."""
    start = target.cache_length
    tokens, depths = tree.rows(root)
    mask = target.tree_mask(ancestor_matrix(tree)) if len(tree) else None
    hidden, row_features = target.forward_tree_hidden(tokens, depths, mask)
    accepted, next_bonus = walk(tree, lambda rows: sampler(target.lm_head(hidden[rows])).tolist())
    keep = torch.tensor(accepted, device=tokens.device)
    target.compact(start, keep)
    features = row_features.index_select(0, keep) if row_features is not None else None
    return Verified(accepted, tokens[keep[1:]].tolist() + [next_bonus], next_bonus, features)


def likely_path(tree: DraftTree, row: int, children_of: dict[int, list[int]]) -> list[int]:
    """Rows from ``row`` down the tree, each step to the child the drafter ranks best (the first
    child when the tree carries no scores): where the walk most likely goes."""
    path = [row]
    scores = tree.log_probs.tolist() if tree.log_probs is not None else None
    while children_of.get(path[-1]):
        kids = children_of[path[-1]]
        path.append(max(kids, key=lambda r: scores[r - 1]) if scores is not None else kids[0])
    return path


def walk(tree: DraftTree, choose: Callable[[list[int]], list[int]]) -> tuple[list[int], int]:
    """The walk: from the root, follow the child carrying the target's choice at each row.

    ``choose(rows)`` returns the target's choices at those rows. The walk asks for the drafter's most
    likely path first (at most ``OUTPUT_ROWS_PER_ASK`` rows of it; the rest when the walk gets there)
    and, only when the target leaves it, for the likely path of the new branch:
    the output layer over every row of a tree costs as much as several target layers on a CPU, yet
    the walk visits about tau rows. Each row's choice depends only on its own logits and is used only
    after its ancestors' choices led there, so asking lazily changes nothing (exactly at T = 0; at
    T > 0 each used draw is still an independent sample of the target at that row).

    Returns the accepted rows (root first) and the next bonus token (the choice at the last one)."""
    children_of: dict[int, list[int]] = {}
    children: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        children_of.setdefault(p, []).append(i + 1)
        children[(p, t)] = i + 1
    choice: dict[int, int] = {}
    accepted = [0]
    while True:
        row = accepted[-1]
        if row not in choice:
            rows = likely_path(tree, row, children_of)[:OUTPUT_ROWS_PER_ASK]
            choice.update(zip(rows, choose(rows)))
        child = children.get((row, choice[row]))
        if child is None:
            return accepted, choice[row]
        accepted.append(child)


def follow_tree(tree: DraftTree, choices: torch.Tensor) -> tuple[list[int], int]:
    """The walk over known choices [N+1] (the target's token at every row), e.g. in replay."""
    return walk(tree, lambda rows: choices[rows].tolist())


class Sampler:
    """The target's own choice: argmax at temperature 0, else a sample after temperature/top-k/top-p."""

    def __init__(self, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = 0, device="cpu"):
        self.check(temperature, top_k, top_p)
        self.temperature = float(temperature)
        self.top_k = top_k
        self.top_p = top_p
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(0 if seed is None else int(seed))

    @staticmethod
    def check(temperature, top_k, top_p) -> None:
        """The one place that validates sampling settings (also used before any model is loaded)."""
        if isinstance(temperature, bool) or not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
            raise DartreeError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise DartreeError(f"sampling_top_k must be a positive integer or None, got {top_k!r}")
        if top_p is not None and (isinstance(top_p, bool) or not (isinstance(top_p, (int, float)) and 0 < top_p <= 1)):
            raise DartreeError(f"top_p must be in (0, 1], got {top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution actually sampled from, [n, V] (float64 for exact tests)."""
        scores = logits.to(torch.float64) / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.top_p is not None and self.top_p < 1:
            sorted_scores, order = scores.sort(dim=-1, descending=True)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop_sorted = (cum - sorted_scores.softmax(-1)) >= self.top_p  # keep the smallest head reaching top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            scores = scores.masked_fill(drop, -math.inf)
        return scores.softmax(-1)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.greedy:
            return logits.argmax(-1)
        probs = self.probabilities(logits)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
