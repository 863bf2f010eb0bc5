"""Products on GGUF block-quantised weights (dartree/quant.py: Q8_0, Q4_0, Q4_1, integer block dot
products, row-invariant) against the lean forward's fp32 product (kernels.product on pack_weight), on
SmolLM2-135M's shapes, by row count and thread count.

    .venv/bin/python scripts/bench_quant_products.py [--threads 1,2] [--rows 1,2,4,8,16,32,64] [--out FILE.json]

Each layer shape has 30 copies (one per layer) and the output layer one, walked in turn as a forward
walks them, so the weights come from memory, not from a cache that one weight would fit in. A time is
the median (and, in a second table, the minimum) of single products over ``--repeats`` passes; the
ratio is fp32 time / quantised time (above 1: the quantised product is faster). The "forward" rows are the 121 products of one forward
(30 x [o, qkv, gate_up, down] + output). The weights are random blocks (the time does not depend on
the values); every backend's row invariance is checked on the down and output shapes at the end.
The K-quants are left out: SmolLM2's K = 576 is no multiple of their 256 (Q4_K runs Q4_1's kernel).
"""

import argparse
import json
import os
import statistics
import time

import torch

from dartree import kernels, quant
from dartree.hardware import describe_machine

BENCH_TYPES = ("Q4_0", "Q4_1", "Q8_0")
# name: (N, K, copies)
SHAPES = {"o 576x576": (576, 576, 30), "qkv 960x576": (960, 576, 30), "gate_up 3072x576": (3072, 576, 30),
          "down 576x1536": (576, 1536, 30), "output 49152x576": (49152, 576, 1)}


# where a type's fp16 scale (and minimum) sit in its GGUF block; the rest of a random block is random quants
SCALE_AT = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random GGUF blocks [n, k / values * bytes] with small normal fp16 scales (and minimums for Q4_1 and Q5_1;
    the K-quants' d and dmin)."""
    values, size = quant.BLOCK_FORMAT[qtype]
    nb = k // values
    raw = torch.randint(0, 256, (n, nb, size), generator=gen, dtype=torch.uint8)
    for offset in SCALE_AT.get(qtype, (0,)):
        d = (torch.rand(n, nb, 1, generator=gen) * 0.01 + 0.001).to(torch.float16)
        raw[..., offset:offset + 2] = d.view(torch.uint8)
        if qtype in ("Q4_1", "Q5_1"):
            raw[..., 2:4] = (-8 * d).view(torch.uint8)
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):  # small 6-bit scales, not random bytes' extremes
        d = (torch.rand(n, nb, 1, generator=gen) * 1e-4 + 1e-5).to(torch.float16)
        raw[..., SCALE_AT[qtype][0]:SCALE_AT[qtype][0] + 2] = d.view(torch.uint8)
    return raw.reshape(n, nb * size)


def time_us(run, copies: int, repeats: int) -> tuple[float, float]:
    """(median, minimum) over every call of ``repeats`` passes over the copies (one warm-up pass first), in
    microseconds: single calls, so that a call held up by another process on a shared machine does not set
    the median; the minimum is what a call takes when it has the cores to itself."""
    for i in range(copies):  # warm-up pass
        run(i)
    times = []
    for _ in range(repeats):
        for i in range(copies):
            t0 = time.perf_counter()
            run(i)
            times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times), 1e6 * min(times)


def table(us: dict, names: list[str], threads: list[int], rows: list[int], stat: int) -> None:
    print("| shape | threads | rows | fp32 us | " + " | ".join(f"{qt} us (fp32/{qt})" for qt in BENCH_TYPES) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(BENCH_TYPES))
    for name in names:
        for t in threads:
            for m in rows:
                f = us[t, name, m, "fp32"][stat]
                cells = " | ".join(f"{us[t, name, m, qt][stat]:.1f} ({f / us[t, name, m, qt][stat]:.2f}x)" for qt in BENCH_TYPES)
                print(f"| {name} | {t} | {m} | {f:.1f} | {cells} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lean, qext = kernels.load(), quant.load()
    gen = torch.Generator().manual_seed(0)
    fp32, quantised = {}, {qt: {} for qt in BENCH_TYPES}
    for name, (n, k, copies) in SHAPES.items():
        fp32[name] = [lean.pack_weight(torch.randn(n, k, generator=gen) * 0.02) for _ in range(copies)]
        for qt in BENCH_TYPES:
            quantised[qt][name] = [quant.QuantWeight.from_blocks(qt, random_blocks(qt, n, k, gen), k) for _ in range(copies)]
    backends = {"fp32": lambda name, i, x: lean.product(x, fp32[name][i], SHAPES[name][0], None)}
    for qt in BENCH_TYPES:
        backends[qt] = (lambda qt: lambda name, i, x: qext.qproduct(x, quantised[qt][name][i].packed, SHAPES[name][0]))(qt)
    rows, threads = [int(r) for r in args.rows.split(",")], [int(t) for t in args.threads.split(",")]
    load_before = os.getloadavg()
    us = {}  # (threads, shape, rows, backend) -> (median, minimum) microseconds per product
    with torch.no_grad():
        for t in threads:
            torch.set_num_threads(t)
            for name, (n, k, copies) in SHAPES.items():
                for m in rows:
                    x = torch.randn(m, k, generator=gen)
                    for b, run in backends.items():
                        us[t, name, m, b] = time_us(lambda i: run(name, i, x), copies, args.repeats)
                    print(f"threads {t} {name} rows {m}: " + "  ".join(f"{b} {us[t, name, m, b][0]:.1f}us" for b in backends),
                          flush=True)
            for m in rows:  # one forward's products
                for b in backends:
                    us[t, "forward", m, b] = tuple(sum(us[t, name, m, b][i] * SHAPES[name][2] for name in SHAPES) for i in (0, 1))
    invariant = {}
    for b, run in backends.items():
        ok = True
        for name in ("down 576x1536", "output 49152x576"):
            x = torch.randn(33, SHAPES[name][1], generator=gen)
            full = run(name, 0, x)
            ok &= all(bool(torch.equal(run(name, 0, x[i:i + 1].contiguous()), full[i:i + 1])) for i in range(33))
            ok &= bool(torch.equal(run(name, 0, x[:17].contiguous()), full[:17]))
        invariant[b] = ok
    print()
    print(f"machine: {describe_machine()}; quantised path: {qext.path()}; torch {torch.__version__}; "
          f"load average before/after: {load_before[0]:.2f}/{os.getloadavg()[0]:.2f}")
    print("row-invariant: " + ", ".join(f"{b} {'yes' if ok else 'NO'}" for b, ok in invariant.items()))
    print("\nMedian of single products:\n")
    table(us, list(SHAPES) + ["forward"], threads, rows, 0)
    print("\nMinimum of single products (a call with the cores to itself):\n")
    table(us, list(SHAPES) + ["forward"], threads, rows, 1)
    if args.out:
        record = {"machine": describe_machine(), "path": qext.path(), "torch": torch.__version__, "load_average": load_before,
                  "us_median_min": {"/".join(map(str, key)): [round(v, 2) for v in vs] for key, vs in us.items()},
                  "row_invariant": invariant}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
