"""Per-depth top-1 accuracy of the drafter's base logits against the target's greedy tokens.

    .venv/bin/python scripts/draft_slot_accuracy.py [--prompts 3] [--positions 150]

Teacher-forced: for every position of each greedy answer the drafter drafts with the true context,
and slot k's argmax is compared with the greedy token k steps ahead, and with the tokens one step
before and after it (a misaligned slot would match those better).
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

import dartree
from dartree.bench.datasets import load_samples, select
from dartree.replay import greedy_continuation
from dartree.targets import prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--positions", type=int, default=150)
    args = parser.parse_args()
    pipe = dartree.load()
    hit, before, after, seen = Counter(), Counter(), Counter(), Counter()
    for sample in select(load_samples(args.dataset), args.prompts, 0):
        ids = pipe.encode(messages=[{"role": "user", "content": sample.turns[0]}])
        y = greedy_continuation(pipe, ids, args.positions + pipe.proposer.num_depths + 2)
        pipe.target.capture = True
        _, features = prefill(pipe.target, torch.cat([ids, torch.tensor(y)]))
        pipe.proposer.reset()
        start = ids.numel()
        cached = 0
        for i in range(min(args.positions, len(y) - 2)):
            draft = pipe.proposer.draft(y[i], features[cached : start + i], start + i)
            cached = start + i
            for k, token in enumerate(draft.base_logits.argmax(-1).tolist()):
                if i + k + 2 < len(y):
                    seen[k] += 1
                    hit[k] += token == y[i + k + 1]
                    before[k] += token == y[i + k]
                    after[k] += token == y[i + k + 2]
    print("| depth | top-1 = greedy token | = token one before | = token one after |")
    print("|---:|---:|---:|---:|")
    for k in sorted(seen):
        print(f"| {k + 1} | {hit[k] / seen[k]:.3f} | {before[k] / seen[k]:.3f} | {after[k] / seen[k]:.3f} |")


if __name__ == "__main__":
    main()
