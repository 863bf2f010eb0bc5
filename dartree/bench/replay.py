"""Exact acceptance-length replay at temperature 0.

At T = 0 every method writes the target's greedy sequence y, so the acceptance length of a round
depends only on the tree the method builds there and on y: walking the tree with the target's
choices is walking it with y. Replay therefore needs no target forward per round:

1. one greedy ``ar`` run gives y, extended past its stop token by one draft block (a last round
   may accept nodes beyond the stop, and the real decoder counts them);
2. one teacher-forced target forward over prompt + y gives the drafter's context features at every
   position (the real decoder gets the same rows from its tree forwards, up to float rounding);
3. every method replays its rounds in lockstep on the shared drafter calls: the draft at position
   s is computed once and handed to each method whose round starts at s.

This measures tau for many methods and budgets at a fraction of the cost of decoding each one
(the tests check it equals the decoder's per-round acceptance lengths); wall-clock speedups still
come from real decoding (``dartree bench``).

With a cost model (``dartree calibrate``), replay also adds up what each round would cost on that
machine (drafter call + tree build + a target forward over the tree's rows; a plain step is a
one-row forward) and runs ``budget="auto"``: its policy (``dartree.budget``) sees the same trees and
acceptances as in decoding, so its choices, and the modeled speedup over ``ar``, come without a
single timed decode. The modeled speedup is a prediction from the cost model, not a measurement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..budget import BudgetPolicy
from ..costmodel import CostModel
from ..engine import Request, run_alone, truncate
from ..errors import require
from ..trees import TreeBuilder, make_builder
from ..verify import Sampler, follow_tree


@dataclass
class _Progress:
    builder: TreeBuilder
    next_index: int = 0  # index into y of the next round's bonus token: the output so far is y[: next_index + 1]
    done: bool = False
    acceptance_lengths: list[int] = field(default_factory=list)
    tree_seconds: float = 0.0
    policy: BudgetPolicy | None = None  # budget "auto": cuts each ranked tree, or takes plain steps
    modeled_ms: float = 0.0  # the rounds' cost on the cost model

    def advance(self, y: list[int], i: int, length: int, stop_ids: set[int], max_new_tokens: int) -> None:
        """Commit a round that started at y[i] and accepted ``length`` rows (bonus included)."""
        new_tokens = y[i + 1 : i + length + 1]
        self.acceptance_lengths.append(length)
        self.next_index = i + length
        # The decoder's stop rules: a stop token in the round's tokens, or enough tokens.
        self.done = bool(stop_ids.intersection(new_tokens)) or self.next_index + 1 >= max_new_tokens


@torch.no_grad()
def greedy_continuation(pipe, prompt_ids: torch.Tensor, length: int, stop_ids: set[int] = frozenset()) -> list[int]:
    """The target's greedy tokens after the prompt: ``length`` of them, or up to a stop token."""
    return run_alone(pipe.target, Request(prompt_ids, make_builder("ar"), Sampler(0.0), length, set(stop_ids))).output


def enough_greedy(pipe, prompt_ids: torch.Tensor, max_new_tokens: int, stop_ids: set[int], greedy: list[int] | None = None) -> list[int]:
    """The target's greedy tokens, long enough to replay any method: the decoder's output plus
    D + 1 tokens, since a last round looks that far past its bonus. ``greedy`` (for instance
    ``ar``'s output, which ends at a stop token) is extended rather than recomputed."""
    depths = pipe.proposer.num_depths
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
    require(pipe.proposer is not None, "replay needs a drafter")
    policies = policies or {}
    require(all(name in builders and builders[name].ranked for name in policies),
            "budget policies cut ranked trees: give them only for ranked builders (dartree, ddtree, heap, ...)")
    require(cost is not None or not policies, "a budget policy needs a cost model")
    require(all(b.uses_drafter for b in builders.values()), "replay is for drafter methods; ar has tau = 1")
    depths = pipe.proposer.num_depths
    greedy = enough_greedy(pipe, prompt_ids, max_new_tokens, stop_ids, greedy)
    output = truncate(greedy, max_new_tokens, stop_ids)
    y = greedy[: len(output) + depths + 1]
    prompt_len = prompt_ids.numel()

    target = pipe.target
    target.capture = True
    full = torch.cat([prompt_ids, torch.tensor(y, dtype=prompt_ids.dtype, device=prompt_ids.device)])
    _, features = target.prefill(full)
    choices = torch.tensor(y[1:] + [y[-1]], device=prompt_ids.device)  # the target's choice after y[i]

    runs = {name: _Progress(builder, policy=policies.get(name)) for name, builder in builders.items()}
    for run in runs.values():
        run.done = y[0] in stop_ids or max_new_tokens <= 1
        if run.policy is not None:
            run.policy.start_request()
    pipe.proposer.reset()
    cached = 0
    for i in range(len(output)):
        waiting = [r for r in runs.values() if not r.done and r.next_index == i]
        if not any(not r.done for r in runs.values()):
            break
        drafting = []
        for run in waiting:
            if run.policy is None or run.policy.speculate():
                drafting.append(run)
            else:  # a plain target step: the bonus token alone
                run.modeled_ms += cost.verify(1)
                run.advance(y, i, 1, stop_ids, max_new_tokens)
        if not drafting:
            continue
        start = prompt_len + i
        draft = pipe.proposer.draft(y[i], features[cached:start], start)
        cached = start
        for run in drafting:
            started = time.perf_counter()
            tree = run.builder.build_tree(draft, pipe.head) if run.policy is None else run.policy.round_tree(run.builder, draft, pipe.head)
            run.tree_seconds += time.perf_counter() - started
            _, row_depths = tree.rows(y[i])
            accepted, _ = follow_tree(tree, choices[i + row_depths])  # the target's choice at row r is y[i + depth(r) + 1]
            if run.policy is not None:
                run.policy.observe(tree, accepted)
            if cost is not None:
                run.modeled_ms += cost.round_ms(len(tree))
            run.advance(y, i, len(accepted), stop_ids, max_new_tokens)
    if timings is not None:
        timings.update({name: run.tree_seconds for name, run in runs.items()})
    if modeled is not None:
        modeled.update({name: run.modeled_ms for name, run in runs.items()})
    return output, {name: run.acceptance_lengths for name, run in runs.items()}
