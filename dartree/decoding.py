"""The one decoding loop shared by every method.

Per round: draft (drafter backbone) -> build a tree (the method) -> verify (ONE target forward over
[root, tree], the walk with the target's own choices, the KV cache compacted to the accepted path)
-> commit (hand the tokens on; the tapped states of the accepted rows are the drafter's next context).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .budget import AdaptiveBudget
from .drafter import DraftProposer
from .heads import CorrectionHead
from .target import TargetAdapter
from .trees import DraftTree, TreeBuilder
from .verify import Sampler, verify

STAGES = ("prefill", "draft", "tree", "verify", "commit")


@dataclass
class GenerationStats:
    method: str
    new_tokens: int = 0
    rounds: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # per round, bonus included
    decode_seconds: float = 0.0  # after prefill and the first draft call, as in the published harnesses
    stage_ms: dict[str, float] = field(default_factory=dict)
    tree_sizes: list[int] = field(default_factory=list)

    @property
    def mean_acceptance(self) -> float:
        return sum(self.acceptance_lengths) / max(len(self.acceptance_lengths), 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "acceptance_lengths": list(self.acceptance_lengths),
            "mean_acceptance": self.mean_acceptance,
            "tokens_per_second": self.tokens_per_second,
            "decode_seconds": self.decode_seconds,
            "stage_ms": dict(self.stage_ms),
            "mean_tree_size": sum(self.tree_sizes) / max(len(self.tree_sizes), 1),
        }


class _Timer:
    """Per-stage wall time. On a GPU each lap first waits for the queued kernels, or a stage would be
    charged with the work of the one before it."""

    def __init__(self, device: torch.device | None = None):
        self.sync = torch.cuda.synchronize if device is not None and device.type == "cuda" else None
        self.totals = defaultdict(float)
        self.mark = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.totals[stage] += now - self.mark
        self.mark = now


def truncate(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Cut at max_new_tokens, then just after the first stop token."""
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def decode(
    target: TargetAdapter,
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
    """``on_tokens`` (optional) receives each round's newly committed tokens as soon as they are
    verified, already cut at max_new_tokens and after a stop token: together they are the output.

    ``budget`` (optional) decides every round how much of the ranked tree to verify, or to take a
    plain target step without drafting; without it every round verifies the builder's whole tree."""
    stats = GenerationStats(method=builder.name)
    use_drafter = builder.uses_drafter
    target.capture = use_drafter and bool(target.tapped_layers)
    timer = _Timer(target.device)

    logits, features = target.prefill(prompt_ids)
    pending = [features]  # tapped target states the drafter has not been given yet
    bonus = int(sampler(logits[None])[0])
    output = [bonus]
    if on_tokens is not None:
        on_tokens(truncate(output, max_new_tokens, stop_ids))
    if proposer is not None:
        proposer.reset()
    if budget is not None:
        budget.start_request()
    start = prompt_ids.numel()  # position of the bonus token, not yet in the target cache
    timer.lap("prefill")
    decode_start = time.perf_counter()
    first_round = True

    while bonus not in stop_ids and len(output) < max_new_tokens:
        if use_drafter and (budget is None or budget.speculate()):
            draft = proposer.draft(bonus, torch.cat(pending) if len(pending) > 1 else pending[0], start)
            pending = []  # the drafter has every context row up to the bonus token now
            timer.lap("draft")
            if first_round:  # the first draft call also prefills the drafter: not decode time
                decode_start = time.perf_counter()
            tree = builder.propose(draft, head) if budget is None else budget.propose(builder, draft, head)
            timer.lap("tree")
        else:
            tree = DraftTree.empty(prompt_ids.device)
        first_round = False

        verified = verify(target, bonus, tree, sampler)
        timer.lap("verify")

        if budget is not None:
            budget.observe(tree, verified.accepted_rows)
        if verified.features is not None:  # rows the drafter has not seen yet (plain steps add up)
            pending.append(verified.features)
        new_tokens = verified.tokens
        start += verified.acceptance_length
        bonus = verified.next_bonus
        stats.acceptance_lengths.append(verified.acceptance_length)
        stats.tree_sizes.append(len(tree))
        timer.lap("commit")
        if on_tokens is not None:  # only what the final output keeps
            fresh = truncate(new_tokens, max_new_tokens - len(output), stop_ids)
            if fresh:
                on_tokens(fresh)
        # A stop token anywhere in this round ends generation; truncate() cuts after it.
        output.extend(new_tokens)
        if stop_ids.intersection(new_tokens):
            break

    stats.decode_seconds = time.perf_counter() - decode_start
    output = truncate(output, max_new_tokens, stop_ids)
    stats.new_tokens = len(output)
    stats.rounds = len(stats.acceptance_lengths)
    stats.stage_ms = {k: 1000.0 * timer.totals.get(k, 0.0) for k in STAGES}
    return output, stats
