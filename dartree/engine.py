"""The round, and the engine that runs it over many requests at once (continuous batching).

``run_round`` is seven plain functions over one ``RoundState`` (a ``Lane`` per request):

1. **plan** - the prompt rows this round runs and which decoding requests speculate (their budget
   policy, and in a batch whether their proposer call can pay: ``budget.plan_drafting``);
2. **propose** - ONE call per kind of proposer for the requests that speculate (``proposers``);
3. **grow** - each method builds its tree from its proposal (requests of one method together,
   ``trees.build_trees``); an ``ar`` request or one that does not speculate gets an empty tree;
4. **cut** - budget "auto": one cut across the batch keeps the prefixes that maximise the batch's
   expected committed tokens per millisecond of the forward (DARTree's global top-B, across requests);
5. **verify** - ONE target forward over every request's rows (a prompt chunk, or the bonus token and
   its tree), each in its own slot (``targets.base.Target``), and the output layer over the rows the
   walks need first;
6. **walk** - each request walks its tree with its own choices (its own sampler; ``verify.walk_steps``);
7. **observe** - the accepted path is committed to the target's slot and shown to the proposer, the
   budget policy learns from it, and the tokens are handed on; a request ends with a reason
   (``FINISH_STOP``, ``FINISH_LENGTH``, ``FINISH_CANCELLED``, ``FINISH_ERROR``).

``reference_round`` is the same round for one request, written straight through: the readable
reference (tests check it gives the batched round's tokens and stats). ``run_alone`` (a single
``generate``, the bench, replay) is the batch of one; the server's engine thread runs
``Engine.step`` with requests joining and leaving between rounds. On a row-invariant target every
row gets the same bits whatever else shares the forward, so a request's text at T = 0 is the text it
gets alone, and at T > 0 its own seeded sampler draws the same samples as alone.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch

from .budget import BudgetPolicy, cut_batch, plan_drafting
from .costmodel import MeasuredCostModel
from .proposers import Proposer
from .structured import Constraint
from .targets.base import Part, Target
from .trees import DraftTree, TreeBuilder, build_trees
from .verify import Sampler, ancestor_matrix, first_ask, walk_steps
from .verify import walk as verify_walk

# A decoding round's stages, timed per request (``GenerationStats.stage_ms``): the proposers' call, the
# tree build and budget cut, the target's forward with its first output-layer rows, the walk (the
# choices, further output-layer rows where the target leaves the likely path), the commit (kept K/V
# rows, the proposers' new states, the budget's calibration). A prompt chunk's round counts as "prefill".
ROUND_STAGES = ("draft", "tree", "verify", "walk", "commit")
FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"
# Prompt rows one round may add while other requests decode: a new request's prefill is chunked so
# that it never holds the others' next token back by more than one such forward. Alone, a request
# prefills in the target's own chunk size.
PREFILL_ROWS_BESIDE_DECODING = 64


@dataclass
class GenerationStats:
    method: str
    new_tokens: int = 0
    rounds: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # per round, bonus included
    decode_seconds: float = 0.0  # after prefill and the first draft call, as in the published harnesses
    stage_ms: dict[str, float] = field(default_factory=dict)  # ms by stage: "prefill" and ROUND_STAGES
    tree_sizes: list[int] = field(default_factory=list)
    drafted: list[bool] = field(default_factory=list)  # per round: whether the proposer was called (False: a plain step or a free tree)
    output_rows: int = 0  # rows of the target's output layer computed (a grammar's one allowed token needs none)
    finish_reason: str | None = None

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
            "output_rows": self.output_rows,
            "finish_reason": self.finish_reason,
        }


def truncate(tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Cut at max_new_tokens, then just after the first stop token."""
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


@dataclass
class Request:
    """One generation: what to do (the prompt, the method, the sampler, the limits), the callbacks,
    and its state while the engine runs it."""

    prompt_ids: torch.Tensor
    builder: TreeBuilder
    sampler: Sampler
    max_new_tokens: int
    stop_ids: set[int]
    policy: BudgetPolicy | None = None  # budget "auto": how much of the ranked tree to verify
    proposer: Proposer | None = None  # its own proposer (its own drafter cache): methods that speculate
    on_tokens: Callable[[list[int]], None] | None = None  # each round's committed tokens, already truncated
    cancelled: Callable[[], bool] | None = None  # polled before each round: True ends it (FINISH_CANCELLED)
    constraint: Constraint | None = None  # structured output: the grammar every committed token follows
    # state
    slot: int = -1
    output: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt rows in the target's cache
    bonus: int | None = None  # the next token, chosen but not yet in the target's cache
    stats: GenerationStats | None = None
    error: BaseException | None = None
    decode_start: float | None = None
    drafted: bool = False

    def __post_init__(self):
        self.prompt_ids = self.prompt_ids.reshape(-1)
        self.stats = GenerationStats(method=self.builder.name)

    @property
    def finished(self) -> bool:
        return self.stats.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self.bonus is None

    @property
    def position(self) -> int:
        """The bonus token's position (the target's committed length of this request)."""
        return self.prompt_ids.numel() + len(self.output) - 1

    def choose(self, logits: torch.Tensor, paths: list[tuple[int, ...]], positions: list[int]) -> torch.Tensor:
        """The target's choices [n] at rows with logits [n, V] choosing the tokens at ``positions``;
        ``paths``: each row's draft tokens after the committed text (its grammar state, where the
        request has a constraint: the tokens it forbids there get probability 0)."""
        if self.constraint is not None:
            logits = self.constraint.mask(logits, paths)
        return self.sampler(logits, positions)

    def choices(self, rows: list[int], decided: dict[int, int], logits: torch.Tensor | None, paths, after) -> list[int]:
        """The choices at ``rows``: ``decided``'s where the grammar makes them, else from ``logits`` (those of the
        other rows, in order), each row choosing the token at ``after[row]`` after its path ``paths[row]``."""
        need = [row for row in rows if row not in decided]
        chosen = {}
        if need:
            row_paths = [paths[i] for i in need] if paths is not None else []
            chosen = dict(zip(need, self.choose(logits, row_paths, [after[i] for i in need]).tolist()))
        return [decided[row] if row in decided else chosen[row] for row in rows]

    def decided(self, rows: list[int], paths) -> dict[int, int]:
        """The rows (of ``rows``, whose draft paths are ``paths[row]``: a list or a dict) where the request's grammar allows one
        token: the target's choice there whatever its logits, so their output-layer rows need not be computed."""
        if self.constraint is None or not rows:
            return {}
        found = self.constraint.decided([paths[row] for row in rows])
        return {row: token for row, token in zip(rows, found) if token is not None}

    def emit(self, tokens: list[int]) -> None:
        # a round may verify past max_new_tokens: what lies beyond (a stop token, the grammar's end) is not written
        tokens = tokens[:self.max_new_tokens - len(self.output)]
        if self.constraint is not None:
            tokens = self.constraint.advance(tokens)
        if self.on_tokens is not None:
            fresh = truncate(tokens, self.max_new_tokens - len(self.output), self.stop_ids)
            if fresh:
                self.on_tokens(fresh)
        self.output.extend(tokens)
        if self.stop_ids.intersection(tokens) or (self.constraint is not None and self.constraint.done):
            self.finish(FINISH_STOP)
        elif len(self.output) >= self.max_new_tokens:
            self.finish(FINISH_LENGTH)

    def finish(self, reason: str) -> None:
        if self.finished:
            return
        self.stats.finish_reason = reason
        if self.policy is not None:
            self.policy.hand_back()
        self.output = truncate(self.output, self.max_new_tokens, self.stop_ids)
        if reason in (FINISH_STOP, FINISH_LENGTH) and hasattr(self.proposer, "finish"):  # a finished answer, shared where asked
            self.proposer.finish(self.prompt_ids.tolist(), self.output)
        self.stats.new_tokens = len(self.output)
        self.stats.rounds = len(self.stats.acceptance_lengths)
        if self.decode_start is not None:
            self.stats.decode_seconds = time.perf_counter() - self.decode_start


class _StageClock:
    """Wall time per stage of a round, charged to every request the round served. On a GPU each lap
    first waits for the queued kernels, or a stage would be charged with the work of the one before."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.mark = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.laps[stage] = self.laps.get(stage, 0.0) + 1000.0 * (now - self.mark)
        self.mark = now


# ---------------------------------------------------------------- the round, stage by stage
@dataclass
class Lane:
    """One request's share of a round: what each stage hands the next."""

    request: Request
    decoding: bool  # False: it is prefilling (its prompt rows run this round)
    prompt_rows: int = 0  # a prefilling request: the prompt rows it runs this round
    speculates: bool = False  # its proposer is called this round
    free: bool = False  # its proposal came without a proposer call (``free_proposals``: budget auto did not pay for one)
    alternative: DraftTree | None = None  # drafted under budget auto: what it would verify without the call
    proposal: object | None = None  # what its proposer gave (a drafter's draft, or a finished tree)
    tree: DraftTree | None = None  # a decoding request's tree (empty: a plain step)
    part: Part | None = None  # its rows in the round's forward
    start: int = 0  # its slot's committed length before the forward
    hidden: torch.Tensor | None = None  # final-normed states of its rows
    tapped_states: torch.Tensor | None = None  # the tapped layers' states of its rows
    walk: Generator | None = None  # ``verify.walk_steps`` of its tree
    asked: list[int] = field(default_factory=list)  # rows whose choices its walk waits for
    paths: list[tuple[int, ...]] | dict[int, tuple[int, ...]] | None = None  # with a constraint: rows' draft tokens (grammar state)
    after: list[int] = field(default_factory=list)  # row i chooses the token at position after[i]
    decided: dict[int, int] = field(default_factory=dict)  # rows whose choice the grammar makes alone (no logits)
    accepted: tuple[list[int], int] | None = None  # the walk's result: accepted rows, next bonus

    @property
    def drafted(self) -> bool:
        """Its proposer was called this round (not a plain step, not only a free tree)."""
        return self.proposal is not None and not self.free

    def fail(self, exc: BaseException) -> None:
        """This request ends with its error; the others go on."""
        self.request.error = exc
        self.request.finish(FINISH_ERROR)


@dataclass
class RoundState:
    target: Target
    lanes: list[Lane]
    prefill_rows: int
    costs: MeasuredCostModel | None
    clock: _StageClock

    def live(self, decoding: bool | None = None) -> list[Lane]:
        return [ln for ln in self.lanes if not ln.request.finished and (decoding is None or ln.decoding == decoding)]

    @property
    def prompt_rows(self) -> int:
        return sum(ln.prompt_rows for ln in self.lanes)


def _together(lanes: list[Lane], work: Callable[[list[Lane]], None]) -> None:
    """``work(lanes)`` for the requests together (one proposer call, one batch of trees); when it
    fails, each request again alone, so that only the request whose work fails ends."""
    try:
        work(lanes)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        if len(lanes) > 1:
            for ln in lanes:
                _together([ln], work)
        else:
            lanes[0].fail(exc)


def plan(state: RoundState) -> None:
    """Which prompt rows run, and which decoding requests speculate: those whose budget policy
    says so, and, in a batch, only those whose proposer call is expected to pay (``plan_drafting``)."""
    left = state.prefill_rows
    for ln in state.lanes:
        r = ln.request
        if r.prefilling and left > 0:
            ln.prompt_rows = min(left, r.prompt_ids.numel() - r.prefilled)
            left -= ln.prompt_rows
    decoding = state.live(decoding=True)
    for ln in decoding:
        ln.speculates = ln.request.proposer is not None and (ln.request.policy is None or ln.request.policy.speculate())
    planned = [ln for ln in decoding if ln.speculates and ln.request.policy is not None]
    if len(decoding) > 1 and planned:
        for ln, drafting in zip(planned, plan_drafting([ln.request.policy for ln in planned], len(decoding) + state.prompt_rows,
                                                       float(len(decoding)), state.prompt_rows)):
            if not drafting:
                ln.request.policy.skip()
                ln.speculates = False


def _propose_group(lanes: list[Lane]) -> None:
    requests = [ln.request for ln in lanes]
    proposals = type(requests[0].proposer).propose_batch([r.proposer for r in requests], [r.bonus for r in requests],
                                                         [r.position for r in requests])
    for ln, proposal in zip(lanes, proposals):
        ln.proposal = proposal
        if not ln.request.drafted:  # the first call also reads the prompt: decode time starts after it
            ln.request.drafted, ln.request.decode_start = True, time.perf_counter()


def propose(state: RoundState) -> None:
    """The proposers' calls: a request's first call alone (it reads its whole prompt; batched, it
    would pad the others to its length), then ONE call per kind of proposer for the rest."""
    speculating = [ln for ln in state.live(decoding=True) if ln.speculates]
    for ln in speculating:
        _limit_depth(ln.request)
    for ln in speculating:
        if not ln.request.drafted:
            _together([ln], _propose_group)
    state.clock.lap("draft")
    first_calls_ms = state.clock.laps.get("draft", 0.0)
    continuing = [ln for ln in speculating if ln.proposal is None and not ln.request.finished]
    for kind in dict.fromkeys(ln.request.proposer.batch_key for ln in continuing):
        _together([ln for ln in continuing if ln.request.proposer.batch_key == kind], _propose_group)
    state.clock.lap("draft")
    if state.costs is not None and continuing:  # the model prices continuing calls, not a first one
        state.costs.observe("draft", state.costs.calibrated_draft(len(continuing)), state.clock.laps["draft"] - first_calls_ms)
    # the rest of budget auto's requests take what their proposers offer without a call (the n-gram tree)
    offering = [ln for ln in state.live(decoding=True) if not ln.speculates and ln.request.policy is not None
                and hasattr(ln.request.proposer, "free_proposals")]
    for kind in dict.fromkeys(ln.request.proposer.batch_key for ln in offering):
        _together([ln for ln in offering if ln.request.proposer.batch_key == kind], _free_group)
    if offering:
        state.clock.lap("draft")


def _limit_depth(r: Request) -> None:
    """The proposer drafts as deep as the request's budget looks (budget "auto"); fixed settings draw every depth."""
    if hasattr(r.proposer, "depth_limit"):
        r.proposer.depth_limit = r.policy.draft_depth() if r.policy is not None else None


def _free_group(lanes: list[Lane]) -> None:
    requests = [ln.request for ln in lanes]
    trees = type(requests[0].proposer).free_proposals([r.proposer for r in requests], [r.bonus for r in requests],
                                                      [r.position for r in requests])
    for ln, tree in zip(lanes, trees):
        if len(tree):  # nothing offered: a plain step, with nothing to cut or walk
            ln.proposal, ln.free = tree, True


def _grow_group(lanes: list[Lane]) -> None:
    requests = [ln.request for ln in lanes]
    budgets = [r.policy.round_budget(r.builder.settings.build_budget) if r.policy is not None else None for r in requests]
    head = getattr(requests[0].proposer, "head", None)
    for ln, tree in zip(lanes, build_trees([r.builder for r in requests], [ln.proposal for ln in lanes], head, budgets)):
        ln.tree = tree


def grow(state: RoundState) -> None:
    """Each decoding request's method builds its tree from its proposal (``ar``'s, or one without a
    proposal this round, is empty: a plain step), requests of one method and settings together."""
    building = [ln for ln in state.live(decoding=True) if ln.request.proposer is None or ln.proposal is not None]
    for ln in building:  # structured output: the draft steered to the grammar where every branch shares its state
        if ln.request.constraint is not None and ln.proposal is not None:
            try:
                ln.proposal = ln.request.constraint.steer(ln.proposal)
            except Exception as exc:  # noqa: BLE001 - this request ends with its error; the others go on
                ln.fail(exc)
    building = [ln for ln in building if not ln.request.finished]
    for ln in building:
        if ln.free:  # a finished ranked tree (built on the CPU): the budget's cut takes its prefix
            ln.tree = ln.proposal.to(state.target.device)
    proposed = [ln for ln in building if not ln.free]
    if proposed:
        _together(proposed, _grow_group)
    # structured output: the grammar prunes the tree and, for a method that speculates (not the plain
    # ``ar`` baseline), adds the tokens it forces
    for ln in state.live(decoding=True):
        if ln.request.constraint is not None:
            try:
                ln.tree = ln.request.constraint.shape(ln.tree if ln.tree is not None else DraftTree.empty(state.target.device),
                                                      force=ln.request.proposer is not None, beta=ln.request.builder.depth_bonus)
            except Exception as exc:  # noqa: BLE001 - this request ends with its error; the others go on
                ln.fail(exc)
    for ln in building:
        if not ln.request.finished:
            try:
                ln.alternative = _alternative(ln.request, ln.proposal, ln.free, state.target.device)
            except Exception as exc:  # noqa: BLE001 - this request ends with its error; the others go on
                ln.fail(exc)
    state.clock.lap("tree")
    priced = [ln for ln in building if ln.request.policy is not None and ln.drafted]
    if state.costs is not None and priced and len(priced) == len(building):  # the model prices budgeted builds
        state.costs.observe("tree", state.costs.calibrated_tree(len(priced)), state.clock.laps["tree"])


def _alternative(r: Request, proposal, free: bool, device: torch.device) -> DraftTree | None:
    """A drafted round's tree without its proposer call (the proposal's ``free_part``, and a grammar's
    forced run), which budget auto weighs drafting against; None where it is a plain step or not needed."""
    if free or proposal is None or r.policy is None:
        return None
    tree = getattr(proposal, "free_part", None)
    if r.constraint is not None:
        tree = r.constraint.shape(tree if tree is not None else DraftTree.empty(device), beta=r.builder.depth_bonus)
    return tree


def cut(state: RoundState) -> None:
    """Budget "auto": one cut across the batch keeps the prefixes of the ranked trees that maximise
    the batch's expected committed tokens per millisecond of the round's forward."""
    decoding = state.live(decoding=True)
    ranked = [ln for ln in decoding if ln.request.policy is not None and ln.tree is not None]
    if not ranked:
        return
    fixed_rows = len(decoding) + state.prompt_rows + sum(len(ln.tree) for ln in decoding
                                                         if ln.request.policy is None and ln.tree is not None)
    trees = cut_batch([(ln.request.policy, ln.tree) for ln in ranked], fixed_rows, float(len(decoding)), state.prompt_rows,
                      [ln.drafted for ln in ranked], [ln.alternative for ln in ranked])
    for ln, tree in zip(ranked, trees):
        ln.tree = tree
    state.clock.lap("tree")


def _rows(state: RoundState, ln: Lane) -> tuple[Part, list[int]]:
    """A lane's rows in the forward and the rows whose choices it needs first: a prompt chunk (its
    last row when the prompt ends there), or the bonus token and tree (the tree's likely path)."""
    r = ln.request
    if r.prefilling:
        part = Part.causal(r.slot, r.prompt_ids[r.prefilled:r.prefilled + ln.prompt_rows])
        return part, [ln.prompt_rows - 1] if r.prefilled + ln.prompt_rows == r.prompt_ids.numel() else []
    ln.tree = ln.tree if ln.tree is not None else DraftTree.empty(state.target.device)
    tokens, depths = ln.tree.rows(r.bonus)
    return Part(r.slot, tokens, depths, ancestor_matrix(ln.tree)), first_ask(ln.tree)


def verify(state: RoundState) -> torch.Tensor | None:
    """ONE target forward over every request's rows, then the output layer over the rows each
    request needs first, for all requests in one product (its weights read once). Returns those logits."""
    target = state.target
    lanes = [ln for ln in state.live() if ln.decoding or ln.prompt_rows]
    if not lanes:
        return None
    for ln in lanes:
        ln.part, ln.asked = _rows(state, ln)
        ln.start = target.slot_length(ln.request.slot)
        if ln.decoding:
            ln.after = (ln.request.position + 1 + ln.part.depths).tolist()  # row i chooses the token after it
            ln.paths = [()] + ln.tree.node_paths() if ln.request.constraint is not None else None
        elif ln.asked and ln.request.constraint is not None:  # the prompt's last row chooses the first token
            ln.paths = {ln.asked[0]: ()}
        try:
            ln.asked = _needs_logits(ln, ln.asked)
        except Exception:  # noqa: BLE001 - its logits are computed; its choice meets the grammar's error and ends it alone
            ln.decided = {}
    target.capture = bool(target.tapped_layers) and any(_reads_tapped_states(ln.request) for ln in lanes)
    for ln, (hidden, tapped) in zip(lanes, target.forward_parts([ln.part for ln in lanes])):
        ln.hidden, ln.tapped_states = hidden, tapped
    logits = _output_layer(target, [ln.hidden[ln.asked] for ln in lanes if ln.asked])
    for ln in lanes:
        ln.request.stats.output_rows += len(ln.asked)
    state.clock.lap("verify")
    if state.costs is not None:  # what the calibration timed: a forward with its first output-layer rows
        state.costs.observe("verify", state.costs.calibrated_verify(sum(ln.part.tokens.numel() for ln in lanes)),
                            state.clock.laps["verify"])
    return logits


def _output_layer(target: Target, states: list[torch.Tensor]) -> torch.Tensor | None:
    """The logits of every request's asked rows in one output-layer product (None where none asks)."""
    if not states:
        return None
    return target.lm_head(states[0] if len(states) == 1 else torch.cat(states))


def _reads_tapped_states(r: Request) -> bool:
    return r.proposer is not None and r.proposer.reads_tapped_states


def _take_prompt(target: Target, ln: Lane, logits: torch.Tensor | None) -> None:
    """A prompt chunk is in the cache: the proposer sees it; its last row chooses the first token."""
    r = ln.request
    n = ln.part.tokens.numel()
    commit(target, ln, list(range(n)))
    r.prefilled += n
    if logits is not None or ln.decided:
        r.bonus = ln.decided[n - 1] if ln.decided else int(r.choose(logits, [()], [r.prompt_ids.numel()])[0])
        if r.policy is not None:
            r.policy.start_request()
        r.emit([r.bonus])
        if r.decode_start is None:
            r.decode_start = time.perf_counter()


def _advance(ln: Lane, choices: list[int] | None) -> bool:
    """Send ``choices`` to the lane's walk (None: start it); True while it asks for more rows."""
    try:
        ln.asked = next(ln.walk) if choices is None else ln.walk.send(choices)
        return True
    except StopIteration as done:
        ln.accepted = done.value
        return False


def _needs_logits(ln: Lane, rows: list[int]) -> list[int]:
    """Of ``rows``, those whose choice needs the target's logits; the others' choices (the grammar's one allowed
    token) go to ``ln.decided``."""
    if ln.paths is None:
        return rows
    ln.decided.update(ln.request.decided(rows, ln.paths))
    return [row for row in rows if row not in ln.decided]


def _choose(ln: Lane, rows: list[int], logits: torch.Tensor | None) -> list[int]:
    """The lane's request's choices at ``rows`` (logits: those of the rows the grammar does not decide, in order)."""
    return ln.request.choices(rows, ln.decided, logits, ln.paths, ln.after)


def walk(state: RoundState, logits: torch.Tensor | None) -> None:
    """Every decoding request walks its tree with its own choices (its own sampler); the walks run
    together, so each further ask of the output layer (where the target leaves a likely path) is one
    product over the rows every request needs. A prompt chunk is taken in."""
    asking, offset = [], 0
    for ln in [ln for ln in state.live() if ln.part is not None]:
        first = logits[offset:offset + len(ln.asked)] if ln.asked else None
        offset += len(ln.asked)
        try:
            if not ln.decoding:
                _take_prompt(state.target, ln, first)
                continue
            known = dict(zip(ln.asked, _choose(ln, ln.asked, first))) if ln.asked else {}
            known.update(ln.decided)
            ln.walk = walk_steps(ln.tree, known)
            if _advance(ln, None):
                asking.append(ln)
        except Exception as exc:  # noqa: BLE001 - this request ends with its error; the others go on
            ln.fail(exc)
    while asking:
        need = []
        for ln in asking:
            try:
                need.append(_needs_logits(ln, ln.asked))
            except Exception as exc:  # noqa: BLE001 - this request ends with its error; the others go on
                ln.fail(exc)
                need.append(None)
        more, at, still = _output_layer(state.target, [ln.hidden[rows] for ln, rows in zip(asking, need) if rows]), 0, []
        for ln, rows in zip(asking, need):
            if rows is None:
                continue
            ln.request.stats.output_rows += len(rows)
            logits_rows, at = (more[at:at + len(rows)] if rows else None), at + len(rows)
            try:
                if _advance(ln, _choose(ln, ln.asked, logits_rows)):
                    still.append(ln)
            except Exception as exc:  # noqa: BLE001 - this request ends with its error; the others go on
                ln.fail(exc)
        asking = still
    state.clock.lap("walk")


def commit(target: Target, ln: Lane, rows: list[int]) -> None:
    """The rows ``rows`` of the lane's part stay in the target's slot (the others are dropped) and
    the request's proposer sees them, with their tapped states."""
    _keep(target, ln.request, ln.start, ln.part.tokens, ln.tapped_states, rows)


def observe(state: RoundState) -> None:
    """Each walked request commits its accepted path, its budget policy learns what was accepted,
    its stats take the round, and its tokens (the accepted drafts and the next bonus) are handed on."""
    for ln in state.live(decoding=True):
        if ln.accepted is None:  # its walk failed
            continue
        r, (accepted, next_bonus) = ln.request, ln.accepted
        try:
            commit(state.target, ln, accepted)
            if r.policy is not None and ln.drafted:  # the calibration learns the drafter's trees
                r.policy.observe(ln.tree, accepted)
            if ln.proposal is not None and hasattr(r.proposer, "learn"):  # a proposer that learns from verification
                r.proposer.learn(ln.tree, accepted)
            r.stats.acceptance_lengths.append(len(accepted))
            r.stats.tree_sizes.append(len(ln.tree))
            r.stats.drafted.append(ln.drafted)
            r.bonus = next_bonus
            r.emit(ln.part.tokens[accepted[1:]].tolist() + [next_bonus])
        except Exception as exc:  # noqa: BLE001 - this request ends with its error; the others go on
            ln.fail(exc)
    state.clock.lap("commit")
    total = sum(state.clock.laps.values())
    for ln in state.lanes:  # a prompt chunk's round counts as prefill; a decoding round by stage
        if ln.part is None:
            continue
        laps = state.clock.laps if ln.decoding else {"prefill": total}
        for stage, ms in laps.items():
            ln.request.stats.stage_ms[stage] = ln.request.stats.stage_ms.get(stage, 0.0) + ms


@torch.no_grad()
def run_round(target: Target, requests: list[Request], prefill_rows: int | None = None,
              costs: MeasuredCostModel | None = None) -> None:
    """One round over ``requests`` (each holding a slot of ``target``): see the module docstring.
    ``costs``: where given, the round's forward, batched proposer call and tree build are reported to
    it with what its calibration priced them at (the budget then weighs what it measures)."""
    if prefill_rows is None:
        prefill_rows = target.prefill_chunk if all(r.prefilling for r in requests) else PREFILL_ROWS_BESIDE_DECODING
    state = RoundState(target, [Lane(r, decoding=not r.prefilling) for r in requests], prefill_rows, costs, _StageClock(target.device))
    plan(state)
    propose(state)
    grow(state)
    cut(state)
    logits = verify(state)
    walk(state, logits)
    observe(state)

class Engine:
    """Requests join and leave between rounds: ``submit`` queues one, ``step`` admits waiting requests
    into free slots (up to ``max_batch``) and runs one round over every active request."""

    def __init__(self, target: Target, max_batch: int = 1, costs: MeasuredCostModel | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.target = target
        self.costs = costs  # where given, every admitted request's budget weighs what the rounds measure
        self.max_batch = target.reserve_slots(max_batch)
        self.free = list(range(self.max_batch))
        self.active: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.rounds = 0
        self.batch_sizes: list[int] = []  # requests per round

    def submit(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def _admit(self) -> list[Request]:
        """Waiting requests into free slots; returns those that ended before their first round."""
        ended = []
        while self.waiting and self.free:
            r = self.waiting.popleft()
            if r.cancelled is not None and r.cancelled():
                r.finish(FINISH_CANCELLED)
            elif r.max_new_tokens < 1:
                r.finish(FINISH_LENGTH)
            if r.finished:
                ended.append(r)
                continue
            r.slot = self.free.pop(0)
            if self.costs is not None and r.policy is not None:
                r.policy.cost = self.costs.for_proposer(r.proposer.name if r.proposer is not None else None)
            self.target.reset_slot(r.slot)
            if r.proposer is not None:
                r.proposer.reset()
            self.active.append(r)
        return ended

    def step(self) -> list[Request]:
        """One round; returns the requests that finished in it (their slots are free again)."""
        for r in self.active:
            if r.cancelled is not None and r.cancelled():
                r.finish(FINISH_CANCELLED)
        done = self._release()
        done += self._admit()
        if self.active:
            self.batch_sizes.append(len(self.active))
            self.rounds += 1
            run_round(self.target, self.active, costs=self.costs)
        return done + self._release()

    def _release(self) -> list[Request]:
        done = [r for r in self.active if r.finished]
        for r in done:
            self.free.append(r.slot)
        self.free.sort()
        self.active = [r for r in self.active if not r.finished]
        return done

    def abort(self, error: BaseException) -> list[Request]:
        """End every active request with ``error`` (a round failed as a whole) and free their slots."""
        for r in self.active:
            r.error = error
            r.finish(FINISH_ERROR)
        return self._release()

    def run(self) -> None:
        while self.busy:
            self.step()


def run_alone(target: Target, request: Request) -> Request:
    """Run one request to its end as a batch of one (``generate``, the bench, replay's reference);
    its error, if it failed, is raised here."""
    engine = Engine(target, max_batch=1)
    engine.submit(request)
    engine.run()
    if request.error is not None:
        raise request.error
    return request


# ---------------------------------------------------------------- the same round, one request, straight through
@torch.no_grad()
def reference_round(target: Target, r: Request) -> None:
    """One round of one request, written top to bottom: the readable reference of ``run_round``
    (tests check that both give the same tokens and stats)."""
    start = target.slot_length(r.slot)
    target.capture = bool(target.tapped_layers) and _reads_tapped_states(r)
    if r.prefilling:  # the next prompt chunk; its last row, at the prompt's end, chooses the first token
        tokens = r.prompt_ids[r.prefilled:r.prefilled + target.prefill_chunk]
        ((hidden, tapped),) = target.forward_parts([Part.causal(r.slot, tokens)])
        _keep(target, r, start, tokens, tapped, list(range(tokens.numel())))
        r.prefilled += tokens.numel()
        if r.prefilled == r.prompt_ids.numel():
            decided = r.decided([0], {0: ()})  # as ``verify``: the grammar's only first token needs no output row
            r.stats.output_rows += 0 if decided else 1
            r.bonus = decided[0] if decided else int(r.choose(target.lm_head(hidden[-1:]), [()], [r.prompt_ids.numel()])[0])
            if r.policy is not None:
                r.policy.start_request()
            r.emit([r.bonus])
            r.decode_start = r.decode_start or time.perf_counter()
        return
    proposal, free, tree = None, False, DraftTree.empty(target.device)
    if r.proposer is not None and (r.policy is None or r.policy.speculate()):
        _limit_depth(r)  # as ``propose``
        (proposal,) = type(r.proposer).propose_batch([r.proposer], [r.bonus], [r.position])
        if not r.drafted:
            r.drafted, r.decode_start = True, time.perf_counter()
    elif r.policy is not None and hasattr(r.proposer, "free_proposals"):  # as ``propose``: what comes without a call
        (offered,) = type(r.proposer).free_proposals([r.proposer], [r.bonus], [r.position])
        proposal, free = (offered, True) if len(offered) else (None, False)
    built = r.proposer is None or proposal is not None
    if free:
        tree = proposal.to(target.device)
    elif built:
        if r.constraint is not None and proposal is not None:  # as ``grow``: the draft steered to the grammar
            proposal = r.constraint.steer(proposal)
        budget = r.policy.round_budget(r.builder.settings.build_budget) if r.policy is not None else None
        (tree,) = build_trees([r.builder], [proposal], getattr(r.proposer, "head", None), [budget])
    if r.constraint is not None:  # as ``grow``: pruned, and the forced run added
        tree = r.constraint.shape(tree, force=r.proposer is not None, beta=r.builder.depth_bonus)
    drafted = proposal is not None and not free  # as ``Lane.drafted``
    if r.policy is not None and (built or r.constraint is not None):
        (tree,) = cut_batch([(r.policy, tree)], 1, 1.0, 0, [drafted], [_alternative(r, proposal, free, target.device)])
    tokens, depths = tree.rows(r.bonus)
    ((hidden, tapped),) = target.forward_parts([Part(r.slot, tokens, depths, ancestor_matrix(tree))])
    after = (r.position + 1 + depths).tolist()
    paths = [()] + tree.node_paths()

    def choose(rows: list[int]) -> list[int]:  # as ``walk``: no output-layer row where the grammar allows one token
        decided = r.decided(rows, paths)
        need = [i for i in rows if i not in decided]
        r.stats.output_rows += len(need)
        return r.choices(rows, decided, target.lm_head(hidden[need]) if need else None, paths, after)

    accepted, bonus = verify_walk(tree, choose)
    _keep(target, r, start, tokens, tapped, accepted)
    if r.policy is not None and drafted:
        r.policy.observe(tree, accepted)
    if proposal is not None and hasattr(r.proposer, "learn"):
        r.proposer.learn(tree, accepted)
    r.stats.acceptance_lengths.append(len(accepted))
    r.stats.tree_sizes.append(len(tree))
    r.stats.drafted.append(drafted)
    r.bonus = bonus
    r.emit(tokens[accepted[1:]].tolist() + [bonus])


def _keep(target: Target, r: Request, start: int, tokens: torch.Tensor, tapped: torch.Tensor | None, rows: list[int]) -> None:
    keep = torch.tensor(rows, dtype=torch.long, device=tokens.device)
    target.keep(r.slot, start, keep)
    if r.proposer is not None:
        r.proposer.observe(tokens[keep], None if tapped is None else tapped.index_select(0, keep.to(tapped.device)))


def run_reference(target: Target, request: Request) -> Request:
    """``run_alone`` on ``reference_round``: one request to its end in slot 0."""
    target.reserve_slots(1)
    request.slot = 0
    target.reset_slot(0)
    if request.proposer is not None:
        request.proposer.reset()
    if request.max_new_tokens < 1:
        request.finish(FINISH_LENGTH)
    while not request.finished:
        reference_round(target, request)
    return request
