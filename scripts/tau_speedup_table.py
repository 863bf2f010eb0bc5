"""One markdown table from a replay run (tau on many prompts) and a decoding run (tau and
wall-clock speedup on the prompts it finished), per dataset and configuration.

    python scripts/tau_speedup_table.py REPLAY_DIR DECODED_DIR > table.md

The decoded columns only use prompts on which every configuration finished, so each speedup is a
side-by-side ratio over the same prompts. On those prompts the replay tau is printed again next
to the decoded tau: they should agree (up to float rounding of the context features).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dartree.bench.report import METHOD_ORDER, complete_prompts, summarise  # noqa: E402
from dartree.bench.runner import RunConfig, read_records  # noqa: E402
from dartree.engine import ROUND_STAGES  # noqa: E402

CONFIGS: dict[str, RunConfig] = {}  # record key -> its typed configuration


def budget_of(key: str) -> int | None:
    return CONFIGS[key].budget


def budget_rank(key: str) -> int:
    """Sort key: no budget first, then fixed budgets, then 'auto'."""
    budget = budget_of(key)
    return 10**9 if budget == "auto" else (budget or 0)


def method_of(key: str) -> str:
    return CONFIGS[key].method


def label(key: str) -> str:
    return CONFIGS[key].label


def main(replay_dir: str, decoded_dir: str) -> None:
    replayed = [r for r in read_records(Path(replay_dir) / "records.jsonl") if r["temperature"] == 0]
    decoded = [r for r in read_records(Path(decoded_dir) / "records.jsonl") if r["temperature"] == 0]
    done = complete_prompts(decoded)
    decoded = [r for r in decoded if (r["dataset"], r["sample_id"]) in done]
    replay_all = {(s.dataset, s.key): s for s in summarise(replayed)}
    replay_same = {(s.dataset, s.key): s for s in summarise([r for r in replayed if (r["dataset"], r["sample_id"]) in done])}
    dec = {(s.dataset, s.key): s for s in summarise(decoded)}
    CONFIGS.update({r["key"]: RunConfig.from_record(r) for r in decoded + replayed})
    keys = list(dict.fromkeys(r["key"] for r in decoded + replayed))
    keys.sort(key=lambda k: (METHOD_ORDER.index(method_of(k)), budget_rank(k)))
    datasets = sorted({r["dataset"] for r in replayed + decoded})
    mismatches = sum(r.get("matches_ar") is False for r in decoded)
    for d in datasets:
        n_rep = len({r["sample_id"] for r in replayed if r["dataset"] == d})
        n_dec = len({s for ds, s in done if ds == d})
        print(f"### {d}: τ by replay on {n_rep} prompts; decoded τ and speedup on {n_dec} prompts\n")
        print(f"| configuration | τ replay ({n_rep}) | τ replay, same {n_dec} | τ decoded ({n_dec}) | speedup over ar | tokens/s |")
        print("|---|---:|---:|---:|---:|---:|")
        for k in keys:
            ra, rs, de = replay_all.get((d, k)), replay_same.get((d, k)), dec.get((d, k))
            cell = lambda s, f: f(s) if s is not None else ""  # noqa: E731
            print(f"| {label(k)} | {cell(ra, lambda s: f'{s.tau_macro:.2f}')} | {cell(rs, lambda s: f'{s.tau_macro:.2f}')} | "
                  f"{cell(de, lambda s: f'{s.tau_macro:.2f}')} | {cell(de, lambda s: f'{s.speedup_vs_ar:.2f}x' if s.speedup_vs_ar else '')} | "
                  f"{cell(de, lambda s: f'{s.tokens_per_second:.1f}')} |")
        print()
    print(f"T = 0 mismatches against ar in the decoded run: {mismatches} of {sum(r['method'] != 'ar' for r in decoded)} runs.\n")
    print_mean_grid(keys, datasets, dec, replay_all)
    print_where_time_goes(keys, datasets, dec, decoded)


def print_mean_grid(keys: list[str], datasets: list[str], dec: dict, replay_all: dict) -> None:
    """Method x budget: decoded tau / speedup over ar (replay tau), each the mean of the datasets.
    Chain methods have no budget and fill the first column."""
    budgets = sorted({budget_of(k) for k in keys if budget_of(k) is not None}, key=lambda b: 10**9 if b == "auto" else b)
    cell_key = {(method_of(k), budget_of(k) or budgets[0]): k for k in keys if method_of(k) != "ar"}
    methods = list(dict.fromkeys(m for m, _ in cell_key))

    def mean(table, key, attr):
        values = [getattr(table[(d, key)], attr) if (d, key) in table else None for d in datasets]
        return None if None in values else sum(values) / len(values)

    def cell(key):
        if key is None:
            return ""
        tau, speed, rep = mean(dec, key, "tau_macro"), mean(dec, key, "speedup_vs_ar"), mean(replay_all, key, "tau_macro")
        text = f"{tau:.2f} / {speed:.2f}x" if tau is not None and speed is not None else "–"
        return text + (f" ({rep:.2f})" if rep is not None else "")

    print(f"Mean of {', '.join(datasets)}: decoded τ / speedup over ar (replay τ)\n")
    print("| method | " + " | ".join(f"B = {b}" for b in budgets) + " |")
    print("|---|" + "---:|" * len(budgets))
    for m in methods:
        chain = all(budget_of(k) is None for (mm, _), k in cell_key.items() if mm == m)
        name = f"`{m}`" + (" (chain, no budget)" if chain else "")
        print(f"| {name} | " + " | ".join(cell(cell_key.get((m, b))) for b in budgets) + " |")


def print_where_time_goes(keys: list[str], datasets: list[str], dec: dict, decoded: list[dict]) -> None:
    """Per dataset: ms per round by stage, the τ a round needs to match ar's ms per token, and the
    spread of per-prompt speedups (each prompt's tokens/s over its own ar run)."""
    per_prompt = {}
    for r in decoded:
        seconds = sum(t["decode_seconds"] for t in r["turns"])
        per_prompt[(r["dataset"], r["sample_id"], r["key"])] = sum(t["new_tokens"] for t in r["turns"]) / seconds
    ar_key = next(k for k in keys if method_of(k) == "ar")
    round_stages = ROUND_STAGES  # prefill is outside the timed decode
    for d in datasets:
        ar_ms = 1000.0 / dec[(d, ar_key)].tokens_per_second
        print(f"\n### {d}: ms per round (ar: {ar_ms:.0f} ms per token) and per-prompt speedups\n")
        print("| configuration | draft | tree | verify | commit | τ to break even | per-prompt speedup: sd | min | max |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for k in keys:
            if k == ar_key or (d, k) not in dec:
                continue
            ms = dec[(d, k)].stage_ms_per_round
            ratios = [v / per_prompt[(dd, sid, ar_key)] for (dd, sid, kk), v in per_prompt.items() if dd == d and kk == k]
            sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
            round_ms = sum(ms.get(stage, 0.0) for stage in round_stages)
            print(f"| {label(k)} | {ms.get('draft', 0):.0f} | {ms.get('tree', 0):.0f} | {ms.get('verify', 0):.0f} | "
                  f"{ms.get('commit', 0):.0f} | {round_ms / ar_ms:.1f} | {sd:.2f} | {min(ratios):.2f}x | {max(ratios):.2f}x |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
