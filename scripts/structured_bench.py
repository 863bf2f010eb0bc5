"""Structured output measured: the schema-bound prompts of ``scripts/structured_prompts.jsonl`` (42, written for
this, of five shapes: flat objects, enums, arrays, nested objects, numbers with bounds; held out from any tuning),
T = 0, on the default model, one process, one run:

- constrained ``ar``, the default ``dartree`` and ``ngram`` under each prompt's schema: every answer parsed and
  validated with ``jsonschema``, tokens compared with constrained ``ar``'s, decode tokens per second, tau;
- with ``--unsteered``, ``dartree`` again with its draft not steered to the grammar (``Constraint.steer`` off),
  taking turns with the steered run prompt by prompt;
- with ``--unskipped``, constrained ``ar`` and ``dartree`` again with the output layer computed at every row the
  walks ask for (``Request.decided`` off: a row where the grammar allows one token is normally chosen without it),
  taking turns with the runs as they are prompt by prompt; the output layer's rows per token in every run;
- ``dartree`` on the same prompts without a schema (its tau, against which the forced tokens should show);
- the grammar's own cost (``structured.Constraint``: masks, pruning and forced runs, advancing) as a share of
  the decode time;
- llama.cpp on the same Q4_1 file with its ``json_schema`` field (where built): validity and tokens per second
  (its own decode timing, prompt excluded, as ours).

    .venv/bin/python scripts/structured_bench.py --out docs/results/structured
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import jsonschema
import torch
from tqdm import tqdm

import dartree
from dartree import engine, structured
from dartree.bench import llama_cpp
from dartree.hardware import describe_machine

PROMPTS = Path(__file__).with_name("structured_prompts.jsonl")


def timed_constraint(spent: dict[str, float]) -> None:
    """Every Constraint method the round calls adds its seconds to ``spent['grammar']``."""
    for name in ("mask", "decided", "shape", "advance"):
        original = getattr(structured.Constraint, name)

        def wrapper(self, *args, _original=original, **kwargs):
            t0 = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                spent["grammar"] += time.perf_counter() - t0

        setattr(structured.Constraint, name, wrapper)


@contextlib.contextmanager
def skipping(on: bool):
    """The output layer skipped where the grammar allows one token (on, as the engine does) or computed at every
    row the walks ask for (off: ``Request.decided`` finds none)."""
    original = engine.Request.decided
    if not on:
        engine.Request.decided = lambda self, rows, paths: {}
    try:
        yield
    finally:
        engine.Request.decided = original


@contextlib.contextmanager
def steering(on: bool):
    """``Constraint.steer`` as it is (on) or the proposal handed on unsteered (off)."""
    original = structured.Constraint.steer
    if not on:
        structured.Constraint.steer = lambda self, proposal: proposal
    try:
        yield
    finally:
        structured.Constraint.steer = original


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False


def llama_json_schema(server, ids: list[int], schema: dict, max_new_tokens: int) -> dict:
    body = json.dumps({"prompt": ids, "n_predict": max_new_tokens, "temperature": 0, "top_k": 1, "seed": 0,
                       "cache_prompt": False, "json_schema": schema}).encode()
    req = urllib.request.Request(f"{server.base_url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    t = out["timings"]
    return {"text": out["content"], "new_tokens": int(t["predicted_n"]), "decode_seconds": t["predicted_ms"] / 1000.0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for records.jsonl and summary.md")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--unsteered", action="store_true",
                    help="also run dartree with the draft not steered to the grammar (the A/B of Constraint.steer)")
    ap.add_argument("--unskipped", action="store_true",
                    help="also run ar and dartree with the output layer at every asked row (the A/B of Request.decided)")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp's json_schema run")
    ap.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    args = ap.parse_args()
    prompts = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][:args.limit]
    pipe = dartree.load(threads=args.threads)
    spent = defaultdict(float)
    timed_constraint(spent)
    runs = [("ar", True), ("dartree", True), ("ngram", True), ("dartree", False)]
    if args.unsteered:  # the A/B of the draft's steering to the grammar (``Constraint.steer``)
        runs.insert(2, ("dartree", "unsteered"))
    if args.unskipped:  # the A/B of skipping the output layer where the grammar decides (``Request.decided``)
        runs[1:1] = [("ar", "unskipped")]
        runs.insert(3, ("dartree", "unskipped"))
    for p in prompts[:2]:  # warm-up: kernels, the grammar tokenizer, the first compile
        pipe.generate(messages=[{"role": "user", "content": p["prompt"]}], method="dartree", max_new_tokens=8,
                      response_format=p["schema"])
    records = []
    for p in tqdm(prompts, desc="structured", unit="prompt"):
        messages = [{"role": "user", "content": p["prompt"]}]
        rec = {"id": p["id"], "shape": p["shape"]}
        for method, constrained in runs:
            spent["grammar"] = 0.0
            with steering(constrained != "unsteered"), skipping(constrained != "unskipped"):
                res = pipe.generate(messages=messages, method=method, max_new_tokens=args.max_new_tokens,
                                    response_format=p["schema"] if constrained else None)
            s = res.stats
            rec[f"{method}{'' if constrained is True else '-free' if not constrained else '-' + constrained}"] = {
                "token_ids": res.token_ids, "text": res.text, "new_tokens": s.new_tokens, "rounds": s.rounds,
                "tau": s.mean_acceptance, "decode_seconds": s.decode_seconds, "finish": s.finish_reason,
                "grammar_seconds": spent["grammar"], "output_rows": s.output_rows, "valid": valid(res.text, p["schema"]) if constrained else None}
        records.append(rec)
    peer = None
    if llama_cpp.missing() is None and not args.no_llama:
        with llama_cpp.start_peer("llama.cpp-q4_1", args.threads) as server:
            for p, rec in zip(tqdm(prompts, desc="llama.cpp json_schema", unit="prompt"), records):
                ids = pipe.encode(messages=[{"role": "user", "content": p["prompt"]}]).tolist()
                out = llama_json_schema(server, ids, p["schema"], args.max_new_tokens)
                rec["llama.cpp-q4_1"] = {**out, "valid": valid(out["text"], p["schema"])}
        peer = "llama.cpp-q4_1"
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "records.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    (args.out / "summary.md").write_text(summary(records, peer, args, pipe))
    print((args.out / "summary.md").read_text())
    return 0


def summary(records, peer, args, pipe) -> str:
    def total(key, field):
        return sum(r[key][field] for r in records)

    def rate(key):
        return total(key, "new_tokens") / total(key, "decode_seconds")

    lines = [f"# Structured output, {len(records)} schema-bound prompts, T = 0, {args.max_new_tokens} tokens at most",
             "", f"CPU: {describe_machine()}, {args.threads} threads, torch {torch.__version__}, target {pipe.target.name}; one run, one process.",
             "", "| run | valid | = constrained ar | tokens/s | x constrained ar | tau | grammar share of decode | output-layer rows a token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    ar_rate = rate("ar")
    for key in [k for k in ("ar", "ar-unskipped", "dartree", "dartree-unskipped", "dartree-unsteered", "ngram", "dartree-free")
                if k in records[0]]:
        same = sum(r[key]["token_ids"] == r["ar"]["token_ids"] for r in records) if key != "dartree-free" else None
        ok = sum(bool(r[key]["valid"]) for r in records) if key != "dartree-free" else None
        taus = [r[key]["tau"] for r in records]
        share = total(key, "grammar_seconds") / total(key, "decode_seconds")
        lines.append(f"| {key} | {'' if ok is None else f'{ok}/{len(records)}'} | {'' if same is None else f'{same}/{len(records)}'} | "
                     f"{rate(key):.1f} | {rate(key) / ar_rate:.2f} | {sum(taus) / len(taus):.2f} | {share:.1%} | "
                     f"{total(key, 'output_rows') / total(key, 'new_tokens'):.2f} |")
    if peer:
        ok = sum(bool(r[peer]["valid"]) for r in records)
        lines.append(f"| {peer} json_schema | {ok}/{len(records)} | | {rate(peer):.1f} | {rate(peer) / ar_rate:.2f} | | | |")
    lines += ["", "(`dartree-free`: the same prompts without a schema; its answers are free text, not checked.)"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
