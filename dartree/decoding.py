"""Single-request decoding: the round of ``engine.run_round`` over a batch of one.

Per round: draft (drafter backbone) -> build a tree (the method) -> verify (ONE target forward over
[root, tree], the walk with the target's own choices, the KV cache compacted to the accepted path)
-> commit (hand the tokens on; the tapped states of the accepted rows are the drafter's next context).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .budget import AdaptiveBudget
from .drafter import DraftProposer
from .engine import STAGES, GenerationStats, Request, run_alone, truncate
from .heads import CorrectionHead
from .trees import TreeBuilder
from .verify import Sampler

__all__ = ["STAGES", "GenerationStats", "decode", "truncate"]


@torch.no_grad()
def decode(
    target,
    builder: TreeBuilder,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    stop_ids: set[int],
    sampler: Sampler,
    proposer: DraftProposer | None = None,
    head: CorrectionHead | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    budget: AdaptiveBudget | None = None,
) -> tuple[list[int], GenerationStats]:
    """Generate for one request with ``builder``'s method; returns the tokens and the statistics.

    ``on_tokens`` (optional) receives each round's newly committed tokens as soon as they are
    verified, already cut at max_new_tokens and after a stop token: together they are the output.
    ``budget`` (optional) decides every round how much of the ranked tree to verify, or to take a
    plain target step without drafting; without it every round verifies the builder's whole tree."""
    request = Request(prompt_ids, builder, sampler, max_new_tokens, set(stop_ids), budget=budget,
                      proposer=proposer if builder.uses_drafter else None, on_tokens=on_tokens)
    run_alone(target, request, head)
    return request.output, request.stats
