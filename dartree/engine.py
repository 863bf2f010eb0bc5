"""The round, and the engine that runs it over many requests at once (continuous batching).

One round, for every active request together:

1. **draft** - ONE drafter call for the requests that speculate this round (each with its own
   drafter cache; ``drafter.draft_batch``);
2. **tree** - its method builds its tree (requests of one method built together where the method
   batches, ``trees.build_trees``); where the budget is "auto", one cut across the batch takes
   the prefixes that maximise the batch's expected committed tokens per millisecond of the round's
   forward (``budget.cut_batch``: DARTree's global top-B, taken across requests);
3. **verify** - ONE target forward over the rows of every request: a decoding request's root (its
   bonus token) and tree, a prefilling request's next prompt chunk, each in its own slot of the
   target's K/V store with its own positions and ancestor mask;
4. **commit** - each request walks its tree with its own choices (its own sampler), its slot is
   compacted to the accepted path, and its tokens are handed on; a request ends with a reason
   (``FINISH_STOP``, ``FINISH_LENGTH``, ``FINISH_CANCELLED``, ``FINISH_ERROR``).

``run_alone`` (a single ``generate``, the bench, replay's reference) is the batch of one; the server's engine thread runs
``Engine.step`` with requests joining and leaving between rounds. Because every row of the lean
forward gets the same bits whatever else shares the forward, a request's text at T = 0 is the text it
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
from .drafter import DraftProposer, draft_batch
from .heads import CorrectionHead
from .trees import DraftTree, TreeBuilder, build_trees
from .verify import Sampler, ancestor_matrix, first_ask, walk_steps

# A decoding round's stages, timed per request; a prompt chunk's round counts as "prefill".
ROUND_STAGES = ("draft", "tree", "verify", "commit")
STAGES = ("prefill", *ROUND_STAGES)
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
    stage_ms: dict[str, float] = field(default_factory=dict)
    tree_sizes: list[int] = field(default_factory=list)
    drafted: list[bool] = field(default_factory=list)  # per round: whether the drafter was called (False: a plain step)
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
    proposer: DraftProposer | None = None  # its own drafter cache (methods that draft)
    on_tokens: Callable[[list[int]], None] | None = None  # each round's committed tokens, already truncated
    cancelled: Callable[[], bool] | None = None  # polled before each round: True ends it (FINISH_CANCELLED)
    # state
    slot: int = -1
    output: list[int] = field(default_factory=list)
    prefilled: int = 0  # prompt rows in the target's cache
    bonus: int | None = None  # the next token, chosen but not yet in the target's cache
    pending: list[torch.Tensor] = field(default_factory=list)  # tapped states the drafter has not seen
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
    def uses_drafter(self) -> bool:
        return self.builder.uses_drafter and self.proposer is not None

    @property
    def position(self) -> int:
        """The bonus token's position (the target's committed length of this request)."""
        return self.prompt_ids.numel() + len(self.output) - 1

    def emit(self, tokens: list[int]) -> None:
        if self.on_tokens is not None:
            fresh = truncate(tokens, self.max_new_tokens - len(self.output), self.stop_ids)
            if fresh:
                self.on_tokens(fresh)
        self.output.extend(tokens)
        if self.stop_ids.intersection(tokens):
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
        self.stats.new_tokens = len(self.output)
        self.stats.rounds = len(self.stats.acceptance_lengths)
        if self.decode_start is not None:
            self.stats.decode_seconds = time.perf_counter() - self.decode_start


@dataclass
class Part:
    """One request's rows in a round's forward: tokens, depths (RoPE offsets from the slot's
    committed length) and what each row sees of the request's new rows (boolean [n, n])."""

    slot: int
    tokens: torch.Tensor
    depths: torch.Tensor
    visible: torch.Tensor


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


def _together(group: list[Request], work: Callable[[list[Request]], None]) -> None:
    """``work(group)`` for the requests together (one drafter call, one batch of trees); when it
    fails, each request again alone, so that only the request whose work fails ends (with its
    error) and the others go on."""
    try:
        work(group)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        if len(group) > 1:
            for r in group:
                _together([r], work)
        else:
            group[0].error = exc
            group[0].finish(FINISH_ERROR)


@dataclass
class _Walk:
    """One request's walk in the round's commit (``verify.walk_steps``) and what its commit needs."""

    request: Request
    tree: DraftTree
    part: Part
    hidden: torch.Tensor
    features: torch.Tensor | None
    start: int  # the slot's committed length before the round
    after: list[int]  # each row's choice is of the token at this position
    steps: Generator
    asked: list[int] = field(default_factory=list)  # the rows whose choices it waits for
    result: tuple[list[int], int] | None = None  # accepted rows, next bonus

    def advance(self, choices: list[int] | None) -> bool:
        """Send ``choices`` (None: start); True while it asks for more (``asked``)."""
        try:
            self.asked = next(self.steps) if choices is None else self.steps.send(choices)
            return True
        except StopIteration as done:
            self.result = done.value
            return False


@torch.no_grad()
def run_round(target, requests: list[Request], head: CorrectionHead | None = None, prefill_rows: int | None = None,
              costs: MeasuredCostModel | None = None) -> None:
    """One round over ``requests`` (each holding a slot of ``target``): see the module docstring.
    ``costs``: where given, the round's forward, batched drafter call and tree build are reported to
    it with what its calibration priced them at (the budget then weighs what it measures)."""
    clock = _StageClock(target.device)
    decoding = [r for r in requests if not r.prefilling]
    if prefill_rows is None:
        prefill_rows = target.prefill_chunk if not decoding else PREFILL_ROWS_BESIDE_DECODING

    # This round's prompt chunks: the prefilling requests in order, sharing ``prefill_rows``.
    chunks: dict[int, int] = {}
    left = prefill_rows
    for r in requests:
        if r.prefilling and left > 0:
            chunks[id(r)] = min(left, r.prompt_ids.numel() - r.prefilled)
            left -= chunks[id(r)]

    # 1. one drafter call for the requests that speculate this round (a request's first call, which
    # also takes in its whole prompt, runs alone rather than pad the others to its length).
    prompt_rows = sum(chunks.values())
    speculating = [r for r in decoding if r.uses_drafter and (r.policy is None or r.policy.speculate())]
    planned = [r for r in speculating if r.policy is not None]
    if len(decoding) > 1 and planned:  # in a batch, a drafter call that cannot pay is not even made
        skipped = set()
        for r, drafting in zip(planned, plan_drafting([r.policy for r in planned], len(decoding) + prompt_rows,
                                                      float(len(decoding)), prompt_rows)):
            if not drafting:
                r.policy.skip()
                skipped.add(id(r))
        speculating = [r for r in speculating if id(r) not in skipped]
    continuing = [r for r in speculating if r.drafted]
    drafts: dict[int, object] = {}

    def draft(group: list[Request]) -> None:
        features = [torch.cat(r.pending) if len(r.pending) > 1 else r.pending[0] for r in group]
        if len(group) == 1:  # its proposer's own call (the same code as a batch of one)
            outputs = [group[0].proposer.draft(group[0].bonus, features[0], group[0].position)]
        else:
            outputs = draft_batch([r.proposer for r in group], [r.bonus for r in group], features, [r.position for r in group])
        for r, out in zip(group, outputs):
            r.pending = []
            drafts[id(r)] = out
            if not r.drafted:  # the first draft call also prefills the drafter: not decode time
                r.drafted, r.decode_start = True, time.perf_counter()

    for group in [[r] for r in speculating if not r.drafted]:
        _together(group, draft)
    clock.lap("draft")
    first_calls_ms = clock.laps["draft"]
    if continuing:
        _together(continuing, draft)
    clock.lap("draft")
    if costs is not None and continuing:  # a first call also reads its prompt: not what the model prices
        costs.observe("draft", costs.calibrated_draft(len(continuing)), clock.laps["draft"] - first_calls_ms)
    # 2. each decoding request's method builds its tree (``ar``'s is empty; a drafting method's needs
    # this round's draft: without one, after a back-off or a failed call, the round is a plain step),
    # requests of one method and settings together (``trees.build_trees``), then one cut across the batch.
    trees: dict[int, DraftTree] = {}

    def build(group: list[Request]) -> None:
        sizes = [r.policy.build_size(r.builder.settings.build_size) if r.policy is not None else None for r in group]
        built = build_trees([r.builder for r in group], [drafts.get(id(r)) for r in group], head, sizes)
        trees.update((id(r), tree) for r, tree in zip(group, built))

    building = [r for r in decoding if not r.finished and (not r.uses_drafter or id(r) in drafts)]
    if building:
        _together(building, build)
    clock.lap("tree")
    # The model prices dartree builds under the budget (the trees auto cuts); other methods' builds are not priced.
    priced = [r for r in building if r.policy is not None and id(r) in drafts]
    if costs is not None and priced and len(priced) == len(building):
        costs.observe("tree", costs.calibrated_tree(len(priced)), clock.laps["tree"])
    requests = [r for r in requests if not r.finished]
    decoding = [r for r in decoding if not r.finished]
    ranked = [r for r in decoding if r.policy is not None and id(r) in trees]
    if ranked:
        fixed_rows = len(decoding) + prompt_rows + sum(len(trees[id(r)]) for r in decoding if r.policy is None and id(r) in trees)
        for r, tree in zip(ranked, cut_batch([(r.policy, trees[id(r)]) for r in ranked], fixed_rows, float(len(decoding)), prompt_rows)):
            trees[id(r)] = tree
        clock.lap("tree")

    # 3. one forward over every request's rows.
    parts, plans = [], []
    for r in requests:
        if r.prefilling:
            n = chunks.get(id(r), 0)
            if n == 0:
                continue
            parts.append(Part(r.slot, r.prompt_ids[r.prefilled:r.prefilled + n], torch.arange(n),
                              torch.ones(n, n, dtype=torch.bool).tril()))
            plans.append((r, None))
        else:
            tree = trees.get(id(r), DraftTree.empty(target.device))
            tokens, depths = tree.rows(r.bonus)
            parts.append(Part(r.slot, tokens, depths, ancestor_matrix(tree)))
            plans.append((r, tree))
    if not parts:
        return
    target.capture = bool(target.tapped_layers) and any(r.uses_drafter for r, _ in plans)
    starts = [target.slot_length(p.slot) for p in parts]
    outputs = target.forward_parts(parts)

    # The output layer over the rows each request needs first (a finished prompt's last row; the
    # likely path of a tree), for all requests in one product: its weights are read once.
    asks = []
    for (r, tree), part in zip(plans, parts):
        if tree is None:
            done = r.prefilled + part.tokens.numel() == r.prompt_ids.numel()
            asks.append([part.tokens.numel() - 1] if done else [])
        else:
            asks.append(first_ask(tree))
    gathered = [h[rows] for (h, _), rows in zip(outputs, asks) if rows]
    logits = target.lm_head(torch.cat(gathered)) if gathered else None
    clock.lap("verify")
    if costs is not None:  # the calibration timed this lap of this round (a forward with its first output-layer rows)
        costs.observe("verify", costs.calibrated_verify(sum(p.tokens.numel() for p in parts)), clock.laps["verify"])

    # 4. commit: every decoding request walks its tree with its own choices; the walks run together,
    # so each further ask of the output layer (where the target leaves a likely path) is one product
    # over the rows all requests need, not one pass over the output weights per request.
    offset = 0
    walks: list[_Walk] = []
    for (r, tree), part, (hidden, features), rows, start in zip(plans, parts, outputs, asks, starts):
        first_logits = logits[offset:offset + len(rows)] if rows else None
        offset += len(rows)
        try:
            if tree is None:
                r.prefilled += part.tokens.numel()
                if features is not None:
                    r.pending.append(features)
                if rows:  # the prompt is in: its last row chooses the first token
                    r.bonus = int(r.sampler(first_logits, [r.prompt_ids.numel()])[0])
                    if r.policy is not None:
                        r.policy.start_request()
                    r.emit([r.bonus])
                    if r.decode_start is None:
                        r.decode_start = time.perf_counter()
                continue
            # The choice at a row is the token after it: at the bonus's position + the row's depth + 1.
            after = (r.position + 1 + part.depths).tolist()
            known = dict(zip(rows, r.sampler(first_logits, [after[i] for i in rows]).tolist()))
            walks.append(_Walk(r, tree, part, hidden, features, start, after, walk_steps(tree, known)))
        except Exception as exc:  # noqa: BLE001 - this request ends with its error; the others go on
            r.error = exc
            r.finish(FINISH_ERROR)
    asking = [w for w in walks if w.advance(None)]
    while asking:
        more = target.lm_head(torch.cat([w.hidden[w.asked] for w in asking]))
        at, still = 0, []
        for w in asking:
            rows, at = more[at:at + len(w.asked)], at + len(w.asked)
            try:
                choices = w.request.sampler(rows, [w.after[i] for i in w.asked]).tolist()
            except Exception as exc:  # noqa: BLE001 - this request ends with its error; the others go on
                w.request.error = exc
                w.request.finish(FINISH_ERROR)
                continue
            if w.advance(choices):
                still.append(w)
        asking = still
    for w in walks:
        r = w.request
        if w.result is None:  # its walk failed
            continue
        accepted, next_bonus = w.result
        try:
            keep = torch.tensor(accepted)
            target.keep(r.slot, w.start, keep)
            if r.policy is not None:
                r.policy.observe(w.tree, accepted)
            if w.features is not None:  # rows the drafter has not seen yet (plain steps add up)
                r.pending.append(w.features.index_select(0, keep.to(w.features.device)))
            r.stats.acceptance_lengths.append(len(accepted))
            r.stats.tree_sizes.append(len(w.tree))
            r.stats.drafted.append(id(r) in drafts)
            r.bonus = next_bonus
            r.emit(w.part.tokens[keep[1:]].tolist() + [next_bonus])
        except Exception as exc:  # noqa: BLE001 - this request ends with its error; the others go on
            r.error = exc
            r.finish(FINISH_ERROR)
    clock.lap("commit")
    total = sum(clock.laps.values())
    for r, tree in plans:  # a prompt chunk's round counts as prefill; a decoding round by stage
        laps = {"prefill": total} if tree is None else clock.laps
        for stage, ms in laps.items():
            r.stats.stage_ms[stage] = r.stats.stage_ms.get(stage, 0.0) + ms


class Engine:
    """Requests join and leave between rounds: ``submit`` queues one, ``step`` admits waiting requests
    into free slots (up to ``max_batch``) and runs one round over every active request."""

    def __init__(self, target, head: CorrectionHead | None = None, max_batch: int = 1, costs: MeasuredCostModel | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.target = target
        self.head = head
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
                r.policy.cost = self.costs
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
            run_round(self.target, self.active, self.head, costs=self.costs)
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


def run_alone(target, request: Request, head: CorrectionHead | None = None) -> Request:
    """Run one request to its end as a batch of one (``generate``, the bench, replay's reference);
    its error, if it failed, is raised here."""
    engine = Engine(target, head, max_batch=1)
    engine.submit(request)
    engine.run()
    if request.error is not None:
        raise request.error
    return request
