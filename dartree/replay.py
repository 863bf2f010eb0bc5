"""Exact acceptance-length replay at temperature 0.

At T = 0 every method writes the target's greedy sequence y, so the acceptance length of a round
depends only on the tree the method builds there and on y: walking the tree with the target's
choices is walking it with y. Replay therefore needs no target forward per round:

1. one greedy ``ar`` run gives y, extended past its stop token by one draft block (a last round
   may accept nodes beyond the stop, and the real decoder counts them);
2. one teacher-forced target forward over prompt + y gives the tapped states at every position
   (the real decoder gets the same rows from its tree forwards, up to float rounding);
3. each method runs the decoder's own round (``engine.run_round``, a batch of one) on a
   ``KnownTarget``: a target whose forward looks its answer up instead of computing it. The
   drafter, the tree builders, the budget policy, the walk and the stop rules are the decoder's.

This measures tau for many methods and budgets at a fraction of the cost of decoding each one
(the tests check it equals the decoder's per-round acceptance lengths); wall-clock speedups still
come from real decoding (``dartree bench``). The bench and the training's held-out evaluation both
replay through here; the target's greedy answers they keep across runs are ``dartree.greedy``'s.

With a cost model (``dartree calibrate``), replay also adds up what each round would cost on that
machine (``CostModel.rounds_ms``: drafter call + tree build + a target forward over the tree's rows;
a plain step is a one-row forward) and runs ``budget="auto"``: its policy (``dartree.budget``) sees
the same trees and acceptances as in decoding, so its choices, and the modeled speedup over ``ar``,
come without a single timed decode. The modeled speedup is a prediction from the cost model, not a
measurement.
"""

from __future__ import annotations

import torch

from .budget import BudgetPolicy
from .costmodel import CostModel
from .engine import Engine, Request, run_alone, truncate
from .errors import require
from .proposers import NgramProposer, make_proposer
from .targets import KnownTarget, prefill
from .trees import TreeBuilder, make_builder
from .verify import Sampler


def replay_depths(pipe) -> int:
    """D: how deep any round's proposals can reach (the drafter's block or the n-gram proposer's
    continuations, whichever is deeper): replay needs the greedy tokens that far past a round's bonus."""
    return max(NgramProposer.num_depths, pipe.proposer.num_depths if pipe.proposer is not None else 0)


@torch.no_grad()
def greedy_continuation(pipe, prompt_ids: torch.Tensor, length: int, stop_ids: set[int] = frozenset()) -> list[int]:
    """The target's greedy tokens after the prompt: ``length`` of them, or up to a stop token."""
    return greedy_continuations(pipe, [prompt_ids], length, stop_ids, slots=1)[0]


def greedy_continuations(pipe, prompts: list[torch.Tensor], length: int, stop_ids: set[int] = frozenset(),
                         slots: int = 16) -> list[list[int]]:
    """``greedy_continuation`` of many prompts in one run of the batched engine, up to ``slots`` of
    them a round (a target without batched rows takes them one at a time): the same tokens, since no
    row of a round depends on another (``tests/test_engine.py``)."""
    engine = Engine(pipe.target, max_batch=slots)
    requests = [Request(p.reshape(-1), make_builder("ar"), Sampler(0.0), length, set(stop_ids)) for p in prompts]
    for r in requests:
        engine.submit(r)
    engine.run()
    for r in requests:
        if r.error is not None:
            raise r.error
    return [r.output for r in requests]


def enough_greedy_many(pipe, prompts: list[torch.Tensor], max_new_tokens: int, stop_ids: set[int], slots: int = 16) -> list[list[int]]:
    """``enough_greedy`` of many prompts, generated together on the batched engine: each prompt's
    greedy tokens to ``max_new_tokens`` + D + 1, cut to what ``enough_greedy`` keeps (its output and
    the D + 1 tokens past it), the same lists."""
    depths = replay_depths(pipe)
    out = []
    for p, greedy in zip(prompts, greedy_continuations(pipe, prompts, max_new_tokens + depths + 1, slots=slots)):
        keep = len(truncate(greedy, max_new_tokens, stop_ids)) + depths + 1
        out.append(enough_greedy(pipe, p.reshape(-1), max_new_tokens, stop_ids, greedy=greedy[:keep]))
    return out


def enough_greedy(pipe, prompt_ids: torch.Tensor, max_new_tokens: int, stop_ids: set[int], greedy: list[int] | None = None) -> list[int]:
    """The target's greedy tokens, long enough to replay any method: the decoder's output plus
    D + 1 tokens, since a last round looks that far past its bonus. ``greedy`` (for instance
    ``ar``'s output, which ends at a stop token) is extended rather than recomputed."""
    depths = replay_depths(pipe)
    if greedy is None:
        greedy = greedy_continuation(pipe, prompt_ids, max_new_tokens, stop_ids)
    greedy = list(greedy)
    output = truncate(greedy, max_new_tokens, stop_ids)
    complete = len(output) == max_new_tokens or (output and output[-1] in stop_ids)
    missing = (max_new_tokens if not complete else len(output)) + depths + 1 - len(greedy)
    if missing > 0:
        prefix = torch.cat([prompt_ids, torch.tensor(greedy, dtype=prompt_ids.dtype, device=prompt_ids.device)])
        greedy += greedy_continuation(pipe, prefix, missing)
    return greedy


@torch.no_grad()
def replay(
    pipe,
    prompt_ids: torch.Tensor,
    builders: dict[str, TreeBuilder],
    max_new_tokens: int,
    stop_ids: set[int],
    greedy: list[int] | None = None,
    timings: dict[str, float] | None = None,
    cost: CostModel | None = None,
    policies: dict[str, BudgetPolicy] | None = None,
    modeled: dict[str, float] | None = None,
) -> tuple[list[int], dict[str, list[int]]]:
    """Per-round acceptance lengths (bonus included) that each builder would get at T = 0.

    ``greedy``: the target's greedy tokens after the prompt if known (for instance ``ar``'s
    output, which ends at a stop token); replay computes or extends them as needed. Returns the
    output the decoder would write and the acceptance lengths by builder name; ``timings``, when
    given, receives each builder's total tree-build seconds (the rounds see the same drafts, so
    builders compare side by side).

    ``cost`` (optional) models each round's time; ``modeled``, when given, receives each builder's
    total modeled milliseconds. ``policies`` (optional, needs ``cost``'s times inside them) maps
    builder names to budget policies that cut their ranked trees every round, as ``budget="auto"``
    does in decoding; a policy starts a new request here and keeps its calibration across calls.
    """
    policies = policies or {}
    require(all(name in builders and builders[name].ranked for name in policies),
            "budget policies cut ranked trees: give them only for ranked builders (dartree, ddtree, heap, ...)")
    require(cost is not None or not policies, "a budget policy needs a cost model")
    require(all(b.proposer is not None for b in builders.values()), "replay is for methods that speculate; ar has tau = 1")
    require(pipe.proposer is not None or all("drafter" not in b.proposer.split("+") for b in builders.values()),
            "replay of a drafter method needs a drafter")
    depths = replay_depths(pipe)
    greedy = enough_greedy(pipe, prompt_ids, max_new_tokens, stop_ids, greedy)
    output = truncate(greedy, max_new_tokens, stop_ids)
    y = greedy[: len(output) + depths + 1]
    full = torch.cat([prompt_ids.reshape(-1), torch.tensor(y, dtype=prompt_ids.dtype, device=prompt_ids.device)])
    pipe.target.capture = True
    _, tapped_states = prefill(pipe.target, full)
    known = KnownTarget(full, tapped_states, pipe.target.tapped_layers)

    lengths: dict[str, list[int]] = {}
    for name, builder in builders.items():
        # the drafter runs as the pipeline's own (its cache reset per request); any other proposer is made for the run
        proposer = pipe.proposer if builder.proposer == "drafter" else make_proposer(builder.proposer, pipe)
        request = Request(prompt_ids, builder, Sampler(0.0), max_new_tokens, set(stop_ids), policy=policies.get(name),
                          proposer=proposer)
        run_alone(known, request)
        require(request.output == output, f"replay of {name} wrote other tokens than the target's greedy ones (internal error)")
        lengths[name] = request.stats.acceptance_lengths
        if timings is not None:
            timings[name] = request.stats.stage_ms.get("tree", 0.0) / 1000.0
        if modeled is not None and cost is not None:
            modeled[name] = cost.rounds_ms(request.stats.tree_sizes, request.stats.drafted)
    return output, lengths
