"""dartree (lean and Hugging Face forwards) against llama.cpp on the same weights, side by side in one run.

    bash scripts/build_llama_cpp.sh     # once per machine (~8 minutes on 2 cores)
    .venv/bin/python scripts/side_by_side_llama_cpp.py --threads 2 --per-dataset 3 --max-new-tokens 128 --hf-methods ar \
        --out docs/results/lean-forward/side-by-side-2threads

Each prompt (the first turn of ``--per-dataset`` seeded samples of each of the seven benchmarks) is
decoded at T = 0 by every dartree configuration in-process and by ``llama-server`` (one slot) on the
F32 GGUF made from the shipped Q4_1 file (the weights dartree decodes) and on the Q4_1 file itself.
Decode speed is new tokens over decode time, prompt processing excluded on both sides (dartree's
``stats.decode_seconds``; llama.cpp's own ``timings``). Reported as total tokens over total time,
with per-dataset means beside it; the records say whether each dartree text equals lean ``ar``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / ".cache" / "llama.cpp"


def start_server(gguf: Path, threads: int, port: int, extra: tuple[str, ...] = ()) -> subprocess.Popen | None:
    env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMA / "bin"))
    proc = subprocess.Popen([str(LLAMA / "bin" / "llama-server"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
                             "-c", "4096", "-np", "1", "--port", str(port), "--host", "127.0.0.1", "-ngl", "0", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        if proc.poll() is not None:
            return None  # it died (seen: Q4_1 weight repacking hit an illegal instruction in a KVM guest with AMX flags)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    llama_generate(port, "warm up", 8)  # the first request repacks/loads lazily
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    return None


def llama_generate(port: int, prompt: str, max_new_tokens: int) -> dict:
    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_new_tokens, "temperature": 0,
                       "top_k": 1, "seed": 0, "cache_prompt": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    wall = time.perf_counter() - t0
    t = out["timings"]
    return {"new_tokens": t["predicted_n"], "decode_seconds": t["predicted_ms"] / 1000, "wall_seconds": wall,
            "text": out["choices"][0]["message"]["content"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-dataset", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="ar,dartree,ddtree", help="dartree methods (budget auto where ranked)")
    ap.add_argument("--hf-methods", default="ar", help="methods also run on the Hugging Face forward (comma-separated; '' for none)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import dartree
    from dartree.bench.datasets import DATASETS, load_samples, select
    from dartree.default_model import gguf_path
    from dartree.hardware import describe_machine
    from dartree.pipeline import Pipeline

    f32 = LLAMA / "SmolLM2-135M-Instruct.F32.gguf"
    if not (LLAMA / "bin" / "llama-server").is_file() or not f32.is_file():
        raise SystemExit("llama.cpp is not built here; run `bash scripts/build_llama_cpp.sh` first (~8 minutes)")
    prompts = [(ds, s.turns[0]) for ds in DATASETS for s in select(load_samples(ds), args.per_dataset)]
    index = {p: i for i, (_, p) in enumerate(prompts)}  # the exactness check's key (prompts share long prefixes)
    lean = dartree.load(threads=args.threads, lean=True)
    runs = {"lean": (lean, args.methods.split(","))}
    if args.hf_methods:  # the same model and drafter on the Hugging Face forward (its own cost model)
        runs["hf"] = (Pipeline(lean.target_model, lean.drafter, lean.tokenizer, lean=False), args.hf_methods.split(","))
    records = []
    for name, (pipe, methods) in runs.items():
        pipe.generate("warm up", method="dartree", max_new_tokens=8)
        for ds, prompt in prompts:
            for method in methods:
                res = pipe.generate(prompt, method=method, max_new_tokens=args.max_new_tokens)
                records.append({"engine": f"dartree-{name}", "method": method, "dataset": ds, "prompt_index": index[prompt], "prompt": prompt[:80],
                                "new_tokens": res.stats.new_tokens, "decode_seconds": res.stats.decode_seconds,
                                "tau": res.stats.mean_acceptance, "token_ids": res.token_ids})
            print(name, ds, {r["method"]: round(r["new_tokens"] / r["decode_seconds"], 1) for r in records[-len(methods):]}, flush=True)
    for label, gguf, port in (("llama.cpp-F32", f32, 18081), ("llama.cpp-Q4_1", gguf_path(), 18082)):
        extra: tuple[str, ...] = ()
        proc = None
        try:
            proc = start_server(gguf, args.threads, port)
        except OSError:
            pass
        if proc is None:
            extra = ("--no-repack",)
            proc = start_server(gguf, args.threads, port, extra)
        if proc is None:
            raise RuntimeError(f"llama-server on {gguf} did not come up (with or without --no-repack)")
        try:
            for ds, prompt in prompts:
                r = llama_generate(port, prompt, args.max_new_tokens)
                records.append({"engine": label, "method": "ar", "dataset": ds, "prompt": prompt[:80],
                                "server_flags": " ".join(extra), **r})
            print(label, "done", flush=True)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    # exactness: every dartree text against lean ar on the same prompt
    ref = {r["prompt_index"]: r["token_ids"] for r in records if r["engine"] == "dartree-lean" and r["method"] == "ar"}
    for r in records:
        if "token_ids" in r:
            r["equals_lean_ar"] = r["token_ids"] == ref[r["prompt_index"]]
    summary = {"machine": describe_machine(), "threads": args.threads, "torch": torch.__version__,
               "max_new_tokens": args.max_new_tokens, "prompts": len(prompts), "rows": {}}
    for key in sorted({(r["engine"], r["method"]) for r in records}):
        rs = [r for r in records if (r["engine"], r["method"]) == key]
        total = sum(r["new_tokens"] for r in rs) / sum(r["decode_seconds"] for r in rs)
        per_ds = {ds: statistics.mean(r["new_tokens"] / r["decode_seconds"] for r in rs if r["dataset"] == ds) for ds in DATASETS}
        row = {"tokens_per_second_total": round(total, 1), "per_dataset_mean": {k: round(v, 1) for k, v in per_ds.items()},
               "mean_of_dataset_means": round(statistics.mean(per_ds.values()), 1)}
        if "tau" in rs[0]:
            row["tau_mean"] = round(statistics.mean(r["tau"] for r in rs), 2)
            row["exact_vs_lean_ar"] = f"{sum(r['equals_lean_ar'] for r in rs)}/{len(rs)}"
        summary["rows"][" ".join(key)] = row
    f32_total = summary["rows"]["llama.cpp-F32 ar"]["tokens_per_second_total"]
    for row in summary["rows"].values():
        row["ratio_to_llama_cpp_f32_total"] = round(row["tokens_per_second_total"] / f32_total, 2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "token_ids"}) + "\n" for r in records))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    for k, row in summary["rows"].items():
        print(f"{k:28s} {row['tokens_per_second_total']:7.1f} tok/s  x{row['ratio_to_llama_cpp_f32_total']:.2f} llama.cpp F32"
              f"  (mean of datasets {row['mean_of_dataset_means']}){'  tau ' + str(row['tau_mean']) + ' exact ' + row['exact_vs_lean_ar'] if 'tau_mean' in row else ''}")


if __name__ == "__main__":
    main()
