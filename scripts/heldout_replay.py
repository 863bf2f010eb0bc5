"""Held-out tau per category for one or more drafters, by exact replay at T = 0.

    python scripts/heldout_replay.py --drafter dartree/assets/smollm2-drafter-domino --drafter runs/drafter-v3/checkpoint \
        --out docs/results/drafter-v5/heldout

Prompts no drafter trained on: the first ``--per-file`` prompts of every expanded prompt file's
held-out split (``train.data.expanded_prompts(split="held_out")``, by the category SOURCES.md
gives), and the first turns of ``--per-benchmark`` MT-Bench and AlpacaEval prompts (categories
"mt-bench", "alpaca"). For each drafter and method, tau = committed tokens / rounds over a
category's prompts (``train.drafter.replay_tau_by_category``: the decoder's own round on the
target's known greedy answer, so tau is what decoding would get, up to float rounding of the
drafter's context). The target is the default fp32 one; its greedy answers are computed once and
kept in the output folder (``greedy.jsonl``), so a later run on more drafters reuses them.
Writes ``tau.json`` and ``table.md`` there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dartree  # noqa: E402
from dartree.bench.heldout import heldout_replay_items  # noqa: E402
from dartree.hardware import describe_machine  # noqa: E402
from dartree.train.drafter import replay_tau_by_category  # noqa: E402
from dartree.trees import TreeSettings, make_builder  # noqa: E402

METHODS = {"dflash": ("dflash", TreeSettings()), "dartree B=16": ("dartree", TreeSettings(budget=16, ngram=False)),
           "dartree B=64": ("dartree", TreeSettings(budget=64, ngram=False)),
           "dartree B=16 +ngram": ("dartree", TreeSettings(budget=16, ngram=True)),
           "dartree B=64 +ngram": ("dartree", TreeSettings(budget=64, ngram=True)),
           "ngram B=16": ("ngram", TreeSettings(budget=16)), "ngram-chain": ("ngram-chain", TreeSettings())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", action="append", required=True, help="drafter folder (repeat for several)")
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "prompts"), help="training prompts folder (its held-out split)")
    ap.add_argument("--per-file", type=int, default=3, help="held-out prompts per expanded prompt file")
    ap.add_argument("--per-benchmark", type=int, default=20, help="MT-Bench and AlpacaEval prompts each")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated, of: {', '.join(METHODS)} (dflash reads only the backbone's base logits, so "
                         "drafters sharing a backbone need it once)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True, help="output folder")
    args = ap.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := [m for m in methods if m not in METHODS]:
        ap.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    items = None
    for drafter in args.drafter:
        pipe = dartree.load(drafter=drafter, threads=args.threads, cost_model=None)
        if items is None:
            items = heldout_replay_items(pipe, args.prompts, args.per_file, args.per_benchmark)
            print(f"{len(items)} held-out prompts", file=sys.stderr)
        builders = {name: make_builder(*METHODS[name]) for name in methods}
        results[drafter] = replay_tau_by_category(pipe, items, builders, args.max_new_tokens, out / "greedy.jsonl")
        print(drafter, json.dumps(results[drafter]), file=sys.stderr)
    counts: dict[str, int] = {}
    for category, _ in items:
        counts[category] = counts.get(category, 0) + 1
    record = {"machine": describe_machine(), "threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
              "prompts_per_category": counts, "tau": results}
    (out / "tau.json").write_text(json.dumps(record, indent=1) + "\n")
    categories = sorted(counts) + ["all"]
    lines = [f"Held-out tau at T = 0 by exact replay, {args.max_new_tokens} new tokens; prompts per category: "
             + ", ".join(f"{c} {n}" for c, n in sorted(counts.items())) + ".", "",
             "| drafter | method | " + " | ".join(categories) + " |", "|---|---|" + "---:|" * len(categories)]
    for drafter, by_method in results.items():
        for method, tau in by_method.items():
            lines.append(f"| {drafter} | {method} | " + " | ".join(f"{tau.get(c, float('nan')):.2f}" for c in categories) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
