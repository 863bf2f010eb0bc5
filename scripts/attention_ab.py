"""The lean forward's attention with the queries that share a cache taken together (the default) against one
query at a time, side by side in one process (``set_grouped_attention``): the kernel alone, then the default
model's forward over 1, 4 and 16 rows (its Python layer loop, which calls the same kernel module).

    .venv/bin/python scripts/attention_ab.py [--threads 2] > docs/results/<folder>/attention-ab.txt

With ``--against REV`` it compares instead this checkout's kernel source with the one at git revision ``REV`` (built
beside it into ``.cache/kernels-ab/``), kernel alone, side by side in one process, head_dim 64 and 128, and checks
that the two builds give the same bits:

    .venv/bin/python scripts/attention_ab.py --against HEAD~1 > docs/results/<folder>/attention-build-ab.txt

Both paths give the same bits (tests/test_lean.py); this measures only their time. Medians of interleaved repeats,
each path first in turn. Where both sides run the same code (a one-row step on 2 threads keeps the per-query
path) the ratio shows the measurement's own noise.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import time
from pathlib import Path

import torch


def median_us(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def build_at(revision: str):
    """The lean kernels' source at git ``revision``, built beside this checkout's (a module of its own name)."""
    from dartree import kernels
    from dartree.default_model import cache_root

    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{revision}:dartree/csrc/lean_kernels.cpp"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    folder = cache_root() / "kernels-ab"
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"lean_kernels_{hashlib.sha256(text.encode()).hexdigest()[:12]}.cpp"
    if not source.exists():
        source.write_text(text)
    return kernels.build_extension(source, "kernels-ab", "dartree_lean_kernels_ab", f"the kernels at {revision}",
                                   ("-DDARTREE_AB_BUILD",))


def compare_builds(ext, other, revision: str, repeats: int) -> None:
    """This checkout's attention kernel against ``revision``'s, interleaved, each first in turn; same bits asserted."""
    print(f"\nthe kernel alone, this checkout against {revision} (9 query heads over 3 K/V heads), microseconds a call:")
    heads, kv_heads = 9, 3
    for head_dim in (64, 128):
        k = torch.randn(1, kv_heads, 1024, head_dim)
        v = torch.randn(1, kv_heads, 1024, head_dim)
        for context in (256, 768):
            for rows in (1, 4, 16):
                q = torch.randn(rows, heads * head_dim)
                call = (q, k, v, torch.zeros(rows, dtype=torch.long), torch.full((rows,), context, dtype=torch.long),
                        torch.tril(torch.ones(rows, rows, dtype=torch.uint8)).contiguous(), heads, head_dim ** -0.5)
                assert torch.equal(ext.attention(*call), other.attention(*call)), (head_dim, context, rows)
                times = {0: [], 1: []}
                for repeat in range(repeats):
                    for side in ((0, 1) if repeat % 2 else (1, 0)):
                        module = (ext, other)[side]
                        times[side].append(median_us(lambda: module.attention(*call), max(20, 400 // rows)))
                new, old = statistics.median(times[0]), statistics.median(times[1])
                print(f"  head_dim {head_dim:3d}, context {context:4d}, {rows:2d} rows: this checkout {new:7.1f}, "
                      f"{revision} {old:7.1f} (x{old / new:.2f}); the same bits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--against", metavar="REV", help="compare this checkout's kernel build with git revision REV's")
    args = parser.parse_args()
    import dartree
    from dartree import kernels
    from dartree.hardware import describe_machine, set_threads
    from dartree.targets import lean
    from dartree.targets.base import Part
    from dartree.targets.lean import Rows

    set_threads(args.threads)
    ext = kernels.load()
    print(f"machine: {describe_machine()}; {args.threads} threads")
    if args.against:
        compare_builds(ext, build_at(args.against), args.against, args.repeats)
        return
    print("\nthe kernel alone (SmolLM2's 9 query heads over 3 K/V heads, head_dim 64), microseconds a call:")
    heads, kv_heads, head_dim = 9, 3, 64
    k = torch.randn(1, kv_heads, 1024, head_dim)
    v = torch.randn(1, kv_heads, 1024, head_dim)
    for context in (256, 768):
        for rows in (1, 2, 4, 8, 16):
            q = torch.randn(rows, heads * head_dim)
            call = (q, k, v, torch.zeros(rows, dtype=torch.long), torch.full((rows,), context, dtype=torch.long),
                    torch.tril(torch.ones(rows, rows, dtype=torch.uint8)).contiguous(), heads, head_dim ** -0.5)
            times = {True: [], False: []}
            for repeat in range(args.repeats):
                for grouped in ((True, False) if repeat % 2 else (False, True)):  # each first in turn
                    ext.set_grouped_attention(grouped)
                    times[grouped].append(median_us(lambda: ext.attention(*call), max(20, 400 // rows)))
            ext.set_grouped_attention(True)
            together, alone = statistics.median(times[True]), statistics.median(times[False])
            print(f"  context {context:4d}, {rows:2d} rows: together {together:7.1f}, one query at a time {alone:7.1f} "
                  f"(x{alone / together:.2f})")
    print("\nthe default model's forward (Python layer loop), milliseconds:")
    pipe = dartree.load(cost_model=None)
    target = pipe.target
    for context in (256, 700):
        target.reserve_slots(1)
        target.reset_slot(0)
        target.forward_parts([Part.causal(0, torch.randint(target.config.vocab_size, (context,)))])
        for rows in (1, 4, 16):
            tree = Rows.one_request(torch.randint(target.config.vocab_size, (rows,)), 0, context, torch.arange(rows),
                                    torch.tril(torch.ones(rows, rows, dtype=torch.bool)))
            times = {True: [], False: []}
            for repeat in range(2 * args.repeats):
                for grouped in ((True, False) if repeat % 2 else (False, True)):
                    ext.set_grouped_attention(grouped)
                    t0 = time.perf_counter()
                    lean.forward(target.weights, target.store, tree, compiled=False)
                    times[grouped].append((time.perf_counter() - t0) * 1e3)
            ext.set_grouped_attention(True)
            together, alone = statistics.median(times[True]), statistics.median(times[False])
            print(f"  context {context}, {rows:2d} rows: together {together:6.2f}, one query at a time {alone:6.2f} "
                  f"(x{alone / together:.3f})")


if __name__ == "__main__":
    main()
