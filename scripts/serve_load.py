"""Load figure for `dartree serve`: N concurrent clients x M streamed requests on the default model.

Starts the server in this process (uvicorn in a thread on a free port, like the tests), sends the
requests with the real `openai` client, and reports requests completed, p50 / p95 latency and time
to first token, generated tokens per second, and the process's resident memory before and after.

    .venv/bin/python scripts/serve_load.py --clients 4 --requests 3 --max-tokens 64 --out docs/results/serve-load
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

PROMPTS = ["What is 12 times 7?", "Name a fruit that is yellow.", "Write one sentence about the sea.",
           "What is the capital of France?", "Give a synonym of 'quick'.", "Count from 1 to 5."]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", help="folder for results.json and README numbers")
    args = ap.parse_args()

    import torch
    from openai import OpenAI
    from test_server import LiveServer

    import dartree
    from dartree.hardware import describe_machine
    from dartree.server import create_app

    pipe = dartree.load(threads=args.threads)
    pipe.cost_model()  # measured (or read from the cache) before the clock starts
    app = create_app(pipe, max_queue=args.clients * args.requests)
    results = []
    with LiveServer(app) as server:
        api = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        api.chat.completions.create(model="dartree", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)  # warm-up
        before = rss_mb()

        def one(i: int) -> dict:
            t0 = time.perf_counter()
            first, text, usage = None, "", None
            stream = api.chat.completions.create(
                model="dartree", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], temperature=0,
                max_tokens=args.max_tokens, stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter() - t0
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    usage = chunk.usage
            return {"latency_s": time.perf_counter() - t0, "ttft_s": first, "tokens": usage.completion_tokens if usage else 0,
                    "tau": usage.model_extra.get("mean_acceptance_length") if usage else None}

        start = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(one, range(args.clients * args.requests)))
        wall = time.perf_counter() - start
        after = rss_mb()

    lat = sorted(r["latency_s"] for r in results)
    ttft = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]  # noqa: E731
    summary = {
        "machine": describe_machine(), "threads": torch.get_num_threads(),
        "clients": args.clients, "requests_per_client": args.requests, "max_tokens": args.max_tokens,
        "completed": len(results), "sent": args.clients * args.requests,
        "latency_p50_s": pct(lat, 0.5), "latency_p95_s": pct(lat, 0.95),
        "ttft_p50_s": pct(ttft, 0.5), "ttft_p95_s": pct(ttft, 0.95),
        "tokens": sum(r["tokens"] for r in results), "wall_s": wall,
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "mean_tau": statistics.mean(r["tau"] for r in results if r["tau"] is not None),
        "rss_mb_before": before, "rss_mb_after": after,
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"summary": summary, "requests": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
