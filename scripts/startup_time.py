"""How long a server takes from its start to its first answer: `dartree serve` on the default model against
`llama-server` on the same Q4_1 file, started in turns.

    bash scripts/build_llama_cpp.sh     # once per machine
    .venv/bin/python scripts/startup_time.py [--starts 3] [--threads 2] > docs/results/<folder>/startup.txt

For each start: seconds until GET /health answers, seconds until a first 8-token completion has come back
(a cold process: llama-server loads lazily, dartree warms its kernels), and the resident memory after it.
Medians of ``--starts`` starts of each, every start beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def first_answer(url: str) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        json.loads(r.read())


def one_start(command: list[str], url: str, env: dict) -> tuple[float, float, float]:
    from dartree.bench.llama_cpp import wait_healthy
    from dartree.hardware import resident_mb

    t0 = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # polled every 50 ms: llama-server is up in well under a second
        if not wait_healthy(proc, url, tries=12000, interval=0.05):
            raise RuntimeError(f"{command[0]} did not come up (exit code {proc.poll()})")
        healthy = time.perf_counter() - t0
        first_answer(url)
        answered = time.perf_counter() - t0
        return healthy, answered, resident_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from dartree.bench.llama_cpp import server_binary
    from dartree.default_model import gguf_path
    from dartree.hardware import describe_machine

    port = 8471
    servers = {
        "dartree serve": ([sys.executable, "-m", "dartree.cli", "serve", "--port", str(port), "--threads",
                           str(args.threads)], dict(os.environ)),
        "llama-server (Q4_1 file)": ([str(server_binary()), "-m", str(gguf_path()), "-t", str(args.threads), "-tb",
                                      str(args.threads), "-c", "4096", "-np", "1", "--port", str(port), "--host",
                                      "127.0.0.1", "-ngl", "0"],
                                     dict(os.environ, LD_LIBRARY_PATH=str(Path(server_binary()).parent))),
    }
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in servers}
    for _ in range(args.starts):
        for name, (command, env) in servers.items():
            runs[name].append(one_start(command, f"http://127.0.0.1:{port}", env))
    print(f"machine: {describe_machine()}; {args.threads} threads; {args.starts} starts each, in turns")
    print(f"{'server':<26} {'health s':>9} {'first answer s':>15} {'resident MB':>12}   (each start)")
    for name, rows in runs.items():
        h, a, m = (statistics.median(col) for col in zip(*rows))
        each = ", ".join(f"{x:.2f}/{y:.2f} s {z:.0f} MB" for x, y, z in rows)
        print(f"{name:<26} {h:9.2f} {a:15.2f} {m:12.0f}   ({each})")


if __name__ == "__main__":
    main()
