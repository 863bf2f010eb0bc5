"""Tiny random Llama / Qwen3 targets and DFlash-format drafters, built once per test session."""

import os

import pytest
import torch
from tiny import make_tiny_drafter, make_tiny_target
from transformers.utils import logging as hf_logging

import dartree

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
torch.set_num_threads(min(2, os.cpu_count() or 1))

VOCAB = 8
FAMILIES = ("llama", "qwen3")
HEADS = (None, "domino", "markov")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    dirs = {}
    for i, family in enumerate(FAMILIES):
        target = make_tiny_target(root / f"target-{family}", family=family, vocab_size=VOCAB, seed=i)
        dirs[(family, "target")] = target
        for j, head in enumerate(HEADS):
            dirs[(family, head)] = make_tiny_drafter(root / f"drafter-{family}-{head}", target, head=head, block_size=6, seed=10 * i + j)
    return dirs


@pytest.fixture(scope="session")
def pipelines(model_dirs):
    """(family, head) -> Pipeline in float64; heads share nothing, so each gets its own target."""
    return {
        (family, head): dartree.load(model_dirs[(family, "target")], model_dirs[(family, head)], dtype=torch.float64)
        for family in FAMILIES
        for head in HEADS
    }


def hf_greedy(model, prompt, max_new_tokens, eos=None):
    """Reference: Hugging Face greedy decoding (generated tokens only)."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    if eos is None:
        kwargs["min_new_tokens"] = max_new_tokens
        kwargs["eos_token_id"] = None
    else:
        kwargs["eos_token_id"] = eos
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(prompt):].tolist()


def synthetic_cost(one_row_ms: float, per_row_ms: float, draft_ms: float = 0.0, tree_ms: float = 0.0):
    """A cost model with t_verify(n) = one_row + per_row * (n - 1)."""
    from dartree.costmodel import CostModel

    return CostModel({"machine": "synthetic"}, 256, {n: one_row_ms + per_row_ms * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64, 128)},
                     draft_ms, tree_ms)
