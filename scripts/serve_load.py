"""Load figure: `dartree serve` against `llama-server` (same slots) at several concurrencies, one run.

    bash scripts/build_llama_cpp.sh     # once per machine, for the llama.cpp columns
    .venv/bin/python scripts/serve_load.py --threads 2 --concurrency 1,2,4,8,16 --prompts 24 --max-tokens 96 \
        --out docs/results/serve-load

For each concurrency C, C clients send the held-out chat prompts (the first turns of seeded samples
of the seven benchmarks, each prompt once, streamed, T = 0) through the OpenAI API to

- ``dartree serve --max-batch C`` on the default model (its own process, as llama-server is) for each
  of ``--methods`` (budget auto where the method is ranked, or a fixed per-request budget given as
  ``method:budget``; ``@float32`` after either serves the dequantised float32 weights instead of the
  Q4_1 file as stored), and
- ``llama-server -np C`` on the F32 GGUF of the same weights and on the shipped Q4_1 file.

With ``--target FILE.gguf`` both serve that file instead (a model the user brings): ``dartree serve --target FILE``
(no drafter: ``ar`` and ``ngram`` by default) and the ``llama.cpp-target`` peer, ``llama-server`` on FILE.

Reported per (engine, C): throughput (completion tokens over the wall time from the first request
to the last answer), p50/p95 latency, p50/p95/p99 time to first token, resident memory, and for dartree how
many answers differ from the same request served at the first C; the throughput ratio is against the
first of ``--peers``. Writes summary.json, records.jsonl,
table.md (the table) and load.png.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# name: (label, port); llama.cpp-target: llama-server on the --target file
PEERS = {"llama.cpp-f32": ("llama.cpp F32", 18091), "llama.cpp-q4_1": ("llama.cpp Q4_1", 18092),
         "llama.cpp-target": ("llama.cpp on the target file", 18093)}


def start_dartree(method: str, threads: int, slots: int, port: int, max_tokens: int, target: str | None = None) -> subprocess.Popen:
    """``method`` is a method name, or ``name:budget`` for a fixed per-request budget, either followed by
    ``@weights`` for the target's weights (``--weights``: file, float32, q8_0; default auto)."""
    method, _, weights = method.partition("@")
    name, _, budget = method.partition(":")
    proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "dartree"), "serve", "--port", str(port), "--threads", str(threads),
                             "--max-batch", str(slots), "--max-queue", "64", "--method", name, "--max-new-tokens", str(max_tokens),
                             *(["--budget", budget] if budget else []), *(["--weights", weights] if weights else []),
                             *(["--target", target] if target else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from dartree.bench.llama_cpp import wait_healthy

    if not wait_healthy(proc, f"http://127.0.0.1:{port}", 600):
        proc.kill()
        raise RuntimeError("dartree serve did not come up")
    return proc


def run_clients(base_url: str, model: str, prompts: list[str], clients: int, max_tokens: int, extra: dict) -> tuple[list[dict], float]:
    """Each prompt once, ``clients`` at a time, streamed; returns per-request records and the wall time."""
    from openai import OpenAI

    def one(i: int) -> dict:
        api = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)
        t0 = time.perf_counter()
        first, text, usage = None, "", None
        stream = api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[i]}],
                                             max_tokens=max_tokens, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body=extra)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                usage = chunk.usage
        end = time.perf_counter()
        return {"prompt_index": i, "latency_s": end - t0, "ttft_s": (first or end) - t0, "text": text,
                "completion_tokens": usage.completion_tokens if usage else None}

    one(0)  # warm-up (not counted)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        records = list(pool.map(one, range(len(prompts))))
    return records, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (0 < q <= 1): the smallest value with at least q of them at or below it."""
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q * len(ordered) - 1e-9))) - 1]


def summarize(records: list[dict], wall: float) -> dict:
    lat = [r["latency_s"] for r in records]
    ttft = [r["ttft_s"] for r in records]
    tokens = sum(r["completion_tokens"] for r in records)
    return {"tokens_per_second": round(tokens / wall, 1), "completion_tokens": tokens, "wall_s": round(wall, 2),
            "p50_latency_s": round(statistics.median(lat), 2), "p95_latency_s": round(percentile(lat, 0.95), 2),
            "p50_ttft_s": round(statistics.median(ttft), 3), "p95_ttft_s": round(percentile(ttft, 0.95), 3),
            "p99_ttft_s": round(percentile(ttft, 0.99), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--target", default=None, help="a GGUF file to serve instead of the bundled model (both servers)")
    ap.add_argument("--methods", default=None,
                    help="dartree methods to serve, comma-separated: a name (budget auto where ranked) or name:budget "
                         "for a fixed per-request budget, e.g. ar,dartree,dartree:8 (default ar,dartree; ar,ngram with "
                         "--target)")
    ap.add_argument("--peers", default=None,
                    help="llama-server peers, comma-separated, from: " + ", ".join(PEERS) + " (default llama.cpp-f32,"
                         "llama.cpp-q4_1; llama.cpp-target with --target)")
    ap.add_argument("--no-llama", action="store_true", help="skip the llama.cpp columns")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.target is not None and not Path(args.target).is_file():
        ap.error(f"--target {args.target}: no such file")
    args.methods = args.methods or ("ar,ngram" if args.target else "ar,dartree")
    peers = [] if args.no_llama else (args.peers or ("llama.cpp-target" if args.target else "llama.cpp-f32,llama.cpp-q4_1")).split(",")
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown peer {unknown[0]!r}; choose from {', '.join(PEERS)}")
    if ("llama.cpp-target" in peers) != bool(args.target) or (args.target and len(peers) > 1):
        ap.error("llama.cpp-target is the peer of a --target file, and the only one beside it")

    import torch

    import dartree
    from dartree.bench import llama_cpp
    from dartree.bench.datasets import DATASETS, load_samples, select
    from dartree.hardware import describe_machine, resident_mb

    if peers and llama_cpp.missing():  # before any run, not after the dartree ones
        raise SystemExit(f"{llama_cpp.missing()} (or pass --no-llama)")

    per = -(-args.prompts // len(DATASETS))
    prompts = [s.turns[0] for ds in DATASETS for s in select(load_samples(ds), per)][: args.prompts]
    levels = [int(c) for c in args.concurrency.split(",")]
    dartree.load(args.target, threads=args.threads).cost_model()  # measured (or read from the cache) before any clock starts
    rows, records = [], []
    alone: dict[str, dict[int, str]] = {}
    for method in args.methods.split(","):
        for c in levels:
            proc = start_dartree(method, args.threads, c, 18090, args.max_tokens, args.target)
            try:
                recs, wall = run_clients("http://127.0.0.1:18090/v1", "dartree", prompts, c, args.max_tokens, {})
                memory = resident_mb(proc.pid)
            finally:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=30)
            if c == levels[0]:
                alone[method] = {r["prompt_index"]: r["text"] for r in recs}
            row = {"engine": f"dartree {method}", "concurrency": c, **summarize(recs, wall), "rss_mb": round(memory, 0),
                   "answers_differing_from_alone": sum(r["text"] != alone[method][r["prompt_index"]] for r in recs)}
            rows.append(row)
            records += [{"engine": row["engine"], "concurrency": c, **r} for r in recs]
            print(json.dumps(row), flush=True)
    for peer in peers:
        label, port = PEERS[peer]
        for c in levels:
            weights = Path(args.target) if peer == "llama.cpp-target" else llama_cpp.peer_weights(peer)
            with llama_cpp.LlamaServer(weights, args.threads, port, slots=c, context_per_slot=2048) as server:
                recs, wall = run_clients(f"{server.base_url}/v1", "x", prompts, c, args.max_tokens,
                                         {"top_k": 1, "seed": 0, "cache_prompt": False})
                row = {"engine": label, "concurrency": c, **summarize(recs, wall), "rss_mb": round(resident_mb(server.proc.pid), 0),
                       "server_flags": " ".join(server.flags)}
            rows.append(row)
            records += [{"engine": label, "concurrency": c, **r} for r in recs]
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"machine": describe_machine(), "threads": args.threads, "torch": torch.__version__, "prompts": len(prompts),
               "target": args.target or "bundled SmolLM2-135M-Instruct Q4_1",
               "max_tokens": args.max_tokens, "command": " ".join(sys.argv), "rows": rows}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    reference = PEERS[peers[0]][0] if peers else None  # the ratio's denominator
    peer_at = {r["concurrency"]: r["tokens_per_second"] for r in rows if r["engine"] == reference}
    lines = [f"| engine | clients | tok/s | x {reference or 'llama.cpp'} | p50 latency s | p95 s | p50 TTFT s | p99 TTFT s | RSS MB | answers != alone |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['tokens_per_second'] / peer_at[r['concurrency']]:.2f}" if r["concurrency"] in peer_at else "-"
        lines.append(f"| {r['engine']} | {r['concurrency']} | {r['tokens_per_second']} | {ratio} | {r['p50_latency_s']} | "
                     f"{r['p95_latency_s']} | {r['p50_ttft_s']} | {r['p99_ttft_s']} | {r['rss_mb']:.0f} | {r.get('answers_differing_from_alone', '-')} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for engine in dict.fromkeys(r["engine"] for r in rows):
        rs = [r for r in rows if r["engine"] == engine]
        ax1.plot([r["concurrency"] for r in rs], [r["tokens_per_second"] for r in rs], marker="o", label=engine)
        ax2.plot([r["concurrency"] for r in rs], [r["p50_latency_s"] for r in rs], marker="o", label=engine)
    for ax, title in ((ax1, "throughput (completion tokens / s)"), (ax2, "p50 latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.suptitle(f"{len(prompts)} held-out chat prompts, {args.max_tokens} tokens, T = 0, {args.threads} threads", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=110)


if __name__ == "__main__":
    main()
