"""Products of the default model's shapes: lean kernels (row-invariant) against MKL (F.linear) and
oneDNN on packed weights, over 1..65 rows, with the memory's measured read speed beside them.

    .venv/bin/python scripts/bench_products.py --threads 2 --out docs/results/lean-forward/products.json

Reports, per row count, the time of the 121 products of one SmolLM2-135M forward on fused weights
(30 layers x [qkv, o, gate_up, down] + the output layer; 538 MB of fp32 weights), the GB/s of
weights read, and whether each backend is row-invariant (every row bitwise equal to that row alone).
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from dartree import kernels
from dartree.hardware import describe_machine, set_threads

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def read_speed_gbs(repeats: int = 7) -> float:
    """Memory read speed: a sum over a 1 GiB buffer (far beyond any cache), best of ``repeats``."""
    buf = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", default="1,2,3,4,6,8,16,17,32,33,64,65")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = set_threads(args.threads)
    ext = kernels.load()
    gen = torch.Generator().manual_seed(0)
    # one weight per layer and kind, so each product reads its weights from memory as in a forward
    weights = {k: [torch.randn(n, kk, generator=gen) * 0.02 for _ in range(LAYERS)] for k, (n, kk) in SHAPES.items()}
    weights["output"] = [torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02]
    total_bytes = sum(w.numel() * 4 for ws in weights.values() for w in ws)
    lean = {k: [ext.pack_weight(w) for w in ws] for k, ws in weights.items()}
    onednn = {k: [torch.ops.mkldnn._reorder_linear_weight(w, 4) for w in ws] for k, ws in weights.items()}
    backends = {
        "lean": lambda k, i, x: ext.product(x, lean[k][i], weights[k][i].shape[0], None),
        "onednn_packed": lambda k, i, x: torch.ops.mkldnn._linear_pointwise(x, onednn[k][i], None, "none", [], ""),
        "mkl_linear": lambda k, i, x: F.linear(x, weights[k][i]),
    }
    rows = [int(r) for r in args.rows.split(",")]
    result = {"machine": describe_machine(), "threads": threads, "weights_mb": total_bytes / 1e6,
              "read_gbs": read_speed_gbs(), "torch": torch.__version__, "ms": {}, "gbs": {}, "row_invariant": {}}
    for name, run in backends.items():
        result["ms"][name], result["gbs"][name] = {}, {}
        with torch.no_grad():
            for m in rows:
                xs = {k: torch.randn(m, ws[0].shape[1], generator=gen) for k, ws in weights.items()}
                times = []
                for _ in range(args.repeats + 1):
                    t0 = time.perf_counter()
                    for k, ws in weights.items():
                        for i in range(len(ws)):
                            run(k, i, xs[k])
                    times.append(time.perf_counter() - t0)
                ms = 1000 * statistics.median(times[1:])
                result["ms"][name][m] = round(ms, 2)
                result["gbs"][name][m] = round(total_bytes / (ms / 1000) / 1e9, 1)
            # row invariance on the output layer and a down product: 65 rows at once vs one at a time
            invariant = True
            for k in ("down", "output"):
                x = torch.randn(65, weights[k][0].shape[1], generator=gen)
                full = run(k, 0, x)
                for m in (3, 4, 8, 16, 17, 33, 64):
                    invariant &= bool(torch.equal(run(k, 0, x[:m].contiguous()), full[:m]))
                invariant &= all(bool(torch.equal(run(k, 0, x[i:i + 1].contiguous())[0], full[i])) for i in range(65))
            result["row_invariant"][name] = invariant
        print(name, "ms", result["ms"][name], "GB/s", result["gbs"][name], "row-invariant", result["row_invariant"][name], flush=True)
    print(f"memory read speed {result['read_gbs']:.1f} GB/s; weights {result['weights_mb']:.0f} MB; {result['machine']}, {threads} threads")
    if args.out:
        from pathlib import Path

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
