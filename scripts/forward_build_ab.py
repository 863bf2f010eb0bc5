"""The default target's forward (the compiled layer loop and the output layer) built with other compile-time settings
against the default build, side by side in one process: each build bound to the same weights and K/V store, timed
over 1, 4 and 16 new rows after a context of 200 and 700 tokens, interleaved, each build first in turn; the same
bits asserted. For settings that change only how memory is read (the integer products' prefetch distance,
DQ_PREFETCH); ``--weights float32`` times the float32 target instead of the file as stored.

    .venv/bin/python scripts/forward_build_ab.py --variant "DQ_PREFETCH=0" [--threads 2] [--weights float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dartree
from dartree import kernels, quant
from dartree.hardware import describe_machine
from dartree.targets.base import Part


def output_module(weights) -> str:
    """The attribute holding the compiled module the output layer's product runs on."""
    return "_qext" if weights.integer_products else "_ext"


def bound_build(weights, flags: tuple[str, ...]):
    """(the compiled layer loop bound to ``weights``, the output layer's module) built with ``flags``."""
    default_load = kernels.load_forward
    kernels.load_forward = lambda *a, **k: default_load(extra_cflags=flags)
    try:
        weights.__dict__.pop("_bound", None)
        bound = weights.compiled_forward()
    finally:
        kernels.load_forward = default_load
        weights.__dict__.pop("_bound", None)
    return bound, (quant.load(extra_cflags=flags) if weights.integer_products else kernels.load(extra_cflags=flags))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", required=True, help="space-separated NAME=VALUE compile-time settings of the other build")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="200,700")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--weights", default="auto", help="the target's weights (dartree.load's): auto (the file as stored), float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    flags = tuple(f"-D{item}" for item in args.variant.split())
    pipe = dartree.load(drafter=None, weights=args.weights)
    target, weights = pipe.target, pipe.target.weights
    out = output_module(weights)
    builds = {"default": (weights.compiled_forward(), getattr(weights, out)), args.variant: bound_build(weights, flags)}
    print(describe_machine())
    print(f"torch {torch.__version__}, {args.threads} threads, target {target.name}; milliseconds a forward with its "
          "output layer's rows (median of interleaved repeats)\n")
    print(f"| context | rows | default | {args.variant} | default faster by |\n|---:|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    target.reserve_slots(1)
    for context in (int(c) for c in args.contexts.split(",")):
        target.reset_slot(0)
        prompt = torch.randint(0, weights.vocab, (context,), generator=generator)
        for at in range(0, context, 256):
            target.forward_parts([Part.causal(0, prompt[at:at + 256])])
        for rows in (int(r) for r in args.rows.split(",")):
            tokens = torch.randint(0, weights.vocab, (rows,), generator=generator)
            part = Part.causal(0, tokens)
            times, outputs = {name: [] for name in builds}, {}

            def run(name):
                weights.__dict__["_bound"] = builds[name][0]
                setattr(weights, out, builds[name][1])
                t0 = time.perf_counter()
                hidden, _ = target.forward_parts([part])[0]
                logits = weights.logits(hidden)
                elapsed = time.perf_counter() - t0
                target.store.lengths[0] = context
                return elapsed, logits

            for rep in range(args.repeats):
                for name in (list(builds) if rep % 2 == 0 else list(builds)[::-1]):
                    elapsed, logits = run(name)
                    times[name].append(elapsed)
                    outputs.setdefault(name, logits)
            first, other = outputs.values()
            assert torch.equal(first, other), f"the builds differ at context {context}, {rows} rows"
            a, b = (statistics.median(times[name]) * 1e3 for name in builds)
            print(f"| {context} | {rows} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
    weights.__dict__["_bound"] = builds["default"][0]
    setattr(weights, out, builds["default"][1])


if __name__ == "__main__":
    main()
