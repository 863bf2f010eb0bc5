"""Held-out tau of ``dartree`` when the tree is scored with the correction head's logits divided by a
temperature (a calibration check of the drafter's probabilities; nothing in the decoder uses it).

    .venv/bin/python scripts/tree_score_temperature.py --temperatures 1.0,0.7,1.4 --betas -0.2,-0.5 \
        --out docs/results/drafter-v7/tree-score-temperature.jsonl

The global top-B keeps the paths of highest drafted probability, which is the best tree of B nodes
only if those probabilities are calibrated for what verification accepts (at T = 0: the target's
argmax). A drafter distilled to the target's distribution could be under-confident for that (T < 1
would help) or over-confident on prompts unlike its training data (T > 1 would help). Prompts and
replay as ``scripts/heldout_replay.py`` (the first ``--per-file`` held-out prompts of every expanded
file, 20 MT-Bench and 20 AlpacaEval first turns, 96 new tokens, the committed greedy answers of
``docs/results/drafter-v6/heldout/`` reused); one JSON line per (temperature, beta, budget).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dartree  # noqa: E402
from dartree.bench.heldout import heldout_replay_items  # noqa: E402
from dartree.train.drafter import replay_tau_by_category  # noqa: E402
from dartree.trees import TreeSettings, make_builder  # noqa: E402


class TemperedHead:
    """A correction head whose logits are divided by ``temperature`` (everything else delegated)."""

    def __init__(self, head, temperature: float):
        self.head, self.temperature = head, temperature

    def __getattr__(self, name):
        return getattr(self.head, name)

    def logits(self, *args, **kwargs):
        return self.head.logits(*args, **kwargs) / self.temperature

    def logits_batch(self, *args, **kwargs):
        return self.head.logits_batch(*args, **kwargs) / self.temperature


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperatures", default="1.0,0.7,1.4")
    ap.add_argument("--betas", default="-0.2,-0.5")
    ap.add_argument("--budgets", default="16,64")
    ap.add_argument("--per-file", type=int, default=3)
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "prompts"))
    ap.add_argument("--greedy", default=str(ROOT / "docs/results/drafter-v6/heldout/greedy.jsonl"),
                    help="the target's greedy answers to reuse (copied; answers it lacks are computed)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True, help="JSONL output")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    greedy = work / "greedy.jsonl"
    if Path(args.greedy).exists():
        shutil.copy(args.greedy, greedy)
    pipe = dartree.load(threads=args.threads, cost_model=None)
    items = heldout_replay_items(pipe, args.prompts, args.per_file, per_benchmark=20)
    head = pipe.proposer.head  # the correction head the tree methods apply to the drafter's drafts
    with open(args.out, "w") as out:
        for temperature in (float(t) for t in args.temperatures.split(",")):
            pipe.proposer.head = TemperedHead(head, temperature)
            grid = {f"T={temperature} beta={beta} B={budget}": (beta, budget)
                    for beta in (float(b) for b in args.betas.split(",")) for budget in (int(b) for b in args.budgets.split(","))}
            builders = {name: make_builder("dartree", TreeSettings(budget=budget, beta=beta, ngram=False)) for name, (beta, budget) in grid.items()}
            for name, tau in replay_tau_by_category(pipe, items, builders, 96, greedy).items():
                beta, budget = grid[name]
                record = {"temperature": temperature, "beta": beta, "budget": budget, "tau": tau}
                out.write(json.dumps(record) + "\n")
                out.flush()
                print(json.dumps(record), flush=True)
    pipe.proposer.head = head
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
