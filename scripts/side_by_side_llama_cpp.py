"""dartree (lean and Hugging Face forwards) against llama.cpp on the same weights, side by side in one run.

    bash scripts/build_llama_cpp.sh     # once per machine (~8 minutes on 2 cores)
    .venv/bin/python scripts/side_by_side_llama_cpp.py --threads 2 --per-dataset 3 --max-new-tokens 128 --hf-methods ar \
        --out docs/results/lean-forward/side-by-side-2threads

Each prompt (the first turn of ``--per-dataset`` seeded samples of each of the seven benchmarks) is
decoded at T = 0 by every dartree configuration in-process, by Hugging Face ``generate`` (greedy, on
the target as ``from_pretrained`` loads it) and by ``llama-server`` (one slot, given the same prompt
token ids; ``dartree.bench.llama_cpp``) on the F32 GGUF made from the shipped Q4_1 file (the weights
dartree decodes) and on the Q4_1 file itself. Decode speed is new tokens over decode time, prompt processing excluded on both sides (dartree's
``stats.decode_seconds``; llama.cpp's own ``timings``). Reported as total tokens over total time,
with per-dataset means beside it; the records say whether each text (llama.cpp's too) equals lean ``ar``'s tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-dataset", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default="ar,dartree,ddtree", help="dartree methods (budget auto where ranked)")
    ap.add_argument("--hf-methods", default="ar", help="methods also run on the Hugging Face forward (comma-separated; '' for none)")
    ap.add_argument("--no-hf-generate", action="store_true", help="skip Hugging Face generate (greedy) on the target as HF loads it")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import dartree
    from dartree.bench import llama_cpp
    from dartree.bench.datasets import DATASETS, load_samples, select
    from dartree.hardware import describe_machine

    if llama_cpp.missing():
        raise SystemExit(llama_cpp.missing())
    prompts = [(ds, s.turns[0]) for ds in DATASETS for s in select(load_samples(ds), args.per_dataset)]
    index = {p: i for i, (_, p) in enumerate(prompts)}  # the exactness check's key (prompts share long prefixes)
    lean = dartree.load(threads=args.threads, lean=True)
    runs = {"lean": (lean, args.methods.split(","))}
    if args.hf_methods:  # the same model and drafter on the Hugging Face forward (its own cost model)
        # (on the float32 checkpoint: the default target is built straight from the GGUF file, with no float32 weights)
        runs["hf"] = (dartree.load(threads=args.threads, lean=False, weights="float32"), args.hf_methods.split(","))
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
    if not args.no_hf_generate:  # what a Hugging Face user runs: generate on the model as from_pretrained loads it
        from dartree.bench.datasets import Sample
        from dartree.bench.runner import RunConfig, run_hf_peer

        for ds, prompt in prompts:
            turn = run_hf_peer(lean, Sample(ds, str(index[prompt]), [prompt]), RunConfig("hf-generate"), args.max_new_tokens)[0]
            records.append({"engine": "hf-generate", "method": "ar", "dataset": ds, "prompt_index": index[prompt], "prompt": prompt[:80],
                            "new_tokens": turn["new_tokens"], "decode_seconds": turn["decode_seconds"], "token_ids": turn["token_ids"]})
        print("hf-generate done", flush=True)
    for label, peer in (("llama.cpp-F32", "llama.cpp-f32"), ("llama.cpp-Q4_1", "llama.cpp-q4_1")):
        # the same prompt token ids as dartree's (our chat template), greedy
        with llama_cpp.start_peer(peer, args.threads, 18081) as server:
            for ds, prompt in prompts:
                r = server.complete(lean.encode(prompt).tolist(), args.max_new_tokens)
                records.append({"engine": label, "method": "ar", "dataset": ds, "prompt_index": index[prompt], "prompt": prompt[:80],
                                "server_flags": " ".join(server.flags), **r})
        print(label, "done", flush=True)
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
        row["same_tokens_as_lean_ar"] = f"{sum(r['equals_lean_ar'] for r in rs)}/{len(rs)}"
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
              f"  (mean of datasets {row['mean_of_dataset_means']})  same tokens as lean ar {row['same_tokens_as_lean_ar']}"
              + (f"  tau {row['tau_mean']}" if "tau_mean" in row else ""))


if __name__ == "__main__":
    main()
