"""One-row step of the default target on the Q4_1 file as stored against the float32 lean target, in one
process, alternating (issue 54's in-process aim: the file's step >= 2.5x faster).

    .venv/bin/python scripts/step_file_vs_float32.py [--threads 2,1] [--passes 6]

A step is the target forward of one row after a context of 200 committed positions plus that row's
output layer (what a plain decoding step costs the target, without the engine's bookkeeping). Each pass
times 30 steps per target (the median counts), the targets take turns, and the figure is the median over
the passes, so a guest whose speed drifts shifts both alike.
"""

import argparse
import statistics
import time

import torch

import dartree
from dartree.hardware import describe_machine
from dartree.targets.lean import Rows, forward


def step(target, context: int = 200) -> None:
    store = target.store
    store.reserve(context + 8)
    store.lengths[0] = context
    rows = Rows.one_request(torch.tensor([17]), 0, context, torch.arange(1), torch.ones(1, 1))
    hidden, _ = forward(target.weights, store, rows, target.tapped_layers)
    target.weights.logits(hidden)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="2,1", help="thread counts, comma-separated")
    ap.add_argument("--passes", type=int, default=6)
    args = ap.parse_args()
    pipes = {"file": dartree.load(cost_model=None), "float32": dartree.load(cost_model=None, weights="float32")}
    print(describe_machine())
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        medians = {name: [] for name in pipes}
        for _ in range(args.passes):
            for name, pipe in pipes.items():
                for _ in range(5):
                    step(pipe.target)
                times = []
                for _ in range(30):
                    t0 = time.perf_counter()
                    step(pipe.target)
                    times.append(1e3 * (time.perf_counter() - t0))
                medians[name].append(statistics.median(times))
        file_ms, float_ms = statistics.median(medians["file"]), statistics.median(medians["float32"])
        print(f"threads {threads}: {pipes['file'].target.name} {file_ms:.2f} ms, {pipes['float32'].target.name} "
              f"{float_ms:.2f} ms: the file's step {float_ms / file_ms:.2f}x faster (passes: "
              f"{[round(x, 2) for x in medians['file']]} / {[round(x, 2) for x in medians['float32']]})")


if __name__ == "__main__":
    main()
