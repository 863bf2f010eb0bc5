"""What loading the default model costs: seconds and resident memory, stage by stage, and what the tensors are.

    .venv/bin/python scripts/load_memory.py [--repeat 3] > docs/results/<folder>/load-memory.txt

Each pass runs in a fresh process (a process's memory is only read back as a whole): the time and the
resident memory (VmRSS) after ``import torch``, after ``import dartree`` and ``dartree.load()`` (the
bundled Q4_1 file as stored with the shipped drafter), and after one short generation; then the live
tensors by owner and their storages by size (each storage counted once), and the time of reading the GGUF
file's header with dartree's tensor index and with gguf's own reader. The medians of ``--repeat`` passes are
printed with every pass beside them (the readers' resident column: the process's, after each read).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PASS = r"""
import gc, json, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
out = {}
t0 = time.perf_counter()
import torch
out["import torch"] = (time.perf_counter() - t0, rss())
import dartree
out["import dartree"] = (time.perf_counter() - t0, rss())
t1 = time.perf_counter()
pipe = dartree.load()
out["dartree.load()"] = (time.perf_counter() - t1, rss())
t1 = time.perf_counter()
pipe.generate(prompt="Name three rivers.", max_new_tokens=16)
out["a 16-token generation"] = (time.perf_counter() - t1, rss())
def mb(tensors):  # what is held: a released weight (PyTorch's meta device) holds nothing
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta") / 2**20
from dartree.trees.grow_kernel import head_tables
weights, store, lean = pipe.target.weights, pipe.target.store, pipe.proposer.lean
drafter_lean = [lean.fc, lean.output] + [getattr(l, n) for l in lean.layers for n in ("qkv", "kv", "o", "gate_up", "down")]
tables = head_tables(pipe.head)
out["owners"] = {
    "target: packed layers": mb([getattr(l, n).packed for l in weights.layers for n in ("qkv", "o", "gate_up", "down")]),
    "target: output layer (also the embedding where tied)": mb([weights.output.packed]),
    "target: K/V store": mb([store.k, store.v]),
    "drafter: float32 module weights held (its head's included)": mb(list(pipe.drafter.parameters())),
    "drafter: its products' Q8_0 copies": mb([w.packed if hasattr(w, "packed") else w[0] for w in drafter_lean]),
    "drafter: the tree grower's head tables": mb([t for t in vars(tables).values() if isinstance(t, torch.Tensor)]),
}
import gguf
from dartree.default_model import gguf_path
from dartree.targets.quantized import GGUFTensors
t1 = time.perf_counter()
GGUFTensors(gguf_path())
out["the GGUF header, dartree's tensor index"] = (time.perf_counter() - t1, rss())
t1 = time.perf_counter()
gguf.GGUFReader(str(gguf_path()))
out["the GGUF header, gguf.GGUFReader"] = (time.perf_counter() - t1, rss())
storages = {}
for obj in gc.get_objects():
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
        s = obj.untyped_storage()
        storages[s.data_ptr()] = (s.nbytes(), list(obj.shape), str(obj.dtype).removeprefix("torch."))
out["tensors"] = sorted(storages.values(), reverse=True)
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes to measure (default 3)")
    args = parser.parse_args()
    from dartree.hardware import describe_machine

    runs = []
    for _ in range(args.repeat):
        done = subprocess.run([sys.executable, "-c", PASS], capture_output=True, text=True, check=True)
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"machine: {describe_machine()}; torch threads: default")
    print("seconds: the imports counted from the process's start; the load and the generation each alone")
    print(f"{'stage':<40} {'seconds':>8} {'resident MB':>12}   (each pass)")
    for stage in [k for k in runs[0] if k not in ("tensors", "owners")]:
        secs = [r[stage][0] for r in runs]
        mb = [r[stage][1] for r in runs]
        print(f"{stage:<40} {statistics.median(secs):8.2f} {statistics.median(mb):12.0f}   "
              f"({', '.join(f'{s:.2f} s {m:.0f} MB' for s, m in zip(secs, mb))})")
    print("\nwhose tensors (MB):")
    for owner, size in runs[-1]["owners"].items():
        print(f"  {size:7.1f}  {owner}")
    tensors = runs[-1]["tensors"]
    total = sum(t[0] for t in tensors)
    print(f"\nlive tensor storages: {total / 2**20:.1f} MB in {len(tensors)}; the largest:")
    for nbytes, shape, dtype in tensors[:12]:
        print(f"  {nbytes / 2**20:7.1f} MB  {dtype:<8} {shape}")


if __name__ == "__main__":
    main()
