"""Budget "auto" variants beside `ar`, in one process on the bundled model.

    .venv/bin/python scripts/draft_depth_ab.py --per-dataset 3 --seed 1 [--out FILE.json]
    .venv/bin/python scripts/draft_depth_ab.py --configs ar,no-free-rounds,shipped,ngram --per-dataset 4

Held-out prompts (the first turns of ``--per-dataset`` seeded samples of each of the seven
benchmarks), 96 new tokens, T = 0. For every prompt the configurations take turns (the order flips
from one prompt to the next, so that a guest whose speed drifts shifts them alike). Configurations
(``--configs``, default ``ar,every-depth,shipped``):

- ``ar``: plain decoding;
- ``shipped``: `dartree`, budget auto as shipped (the draft reaches twice the deepest node recent
  rounds verified, at least 8 depths; rounds without a drafter call verify the n-gram tree, and a
  drafted round is weighed against that free tree);
- ``every-depth``: the same, drafting every depth of the drafter's block (``draft_depth`` forced to None);
- ``no-free-rounds``: the same, as before rounds without a drafter call verified anything (the
  proposer's ``free_proposals`` and the proposal's ``free_part`` taken away: such a round is a plain
  step, and a drafted round is weighed against a plain step);
- ``ngram``: the n-gram proposer alone, budget auto;
- ``ar-python-loop``, ``shipped-python-loop``: ``ar`` and ``shipped`` with the target's layer loop run in
  Python (``LeanWeights.compiled_forward`` taken away: the same kernels, a call each from Python).

Reported per configuration: decode tokens per second (prefill left out), tau over all rounds and over
drafted rounds (rounds with a proposer call), those rounds, and the proposer call and tree build per
such round (the stage clock). Every configuration's text is checked equal to `ar`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dartree  # noqa: E402
from dartree.bench.datasets import DATASETS, load_samples, select  # noqa: E402
from dartree.budget import BudgetPolicy  # noqa: E402
from dartree.hardware import describe_machine  # noqa: E402
from dartree.proposers.combined import DraftAndNgram, DraftAndNgramProposer  # noqa: E402
from dartree.targets.lean import LeanWeights  # noqa: E402


@contextlib.contextmanager
def patched(owner, name: str, value):
    """``owner.name`` set to ``value`` (or taken away, where ``value`` is ``REMOVE``) for the block."""
    original = owner.__dict__[name]
    if value is REMOVE:
        delattr(owner, name)
    else:
        setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


REMOVE = object()


@contextlib.contextmanager
def no_free_rounds():
    with patched(DraftAndNgramProposer, "free_proposals", REMOVE), patched(DraftAndNgram, "free_part", REMOVE):
        yield


def min_draft_depth(depth: int):
    """``BudgetPolicy.draft_depth`` with ``min_draft_depth`` = ``depth`` (a dataclass default is bound at class creation)."""
    def draft_depth(self):
        recent = self.depth_history[-self.recent_rounds:]
        return max(depth, self.build_headroom * max(recent)) if recent else None
    return patched(BudgetPolicy, "draft_depth", draft_depth)


def python_layer_loop():
    return patched(LeanWeights, "compiled_forward", lambda self: None)


CONFIGS = {  # name: (method, the context it runs in)
    "ar": ("ar", contextlib.nullcontext),
    "every-depth": ("dartree", lambda: patched(BudgetPolicy, "draft_depth", lambda self: None)),
    "shipped": ("dartree", contextlib.nullcontext),
    "no-free-rounds": ("dartree", no_free_rounds),
    "min-depth-4": ("dartree", lambda: min_draft_depth(4)),
    "min-depth-2": ("dartree", lambda: min_draft_depth(2)),
    "ngram": ("ngram", contextlib.nullcontext),
    "ar-python-loop": ("ar", python_layer_loop),
    "shipped-python-loop": ("dartree", python_layer_loop),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-dataset", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared" / "benchmarks"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default="ar,every-depth,shipped",
                    help=f"comma list from {', '.join(CONFIGS)} (the first is the baseline; ar must be in it)")
    args = ap.parse_args()
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    if "ar" not in configs:
        ap.error("--configs must hold ar (every text is checked against it)")
    pipe = dartree.load()
    prompts = [s.turns[0] for ds in DATASETS for s in select(load_samples(ds, args.data_dir), args.per_dataset, seed=args.seed)]
    totals = {name: {"tokens": 0, "ms": 0.0, "rounds": 0, "drafted": 0, "drafted_tokens": 0, "draft_ms": 0.0, "tree_ms": 0.0}
              for name in configs}
    mismatches = 0
    for i, prompt in enumerate(prompts):
        texts = {}
        for name in (list(configs) if i % 2 == 0 else list(configs)[::-1]):
            method, context = configs[name]
            with context():
                res = pipe.generate(prompt, method=method, max_new_tokens=args.max_new_tokens)
            t, st = totals[name], res.stats
            t["tokens"] += len(res.token_ids)
            t["ms"] += sum(v for stage, v in st.stage_ms.items() if stage != "prefill")
            t["rounds"] += st.rounds
            t["drafted"] += sum(st.drafted)
            t["drafted_tokens"] += sum(a for a, d in zip(st.acceptance_lengths, st.drafted) if d)
            t["draft_ms"] += st.stage_ms.get("draft", 0.0)
            t["tree_ms"] += st.stage_ms.get("tree", 0.0)
            texts[name] = res.token_ids
        mismatches += sum(ids != texts["ar"] for ids in texts.values())
    rows = {}
    ar_speed = 1000.0 * totals["ar"]["tokens"] / totals["ar"]["ms"]
    print(f"{describe_machine()}; {len(prompts)} prompts, {args.max_new_tokens} tokens, T = 0, target {pipe.target.name}")
    print("| configuration | tok/s | x ar | tau | drafted rounds | tau drafted | draft ms | tree ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, t in totals.items():
        speed = 1000.0 * t["tokens"] / t["ms"]
        rows[name] = dict(t, tokens_per_second=speed, vs_ar=speed / ar_speed)
        per = (lambda x: f"{x / t['drafted']:.2f}") if t["drafted"] else (lambda x: "–")
        print(f"| {name} | {speed:.1f} | {speed / ar_speed:.2f} | {t['tokens'] / t['rounds']:.2f} | {t['drafted']} / {t['rounds']} | "
              f"{per(t['drafted_tokens'])} | {per(t['draft_ms'])} | {per(t['tree_ms'])} |")
    print(f"texts differing from ar's: {mismatches}")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": describe_machine(), "prompts": len(prompts), "rows": rows,
                                              "mismatches": mismatches}, indent=1))
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
