"""The integer products of two versions of ``dartree/csrc/quant_kernels.cpp`` side by side, one process, in turn:
the source at a git revision (``--base``, built into its own cache folder) against the working tree's, on
SmolLM2-135M's shapes, by row count. Asserts that both give the same bits, then prints the median
microseconds of single products (a few copies of each weight walked in turn, so they come from memory).

    .venv/bin/python scripts/quant_products_ab.py --base HEAD~1 [--threads 1] [--rows 1,2,4,8,16,64] [--variant avx2]
"""

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from dartree import quant
from dartree.hardware import describe_machine
from dartree.kernels import build_extension

from bench_quant_products import random_blocks  # scripts/ is on the path when run as a script

SHAPES = {"gate_up 3072x576": (3072, 576, 8), "down 576x1536": (576, 1536, 8), "output 49152x576": (49152, 576, 1)}
# the K-quants' blocks are 256 wide: a 1B-class Llama's MLP (hidden 2048, intermediate 8192), beyond the L3 cache
K_QUANT_SHAPES = {"gate_up 16384x2048": (16384, 2048, 2), "down 2048x8192": (2048, 8192, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision of the source to compare against")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--types", default="Q4_1,Q4_0,Q8_0", help=f"of {', '.join(quant.TYPES)} (random blocks; the K-quants "
                                                               "on a 1B-class model's shapes)")
    ap.add_argument("--variant", choices=sorted(quant.VARIANTS), default=None,
                    help="build both sides as this instruction-set variant (avx2: the AVX2 path on an AVX-512 CPU)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    source = subprocess.run(["git", "show", f"{args.base}:dartree/csrc/quant_kernels.cpp"], check=True,
                            capture_output=True, text=True, cwd=Path(__file__).parent).stdout
    folder = Path(tempfile.mkdtemp(prefix="dartree-quant-base-"))
    (folder / "quant_kernels.cpp").write_text(source)
    flags = quant.VARIANTS[args.variant] if args.variant else ()
    if set(args.types.split(",")) - set(quant.TYPES):
        ap.error(f"--types takes {', '.join(quant.TYPES)}")
    builds = {"base": build_extension(folder / "quant_kernels.cpp", "quant_kernels_base", "dartree_quant_base",
                                      f"the quantised products at {args.base}", flags),
              "this": quant.load(extra_cflags=flags)}
    print(f"{describe_machine()}; {args.threads} thread(s); base = {args.base}; path {builds['this'].path()}; "
          "median us of single products")
    gen = torch.Generator().manual_seed(0)
    for qtype in args.types.split(","):
        for name, (n, k, copies) in (K_QUANT_SHAPES if quant.BLOCK_FORMAT[qtype][0] == 256 else SHAPES).items():
            if name.startswith("output") and qtype != "Q8_0":  # the bundled file's output layer is Q8_0
                continue
            raws = [random_blocks(qtype, n, k, gen) for _ in range(copies)]
            # each build packs the blocks itself: the record layouts may differ between the two sources
            packed = {key: [m.pack(raw, quant.TYPES[qtype], k) for raw in raws] for key, m in builds.items()}
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k, generator=gen)
                outs = {key: [m.qproduct(x, w, n, None) for w in packed[key]] for key, m in builds.items()}
                assert all(torch.equal(a, b) for a, b in zip(outs["base"], outs["this"])), "the two builds differ"
                us = {}
                for key, m in builds.items():
                    times = []
                    for _ in range(args.repeats):
                        for w in packed[key]:
                            t0 = time.perf_counter()
                            m.qproduct(x, w, n, None)
                            times.append(time.perf_counter() - t0)
                    us[key] = 1e6 * statistics.median(times)
                print(f"{qtype} {name:18s} rows {rows:3d}: base {us['base']:8.1f}  this {us['this']:8.1f}  "
                      f"base/this {us['base'] / us['this']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
