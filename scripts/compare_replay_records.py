"""Compare two `dartree bench --replay` record files record by record: the tokens, rounds, acceptance
lengths and modeled milliseconds of every (dataset, prompt, method, budget) must be the same (timings
aside). For refactors that must not change what any method does:

    git worktree add /tmp/base HEAD~1   # the code before
    PYTHONPATH=/tmp/base .venv/bin/python -m dartree.cli bench --replay ... --out /tmp/before
    .venv/bin/python -m dartree.cli bench --replay ... --out /tmp/after
    .venv/bin/python scripts/compare_replay_records.py /tmp/before/records.jsonl /tmp/after/records.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys

TIMED = ("stage_ms", "decode_seconds")


def records(path: str) -> dict:
    with open(path) as f:
        return {(r["dataset"], r["sample_id"], r["method"], str(r["budget"])): r for r in map(json.loads, f)}


def untimed(record: dict) -> list[dict]:
    return [{k: v for k, v in turn.items() if k not in TIMED} for turn in record["turns"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    args = ap.parse_args()
    before, after = records(args.before), records(args.after)
    if set(before) != set(after):
        print(f"different record sets: {len(set(before) ^ set(after))} keys in only one", file=sys.stderr)
        return 1
    differing = [k for k in before if untimed(before[k]) != untimed(after[k])
                 or before[k]["output_sha1"] != after[k]["output_sha1"]]
    print(f"{len(before)} records, {len(differing)} differing" + "".join(f"\n  {k}" for k in differing))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
