"""The held-out evaluation's greedy answers generated together on the batched engine against one at a
time: the time each takes and whether the tokens are the same (the default fp32 target, 64 tokens).

    python scripts/batched_greedy_check.py --prompts ../shared/prompts --count 16 --slots 16 --threads 1

The prompts are the first of each expanded file's held-out split (chat template, cut to 512 tokens,
as the trainer's held-out sequences are).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dartree  # noqa: E402
from dartree.greedy import GreedyAnswers  # noqa: E402
from dartree.replay import enough_greedy  # noqa: E402
from dartree.hardware import describe_machine  # noqa: E402
from dartree.train.drafter import heldout_prompts  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="../shared/prompts", help="training prompts folder (its held-out split)")
    ap.add_argument("--count", type=int, default=16, help="how many prompts")
    ap.add_argument("--slots", type=int, default=16, help="engine rows per round")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.count < 1 or args.slots < 1:
        ap.error("--count and --slots must be at least 1")
    torch.set_num_threads(args.threads)
    pipe = dartree.load()
    items = heldout_prompts(args.prompts, 1)[: args.count]
    prompts = [pipe.encode(messages=[{"role": "user", "content": p.text}])[:512] for p in items]
    stop = pipe.default_stop_ids()
    store = GreedyAnswers(None, ("i",))
    t0 = time.perf_counter()
    store.prefetch(pipe, [(p, {"i": i}) for i, p in enumerate(prompts)], args.new_tokens, stop, slots=args.slots)
    t1 = time.perf_counter()
    single = [enough_greedy(pipe, p, args.new_tokens, stop) for p in prompts]
    t2 = time.perf_counter()
    same = sum(store.known[(i,)] == s for i, s in enumerate(single))
    print(f"{describe_machine()}; {args.threads} thread(s); prompt lengths {[int(p.numel()) for p in prompts]}")
    print(f"batched ({args.slots} slots): {(t1 - t0) / len(prompts):.2f} s an answer; one at a time: {(t2 - t1) / len(prompts):.2f} s "
          f"({(t2 - t1) / (t1 - t0):.2f}x); identical answers: {same} of {len(prompts)}")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
