"""The held-out replay prompts of ``scripts/heldout_replay.py`` and ``scripts/tree_score_temperature.py``:
the training's held-out prompts beside the benchmarks' first turns (the bench's side, so that
``dartree.train`` never imports the bench)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..pipeline import Pipeline
from ..train.drafter import heldout_prompts
from .datasets import load_samples, select


def heldout_replay_items(pipe: Pipeline, prompts_dir: str | Path, per_file: int, per_benchmark: int) -> list[tuple[str, torch.Tensor]]:
    """(category, prompt ids) of the held-out replay prompts: ``heldout_prompts`` by their categories,
    then the first turns of ``per_benchmark`` MT-Bench and AlpacaEval prompts (categories "mt-bench",
    "alpaca"), each in the chat template."""
    items = [(p.category, pipe.encode(messages=[{"role": "user", "content": p.text}]))
             for p in heldout_prompts(prompts_dir, per_file)]
    for dataset in ("mt-bench", "alpaca"):
        items += [(dataset, pipe.encode(messages=[{"role": "user", "content": s.turns[0]}]))
                  for s in select(load_samples(dataset), per_benchmark)]
    return items
