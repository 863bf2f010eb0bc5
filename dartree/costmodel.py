"""The cost model of one decoding round on this machine: what a target forward over n rows, a
drafter call and a tree build cost (measured by ``calibration.py``, cached as JSON). It drives the
per-round budget (``dartree.budget``) and the server's default batch size; ``dartree calibrate``
prints it as a table and draws it.

On an H200 a 65-row verify costs about one decoding step, so the paper fixes B = 64. On a CPU it
does not, and how much it costs depends on the chip, the dtype and the thread count.
"""

from __future__ import annotations

import bisect
import json
import math
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .errors import DartreeError


@dataclass
class CostModel:
    identity: dict  # what the times were measured for (target, drafter, device, dtype, threads, machine)
    context: int  # context length the forwards were appended to
    verify_ms: dict[int, float]  # rows of one target forward -> milliseconds
    draft_ms: float = 0.0  # one drafter call
    tree_ms: float = 0.0  # one dartree build at the largest budget
    # requests in one batched drafter call (``drafter.draft_batch``) -> milliseconds of the call;
    # empty: every request pays ``draft_ms``
    draft_batch_ms: dict[int, float] = field(default_factory=dict)
    # requests whose dartree trees are built together -> milliseconds of the build; empty: ``tree_ms`` each
    tree_batch_ms: dict[int, float] = field(default_factory=dict)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))

    def verify(self, rows: int) -> float:
        """Milliseconds of a target forward over ``rows`` rows: linear between measured sizes, the
        last slope beyond the largest (measured sizes are exact, so a staircase stays a staircase)."""
        if rows < 1:
            raise DartreeError(f"a forward has at least one row, got {rows}")
        # Remembered by row count for this table (a budget asks for every prefix's forward each round;
        # the table is replaced, never changed in place, so a new table starts a new memo).
        memo = self.__dict__.get("_verify_memo")
        if memo is None or memo[0] is not self.verify_ms:
            memo = self.__dict__["_verify_memo"] = (self.verify_ms, {})
        ms = memo[1].get(rows)
        if ms is None:
            ms = memo[1][rows] = _piecewise(self.verify_ms, rows)
        return ms

    def draft_share(self, requests: int) -> float:
        """A request's share of the round's one drafter call when ``requests`` requests draft in it."""
        return _share(self.draft_ms, self.draft_batch_ms, requests)

    def tree_share(self, requests: int) -> float:
        """A request's share of building ``requests`` dartree trees together (``trees.build_trees``)."""
        return _share(self.tree_ms, self.tree_batch_ms, requests)

    def for_proposer(self, proposer: str | None) -> "CostModel":
        """The prices a request of ``proposer`` pays: this model for the drafter (its call and its
        tree build are what ``draft_ms`` / ``tree_ms`` measure); for a proposer without a drafter
        (``ngram``: a lookup of ~0.05 ms in the request's own index) the same forwards and no call or
        build to pay. The copy shares a ``MeasuredCostModel``'s running scales."""
        if proposer is None or "drafter" in proposer.split("+"):  # "drafter", "drafter+ngram"
            return self
        return replace(self, draft_ms=0.0, tree_ms=0.0, draft_batch_ms={}, tree_batch_ms={})

    def round_ms(self, nodes: int) -> float:
        """A speculative round with ``nodes`` tree nodes: draft + tree build + verify over nodes + 1 rows."""
        return self.draft_share(1) + self.tree_share(1) + self.verify(nodes + 1)

    def rounds_ms(self, tree_sizes: list[int], drafted: list[bool]) -> float:
        """Milliseconds of a request's rounds (``GenerationStats.tree_sizes`` / ``drafted``): a drafted
        round costs ``round_ms`` of its tree, a round without a proposer call a forward over its tree (the
        n-gram tree or forced run it verified without one; none: a plain step)."""
        return sum(self.round_ms(n) if d else self.verify(n + 1) for n, d in zip(tree_sizes, drafted, strict=True))

    def to_json(self) -> str:
        raw = {f.name: getattr(self, f.name) for f in fields(CostModel)}  # a MeasuredCostModel's scales are this process's
        raw["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        raw["draft_batch_ms"] = {str(k): v for k, v in self.draft_batch_ms.items()}
        raw["tree_batch_ms"] = {str(k): v for k, v in self.tree_batch_ms.items()}
        return json.dumps(raw, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        raw = json.loads(text)
        raw["verify_ms"] = {int(k): float(v) for k, v in raw["verify_ms"].items()}
        raw["draft_batch_ms"] = {int(k): float(v) for k, v in raw.get("draft_batch_ms", {}).items()}
        raw["tree_batch_ms"] = {int(k): float(v) for k, v in raw.get("tree_batch_ms", {}).items()}
        return cls(**raw)

    def table(self) -> str:
        one = self.verify_ms[min(self.verify_ms)]
        lines = [f"cost model: {self.identity.get('machine', '?')}; {self.identity.get('dtype')}, "
                 f"{self.identity.get('threads')} threads, context {self.context}",
                 f"drafter call {self.draft_ms:.1f} ms"
                 + "".join(f", {k} requests in one call {v:.1f} ms" for k, v in sorted(self.draft_batch_ms.items()))
                 + f"; dartree tree build {self.tree_ms:.1f} ms"
                 + "".join(f", {k} trees together {v:.1f} ms" for k, v in sorted(self.tree_batch_ms.items())), "",
                 "| rows in the forward | ms | x one-row step | break-even tau |", "|---:|---:|---:|---:|"]
        for n in sorted(self.verify_ms):
            ms = self.verify_ms[n]
            spec = ms + (self.draft_ms + self.tree_ms if n > 1 else 0.0)
            lines.append(f"| {n} | {ms:.1f} | {ms / one:.2f}x | {spec / one:.2f} |")
        return "\n".join(lines)

    def plot(self, path: str | Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        sizes = sorted(self.verify_ms)
        one = self.verify_ms[sizes[0]]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(sizes, [self.verify_ms[n] / one for n in sizes], "o-", label="target forward over n rows")
        ax.plot(sizes[1:], [(self.verify_ms[n] + self.draft_ms + self.tree_ms) / one for n in sizes[1:]], "s--",
                label="+ drafter call + tree build (a round)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes], fontsize=7)
        ax.set_xlabel("rows verified (tree nodes + root)")
        ax.set_ylabel("time / one-row step (= break-even τ)")
        ax.set_title(f"{self.identity.get('dtype')}, {self.identity.get('threads')} threads, context {self.context}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.text(0.01, 0.01, self.identity.get("machine", ""), fontsize=6)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


# The stages whose time a serving engine measures against the calibration (``MeasuredCostModel``).
MEASURED_STAGES = ("verify", "draft", "tree")


@dataclass
class MeasuredCostModel(CostModel):
    """The calibration's times, each stage scaled by what this process measures while it serves.

    A cost model is measured once and cached; the machine it then serves on is not always the one it
    was measured on: a job on the other core, a guest whose host got busier, a longer context. A
    calibration taken beside another job can price the target's forward at twice what it costs when
    serving alone while the drafter call stays as it was, and the budget then drafts where it should
    not (the measurements: docs/experiments.md, "Notes that used to live in the code"). The engine reports
    each round's forward, batched drafter call and tree build with what the calibration predicted
    (``observe``); each stage's scale is a running geometric mean of measured / predicted (weight
    ``weight`` for the newest round), and every price the budget asks for is the calibration's times
    that scale. The curve's shape (what n rows cost against one) stays the calibration's.

    Opt-in (``Pipeline.engine(measured_costs=True)``, the server): the budget's choices then depend
    on the clock, so ``generate``, the bench and replay keep the fixed model and stay reproducible."""

    weight: float = 0.1
    scales: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEASURED_STAGES, 1.0))
    observed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEASURED_STAGES, 0))

    @classmethod
    def following(cls, base: CostModel, weight: float = 0.1) -> "MeasuredCostModel":
        if not 0.0 < weight <= 1.0:
            raise DartreeError(f"weight must be in (0, 1], got {weight}")
        return cls(**{f.name: getattr(base, f.name) for f in fields(CostModel)}, weight=weight)

    def observe(self, stage: str, predicted_ms: float, measured_ms: float) -> None:
        """One measurement of ``stage`` (``MEASURED_STAGES``) that the calibration priced at ``predicted_ms``."""
        if stage not in self.scales:
            raise DartreeError(f"unknown stage {stage!r}; measured stages: {', '.join(MEASURED_STAGES)}")
        if predicted_ms <= 0.0 or measured_ms <= 0.0:
            return
        # One stalled round (a page fault, the host stealing the core) may not swing the budget:
        # a single ratio counts at most 4x either way.
        ratio = min(max(measured_ms / predicted_ms, 0.25), 4.0)
        w = self.weight if self.observed[stage] else 1.0  # the first measurement replaces the guess of 1
        self.scales[stage] = math.exp((1.0 - w) * math.log(self.scales[stage]) + w * math.log(ratio))
        self.observed[stage] += 1

    # The calibration's own prices, what ``observe`` compares a measurement with.
    def calibrated_verify(self, rows: int) -> float:
        return CostModel.verify(self, rows)

    def calibrated_draft(self, requests: int) -> float:
        return CostModel.draft_share(self, requests) * max(requests, 1)

    def calibrated_tree(self, requests: int) -> float:
        return CostModel.tree_share(self, requests) * max(requests, 1)

    def verify(self, rows: int) -> float:
        return CostModel.verify(self, rows) * self.scales["verify"]

    def draft_share(self, requests: int) -> float:
        return CostModel.draft_share(self, requests) * self.scales["draft"]

    def tree_share(self, requests: int) -> float:
        return CostModel.tree_share(self, requests) * self.scales["tree"]


def _piecewise(table: dict[int, float], x: int) -> float:
    """``table`` at ``x``: exact at measured sizes, linear between them, the smallest's value below
    the smallest and the last slope beyond the largest."""
    if x in table:
        return table[x]
    sizes = sorted(table)
    if x < sizes[0] or len(sizes) == 1:
        return table[sizes[0]] if x < sizes[0] else table[sizes[-1]]
    j = min(bisect.bisect_left(sizes, x), len(sizes) - 1)  # sizes[j - 1] < x < sizes[j], or the last pair beyond
    lo, hi = sizes[j - 1], sizes[j]
    return table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)


def _share(alone_ms: float, batch_ms: dict[int, float], requests: int) -> float:
    """Per-request milliseconds of one batched call for ``requests`` requests (the call's time
    interpolated over the measured batch sizes, 1 being ``alone_ms``); without batch times every
    request pays ``alone_ms``."""
    if requests <= 1 or not batch_ms:
        return alone_ms
    return _piecewise({1: alone_ms, **batch_ms}, requests) / requests


def default_max_batch(cost: CostModel, limit: int = 16) -> int:
    """The most requests one round should hold: the largest b <= ``limit`` whose b-row forward costs
    at most twice a one-row step (each request of a full batch of plain steps still decodes at least
    half as fast as alone, while the batch's throughput grows with b)."""
    one = cost.verify(1)
    return max([b for b in range(1, limit + 1) if cost.verify(b) <= 2.0 * one] or [1])
