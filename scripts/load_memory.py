"""What loading the default model costs: seconds and resident memory, stage by stage, and what the tensors are.

    .venv/bin/python scripts/load_memory.py [--repeat 3] > docs/results/<folder>/load-memory.txt

Each pass runs in a fresh process (a process's memory is only read back as a whole): the time and the
resident memory (VmRSS) after ``import torch``, after ``import dartree`` and ``dartree.load()`` (the
bundled Q4_1 file as stored with the shipped drafter), and after one short generation; then the live
tensors' storages by size (each storage counted once). The medians of ``--repeat`` passes are printed
with every pass beside them.
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
    print(f"{'stage':<24} {'seconds':>8} {'resident MB':>12}   (each pass)")
    for stage in [k for k in runs[0] if k != "tensors"]:
        secs = [r[stage][0] for r in runs]
        mb = [r[stage][1] for r in runs]
        print(f"{stage:<24} {statistics.median(secs):8.2f} {statistics.median(mb):12.0f}   "
              f"({', '.join(f'{s:.2f} s {m:.0f} MB' for s, m in zip(secs, mb))})")
    tensors = runs[-1]["tensors"]
    total = sum(t[0] for t in tensors)
    print(f"\nlive tensor storages: {total / 2**20:.1f} MB in {len(tensors)}; the largest:")
    for nbytes, shape, dtype in tensors[:12]:
        print(f"  {nbytes / 2**20:7.1f} MB  {dtype:<8} {shape}")


if __name__ == "__main__":
    main()
