"""A measured cost model of one decoding round on this machine.

On an H200 a 65-row verify costs about one decoding step, so the paper fixes B = 64. On a CPU it
does not, and how much it costs depends on the chip, the dtype and the thread count. This module
times, once per (target, drafter, device, dtype, threads, machine):

- a target forward over n rows (n = 1, 2, 3, 4, 6, ... 128) appended to a context of ``context``
  tokens, with the output layer over the rows a walk asks for first (the likely path, at most
  ``verify.OUTPUT_ROWS_PER_ASK`` rows): the verification of a tree of n - 1 nodes; n = 1 is a plain
  decoding step;
- one drafter call (a round's draft, with a couple of new context rows, as in steady decoding);
- the ``dartree`` tree build at the largest budget.

The result is cached as JSON under ``.cache/costmodel/`` and drives the per-round budget
(``dartree.budget``). ``dartree calibrate`` prints it as a table and draws it.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import kernels
from .errors import DartreeError
from .hardware import describe_machine

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
COST_MODEL_VERSION = 7  # bumped whenever what is timed changes, so that older caches are measured again


@dataclass
class CostModel:
    identity: dict  # what the times were measured for (target, drafter, device, dtype, threads, machine)
    context: int  # context length the forwards were appended to
    verify_ms: dict[int, float]  # rows of one target forward -> milliseconds
    draft_ms: float = 0.0  # one drafter call
    tree_ms: float = 0.0  # one dartree build at the largest budget
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S"))

    def verify(self, rows: int) -> float:
        """Milliseconds of a target forward over ``rows`` rows: linear between measured sizes, the
        last slope beyond the largest (measured sizes are exact, so a staircase stays a staircase)."""
        if rows < 1:
            raise DartreeError(f"a forward has at least one row, got {rows}")
        sizes = sorted(self.verify_ms)
        if rows in self.verify_ms:
            return self.verify_ms[rows]
        if rows < sizes[0]:
            return self.verify_ms[sizes[0]]
        for lo, hi in zip(sizes, sizes[1:]):
            if lo < rows < hi:
                a, b = self.verify_ms[lo], self.verify_ms[hi]
                return a + (b - a) * (rows - lo) / (hi - lo)
        lo, hi = sizes[-2], sizes[-1]
        slope = (self.verify_ms[hi] - self.verify_ms[lo]) / (hi - lo)
        return self.verify_ms[hi] + slope * (rows - hi)

    def round_ms(self, nodes: int) -> float:
        """A speculative round with ``nodes`` tree nodes: draft + tree build + verify over nodes + 1 rows."""
        return self.draft_ms + self.tree_ms + self.verify(nodes + 1)

    def to_json(self) -> str:
        raw = asdict(self)
        raw["verify_ms"] = {str(k): v for k, v in self.verify_ms.items()}
        return json.dumps(raw, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        raw = json.loads(text)
        raw["verify_ms"] = {int(k): float(v) for k, v in raw["verify_ms"].items()}
        return cls(**raw)

    def table(self) -> str:
        one = self.verify_ms[min(self.verify_ms)]
        lines = [f"cost model: {self.identity.get('machine', '?')}; {self.identity.get('dtype')}, "
                 f"{self.identity.get('threads')} threads, context {self.context}",
                 f"drafter call {self.draft_ms:.1f} ms, dartree tree build {self.tree_ms:.1f} ms", "",
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


def default_max_batch(cost: CostModel, limit: int = 16) -> int:
    """The most requests one round should hold: the largest b <= ``limit`` whose b-row forward costs
    at most twice a one-row step (each request of a full batch of plain steps still decodes at least
    half as fast as alone, while the batch's throughput grows with b)."""
    one = cost.verify(1)
    return max([b for b in range(1, limit + 1) if cost.verify(b) <= 2.0 * one] or [1])


def identity(pipe) -> dict:
    """What a cost model depends on."""
    drafter = pipe.drafter
    return {
        "target": f"{pipe.model.config.model_type}-L{pipe.model.config.num_hidden_layers}-H{pipe.model.config.hidden_size}"
                  f"-V{pipe.model.config.vocab_size}",
        "drafter": "none" if drafter is None else
                   f"L{drafter.config.num_hidden_layers}-b{drafter.config.block_size}-V{drafter.config.output_vocab_size}"
                   f"-{drafter.config.projector_type}",
        "device": str(pipe.device),
        "dtype": str(pipe.target.dtype).removeprefix("torch."),
        "forward": pipe.target.kind,  # lean (lean.py) or hf (target.py)
        "kernels": kernels.build_dir().name,  # the lean kernels' source and build: changed kernels, new times
        "threads": torch.get_num_threads(),
        "machine": describe_machine(),
        "version": COST_MODEL_VERSION,
    }


def cache_path(ident: dict, context: int) -> Path:
    from .default_model import cache_root

    digest = hashlib.sha1(json.dumps([ident, context], sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "costmodel" / f"{digest}.json"


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000.0 * (time.perf_counter() - t0))
    return statistics.median(times)


@torch.no_grad()
def measure(pipe, context: int = 256, rows=ROWS, repeats: int = 5, max_budget: int = 64, progress: bool = True) -> CostModel:
    """Time the forwards, the drafter call and the tree build of ``pipe`` on this machine."""
    from tqdm import tqdm

    from .trees import DraftTree, TreeSettings, make_builder
    from .verify import OUTPUT_ROWS_PER_ASK, ancestor_matrix

    target = pipe.target
    gen = torch.Generator().manual_seed(0)
    vocab = pipe.model.config.vocab_size
    prompt = torch.randint(vocab, (context,), generator=gen).to(pipe.device)
    target.capture = pipe.drafter is not None
    _, features = target.prefill(prompt)
    forwards = {}
    for n in rows:
        tokens = torch.randint(vocab, (n,), generator=gen).to(pipe.device)
        forwards[n] = (tokens, torch.arange(n, device=pipe.device), DraftTree.chain(tokens[1:]))

    def forward(n):
        tokens, depths, chain = forwards[n]
        mask = target.tree_mask(ancestor_matrix(chain)) if n > 1 else None
        hidden, _ = target.forward_tree_hidden(tokens, depths, mask)
        target.lm_head(hidden[: min(n, OUTPUT_ROWS_PER_ASK)])
        target.compact(context, torch.zeros(0, dtype=torch.long, device=pipe.device))  # back to the context

    # Sizes take turns, one forward each per pass, so a machine whose speed drifts (a shared or
    # throttled CPU) shifts every size alike instead of bending the curve; each size's median counts.
    times = {n: [] for n in rows}
    for n in rows:
        forward(n)  # warm-up
    for _ in tqdm(range(repeats), desc="timing target forwards", unit="pass", disable=not progress):
        for n in rows:
            t0 = time.perf_counter()
            forward(n)
            times[n].append(1000.0 * (time.perf_counter() - t0))
    verify_ms = {n: statistics.median(ts) for n, ts in times.items()}
    draft_ms = tree_ms = 0.0
    if pipe.proposer is not None:
        bonus = int(prompt[-1])

        def draft_call():
            pipe.proposer.reset()
            pipe.proposer.draft(bonus, features[: context - 2], context - 2)  # the drafter's own prefill
            t0 = time.perf_counter()
            out = pipe.proposer.draft(bonus, features[context - 2:], context)  # a steady round: 2 new rows
            return out, 1000.0 * (time.perf_counter() - t0)

        draft_call()
        timed = [draft_call() for _ in range(repeats)]
        draft_ms = statistics.median(ms for _, ms in timed)
        if pipe.head is not None:
            draft = timed[-1][0]
            builder = make_builder("dartree", TreeSettings(budget=max_budget))
            tree_ms = _median_ms(lambda: builder.propose(draft, pipe.head), repeats)
    target.capture = True
    return CostModel(identity(pipe), context, verify_ms, draft_ms, tree_ms)


def load_or_measure(pipe, context: int = 256, remeasure: bool = False, progress: bool = True) -> CostModel:
    """The cached cost model of this pipeline on this machine, measured (and cached) when missing."""
    ident = identity(pipe)
    path = cache_path(ident, context)
    if path.is_file() and not remeasure:
        try:
            return CostModel.from_json(path.read_text())
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a corrupt cache file is measured again
    if progress:
        import sys

        print(f"dartree: measuring this machine's cost model once (cached in {path.parent}); "
              "`dartree calibrate` shows it", file=sys.stderr)
    model = measure(pipe, context, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model.to_json())
    return model
