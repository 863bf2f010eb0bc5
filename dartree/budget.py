"""A budget per round: how much of the ranked draft tree to verify, or whether to speculate at all.

Every prefix of DARTree's ranked top-B list is a valid tree (parents rank before their children).
Node i is accepted exactly when its whole path is, with probability p_i; the expected number of
tokens a round over the best b nodes commits is then 1 + sum_{i<=b} p_i. Two decisions use it:

- **This round's prefix.** When the tree exists, the drafter call and the tree build are already
  paid, so the round takes the b that maximises (1 + sum_{i<=b} p_i) / t_verify(b + 1), the global
  argmax over b = 1..B (the cost curve is a staircase, so a local search could stop on a step), as
  the DSpark planners of vLLM and TensorRT-LLM do on GPUs, or verifies the root alone (b = 0) when
  no prefix beats a plain step's 1 / t_verify(1).
- **Whether the next rounds draft at all.** A drafted round costs t_draft + t_tree + t_verify(b + 1);
  the policy keeps a running mean (exponential, weight ``smoothing``) of each drafted round's expected
  tokens per ms over the plain step's. When it drops below 1, speculation is expected to lose to
  plain target steps: the policy takes plain steps, without a drafter call, and probes speculation
  again after ``probe_every`` steps (doubling after each lost probe, up to ``max_probe_every``).
  A round without a drafter call is not always a plain step: a proposer may offer what costs no
  call (``free_proposals``: the n-gram tree; a grammar's forced run), whose prefix the same choice
  cuts on the tree's own probabilities. A drafted round is worth what it brings beyond that free
  tree (``free_rate``), not beyond a plain step, so text the n-gram proposer or a grammar already
  carries does not keep the drafter running.

A third follows the prefixes chosen, **how deep the next draft reaches** (``draft_depth``): no deeper
than twice the deepest node the recent rounds verified (at least ``min_draft_depth``), so the drafter
runs a shorter block where the budget only ever looks at shallow prefixes.

p_i starts as the drafter's own path probability and is calibrated online, per depth, by what the
target accepted: c_d = (prior + accepted nodes at depth d) / (prior + predicted at depth d), with
older rounds weighted down by ``decay`` per round so that the calibration follows the text being
written (a drafter is far better on code or arithmetic than on chat).

The constants were chosen by simulating policies offline on recorded trees and acceptances of 95
benchmark prompts with measured fp32 and bf16 cost models (docs/results/fast-on-this-machine). Only
what is verified changes, never how: the output stays exactly what the target alone would write.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch

from .costmodel import CostModel
from .trees import DraftTree


@dataclass
class BudgetChoice:
    budget: int  # tree nodes to verify (0: the root alone, a plain step)
    expected_tokens: float  # committed tokens expected from the round
    expected_ms: float  # the verification's time (the round's draft and tree are already paid)
    worth: float = 1.0  # drafting's expected speed this round over plain steps' (< 1: drafting loses)
    probe_scale: float = 1.0  # the plain steps between probes are stretched by this (the batch's throughput over one request's)


@dataclass
class BudgetPolicy:
    cost: CostModel
    max_depth: int = 16
    prior: float = 2.0  # pseudo-count of the calibration: how much evidence it takes to move c_d
    decay: float = 0.95  # weight of the calibration's evidence after each further verified round
    smoothing: float = 0.2  # weight of the newest drafted round in the running value of drafting
    probe_every: int = 4  # plain steps before the first probe of speculation; doubles after each lost probe
    max_probe_every: int = 32  # the most plain steps between two probes
    build_headroom: int = 2  # build up to this many times the largest prefix chosen in recent rounds
    min_build: int = 16  # ... but never fewer nodes than this
    recent_rounds: int = 8  # the rounds that count as recent for the build budget and the draft depth
    min_draft_depth: int = 8  # the draft reaches at least this deep (``draft_depth``)
    predicted: list[float] = field(default_factory=list)  # per depth: decayed sum of p over verified nodes
    accepted: list[float] = field(default_factory=list)  # per depth: decayed count of accepted verified nodes
    value: float = 1.0  # running expected speed of a drafted round over a plain step's (< 1: back off)
    plain_left: int = 0  # plain steps to take before the next probe
    lost_probes: int = 0  # consecutive back-offs without a winning round in between
    probe_scale: float = 1.0  # the last round's stretch of the back-off (``BudgetChoice.probe_scale``)
    start_plain: int = 0  # plain steps a request forked from this policy starts with (the last one ended backed off in a batch)
    start_lost: int = 0  # ... and the lost probes it starts with (how deep in the back-off)
    history: list[int] = field(default_factory=list)  # per round: nodes verified; 0: the root alone; -1: a plain step, no draft
    depth_history: list[int] = field(default_factory=list)  # per drafted round: the deepest node verified (0: none)
    # Running expected tokens a drafted round adds by prefix size (index b: the best b nodes; a running
    # mean of the calibrated trees of the last drafted rounds, weight ``smoothing``): what ``plan_drafting``
    # expects of drafting this request before its drafter call. None: nothing drafted yet.
    expected_gains: list[float] | None = None
    parent: "BudgetPolicy | None" = field(default=None, repr=False, compare=False)  # the policy it was forked from

    def __post_init__(self):
        self.predicted = [0.0] * (self.max_depth + 1)
        self.accepted = [0.0] * (self.max_depth + 1)

    def fork(self) -> "BudgetPolicy":
        """A policy for another request: the same settings and calibration so far, its own state;
        ``hand_back`` returns its calibration when the request ends, so the next requests start from it."""
        other = replace(self, history=[], depth_history=[])
        other.predicted, other.accepted = list(self.predicted), list(self.accepted)
        other.expected_gains = list(self.expected_gains) if self.expected_gains is not None else None
        other.parent = self
        return other

    def hand_back(self) -> None:
        """The calibration this request learnt, for the policy it was forked from (the latest wins),
        and how deep in the back-off the next request starts (as deep as this one ended)."""
        if self.parent is not None:
            self.parent.predicted, self.parent.accepted = list(self.predicted), list(self.accepted)
            if self.expected_gains is not None:
                self.parent.expected_gains = list(self.expected_gains)
            # The next request starts as deep in the back-off as this one ended: where drafting kept losing
            # (the CPU's rows and drafter call cost more than the drafter brings on such text), a new request
            # that probes and loses waits as long as this one would have, instead of probing again after
            # probe_every, 2 x, 4 x ... steps (measured on a Zen 3 guest: five probes a 96-token answer, ~5 %
            # of its time). Alone its first round still probes (its text may suit the drafter; a won probe
            # resets the back-off); after a back-off in a batch, where the regime that made the probes lose
            # (rows no longer nearly free) holds for the next request too, it starts with the plain steps as well.
            if not any(b >= 0 for b in self.history):
                return  # no drafted round (it ended in the wait it started with): what it inherited stays for the next
            backed_off_in_batch = self.lost_probes > 0 and self.probe_scale > 1.0
            self.parent.start_lost = self.lost_probes
            self.parent.start_plain = self._back_off_steps(self.lost_probes - 1) if backed_off_in_batch else 0

    def start_request(self) -> None:
        """A new generation starts as deep in the back-off as the last one ended (``hand_back``): alone with a
        probe at once, in a batch after a back-off as if its first probe had lost; the calibration carries over."""
        # a forked policy from what the last request handed back; the pipeline's own (``generate``: one request
        # after another on one policy) from where its last request left it
        start, lost = (self.parent.start_plain, self.parent.start_lost) if self.parent is not None else (0, self.lost_probes)
        self.value, self.plain_left, self.lost_probes = 1.0, start, lost

    def skip(self) -> None:
        """This round makes no drafter call although the policy would have drafted (``plan_drafting``
        found that drafting cannot pay in this batch); its back-off is untouched."""
        self.history.append(-1)

    def note_gains(self, probs: list[float]) -> None:
        """Fold one drafted round's calibrated node probabilities (rank order) into ``expected_gains``."""
        cum = [0.0]
        for p in probs:
            cum.append(cum[-1] + p)
        if self.expected_gains is None:
            self.expected_gains = cum
            return
        old = self.expected_gains
        n = max(len(old), len(cum))
        # A tree built smaller than before says nothing of its larger prefixes: both curves stay flat past their ends.
        old = old + [old[-1]] * (n - len(old))
        cum = cum + [cum[-1]] * (n - len(cum))
        self.expected_gains = [a + self.smoothing * (b - a) for a, b in zip(old, cum)]

    def _back_off_steps(self, lost_before: int) -> int:
        """Plain steps after a lost probe that followed ``lost_before`` lost ones (stretched in a batch)."""
        return round(self.probe_scale * min(self.probe_every * 2 ** lost_before, self.max_probe_every))

    # ------------------------------------------------------------- decisions
    def speculate(self) -> bool:
        """Whether this round calls the drafter (False: a plain target step, or only a free tree)."""
        if self.plain_left > 0:
            self.plain_left -= 1
            self.history.append(-1)
            return False
        return True

    def round_budget(self, build_budget: int) -> int:
        """How many nodes to build this round (at most ``build_budget``, the settings' ``build_budget``:
        max_budget under budget "auto").

        A ranked tree's top-b prefix is the same whatever budget it was built at (parents rank before
        their children, and a builder stops expanding only where no deeper node can enter its
        top-budget list), so a smaller build changes only which b this round may choose, never the
        tree of a given b. Nodes ranked below any b the policy would pick are wasted work: the
        build is limited to ``build_headroom`` times the largest b chosen in the last
        ``recent_rounds`` drafted rounds (at least ``min_build``; plain steps in between do not
        count, so a probe after them builds what the last drafted rounds needed); a round that
        chooses the limit doubles it for the next. Before any drafted round it is ``build_budget``."""
        recent = [b for b in self.history if b >= 0][-self.recent_rounds:]
        if not recent:
            return build_budget
        return min(build_budget, max(self.min_build, self.build_headroom * max(recent)))

    def draft_depth(self) -> int | None:
        """How deep this round's draft need reach (None: as deep as the drafter goes). The verified
        prefixes of recent rounds show how deep the budget looks: a drafter's deeper rows (its block
        positions, its output layer's rows, the tree's depths) are work no such prefix would verify.
        Like the build budget: ``build_headroom`` times the deepest node verified in the last
        ``recent_rounds`` drafted rounds, at least ``min_draft_depth`` (a round that verifies down to
        the limit doubles it for the next); before any drafted round, None. A block-diffusion drafter
        that runs fewer block positions changes its draft (its block attends within itself), never
        the output: measured on 21 benchmark prompts at 9 of 16 depths, tau 2.53 against 2.52
        (dartree, budget auto, drafted rounds)."""
        recent = self.depth_history[-self.recent_rounds:]
        if not recent:
            return None
        return max(self.min_draft_depth, self.build_headroom * max(recent))

    def calibration(self, depths: torch.Tensor) -> torch.Tensor:
        c = torch.tensor([(self.prior + a) / (self.prior + p) for a, p in zip(self.accepted, self.predicted)],
                         dtype=torch.float64)
        return c[depths.clamp(max=self.max_depth).cpu()]

    def probabilities(self, tree: DraftTree, calibrated: bool = True) -> torch.Tensor:
        """Calibrated acceptance probability of every node (in node order); ``calibrated`` False: the
        tree's own (a tree offered without a drafter call: the n-gram proposer learns its own rates,
        and the calibration by depth learns the drafter's, so it must not scale them again)."""
        p = tree.log_probs.detach().to(torch.float64).cpu().exp()
        return (p * self.calibration(tree.depths) if calibrated else p).clamp(0.0, 1.0)

    def choose(self, tree: DraftTree) -> BudgetChoice:
        """The prefix size b (0..len(tree)) that maximises this round's expected tokens per ms of
        verification, or b = 0 (the root alone) when no prefix beats a plain step."""
        return choose_batch([(self, tree)], fixed_rows=1, base_tokens=1.0)[0]

    def cut(self, tree: DraftTree) -> DraftTree:
        """The tree to verify this round; also decides whether the next rounds draft."""
        return self.apply(tree, self.choose(tree))

    def apply(self, tree: DraftTree, choice: BudgetChoice) -> DraftTree:
        """Verify ``choice.budget`` of ``tree``'s nodes this round, and decide from it whether the next rounds draft."""
        self.value += self.smoothing * (choice.worth - self.value)
        self.probe_scale = choice.probe_scale
        if self.value < 1.0:
            # Back off: a drafter that keeps losing is probed ever less often (each probe costs a
            # drafter call and a tree build); a probe is judged afresh.
            self.plain_left = self._back_off_steps(self.lost_probes)
            self.lost_probes += 1
            self.value = 1.0
        else:
            self.lost_probes = 0
        self.history.append(choice.budget)
        kept = _kept(tree, choice.budget)
        self.depth_history.append(int(kept.depths.max()) if len(kept) else 0)
        return kept

    # ------------------------------------------------------------- learning
    def observe(self, tree: DraftTree, accepted_rows: list[int]) -> None:
        """Update the per-depth calibration with one verified tree (rows: root = 0, node i = i + 1)."""
        if len(tree) == 0 or tree.log_probs is None:
            return
        self.predicted = [x * self.decay for x in self.predicted]
        self.accepted = [x * self.decay for x in self.accepted]
        p = tree.log_probs.detach().to(torch.float64).cpu().exp().tolist()
        on_path = set(accepted_rows[1:])
        for i, (d, pi) in enumerate(zip(tree.depths.tolist(), p)):
            d = min(d, self.max_depth)
            self.predicted[d] += pi
            self.accepted[d] += 1.0 if (i + 1) in on_path else 0.0


def free_rate(policy: BudgetPolicy, tree: DraftTree | None, calibrated: bool = False) -> tuple[float, float]:
    """What a round without a proposer call would have committed from ``tree`` (the n-gram tree and a
    grammar's forced run: ``free_proposals``), alone: the expected tokens beyond the root and the rate
    (tokens per ms) of its best prefix, a plain step's 1 / t(1) where nothing beats it. ``calibrated``:
    its nodes scaled by the drafter's calibration, as the drafted tree that holds them is (so that
    drafting's worth compares the two on one scale)."""
    cost = policy.cost
    best_gain, best_rate = 0.0, 1.0 / cost.verify(1)
    if tree is None or not len(tree) or tree.rank is None:
        return best_gain, best_rate
    gain = 0.0
    for b, p in enumerate(policy.probabilities(tree, calibrated)[tree.rank.cpu()].tolist(), start=1):
        gain += p
        rate = (1.0 + gain) / cost.verify(b + 1)
        if rate > best_rate:
            best_gain, best_rate = gain, rate
    return best_gain, best_rate


def choose_batch(items: list[tuple[BudgetPolicy, DraftTree]], fixed_rows: int, base_tokens: float,
                 prompt_rows: int = 0, drafted: list[bool] | None = None,
                 alternatives: list[DraftTree | None] | None = None) -> list[BudgetChoice]:
    """One budget across a batch (DARTree's global top-B, taken across requests).

    ``items``: each speculating request's policy and ranked tree; ``fixed_rows``: the rows the round's
    forward has anyway (every decoding request's root, prompt chunks, trees of fixed size);
    ``base_tokens``: the tokens the round commits anyway (one per decoding request). The requests'
    nodes are merged best first (each request's in its rank order, so every request keeps a prefix,
    which is a tree), and the round takes the m of them that maximise
    (base_tokens + sum of their p) / t_forward(fixed_rows + m), m = 0 (no speculation) included: as
    the batch grows and rows stop being nearly free, it speculates less. With one request this is
    the single-request choice exactly. ``prompt_rows`` of ``fixed_rows`` are prompt chunks: their
    time is not the decoding requests' (``_decode_ms``), only what the nodes add to that forward is.
    ``drafted[i]`` False: request i's tree came without a proposer call (``free_proposals``, a forced
    run): its prefix is chosen the same way, but it says nothing of what drafting brings (``note_gains``).
    ``alternatives[i]``: what request i would have verified this round without its proposer call (the
    n-gram tree and forced run its drafted tree also holds; None: a plain step): drafting is worth what
    it brings beyond that (``free_rate``), not beyond a plain step."""
    cost = items[0][0].cost
    drafted = drafted if drafted is not None else [True] * len(items)
    alternatives = alternatives if alternatives is not None else [None] * len(items)
    probs = []
    for (policy, tree), was_drafted in zip(items, drafted, strict=True):
        probs.append(policy.probabilities(tree, was_drafted)[tree.rank.cpu()].tolist()
                     if len(tree) and tree.rank is not None else [])
        if probs[-1] and was_drafted:
            policy.note_gains(probs[-1])
    order, gains = _merge_best_first(probs)
    # plain float64 arithmetic: a round's few dozen numbers cost less in Python than as tensors
    gain = [base_tokens + c for c in accumulate(gains, initial=0.0)]  # the order of the sums the tensors used
    ms = [cost.verify(fixed_rows + m) for m in range(len(gains) + 1)]
    decode_ms = _decode_ms(cost, fixed_rows, prompt_rows)
    rates = [g / (decode_ms + t - ms[0]) for g, t in zip(gain, ms)]
    m = rates.index(max(rates))  # the first of equal rates: fewer rows; the cost curve is a staircase
    counts = [0] * len(items)
    for i in order[:m]:
        counts[i] += 1
    # What drafting was worth to each request, as its speed over plain steps'. Alone, the round's whole
    # time is the request's: tokens / (draft + tree + forward) against a plain step's 1 / t(1). In a
    # batch, its shares of the one drafter call, of the trees built together and of the extra rows against the tokens it adds, at the
    # plain batch's rate: a request whose nodes lose the rows (or whose drafter call costs more than its
    # tokens bring) backs off and takes plain steps until its next probe.
    choices = []
    plain_rate = base_tokens / decode_ms
    # A probe holds up the whole batch: its back-off is stretched by the batch's plain throughput
    # over a lone request's (1 alone, so a single request's schedule is unchanged).
    batch = max(int(round(base_tokens)), 1)
    probe_scale = max(1.0, batch * cost.verify(1) / cost.verify(batch))
    extra_ms = ms[m] - ms[0]
    calls = max(sum(drafted), 1)  # the requests that share this round's drafter call and tree builds
    for i, n in enumerate(counts):
        mine = 1.0 + list(accumulate(probs[i][:n]))[-1] if n else 1.0
        free_gain, alone_rate = free_rate(items[i][0], alternatives[i], calibrated=True)
        if len(items) == 1 and fixed_rows == 1:
            worth = mine / cost.round_ms(n) / alone_rate
        else:
            spent = cost.draft_share(calls) + cost.tree_share(calls) + (extra_ms * n / m if m else 0.0)
            worth = (mine - 1.0 - free_gain) / spent / plain_rate if spent > 0 else 1.0
        choices.append(BudgetChoice(n, mine, ms[m], worth, probe_scale))
    return choices


def _merge_best_first(probs: list[list[float]]) -> tuple[list[int], list[float]]:
    """The requests' nodes merged by each request's next node's probability (ties: the earlier request, then
    the earlier rank): whose node each is, and its probability. One request's is its own rank order."""
    if len(probs) == 1:
        return [0] * len(probs[0]), list(probs[0])
    heads = [0] * len(probs)
    order: list[int] = []
    gains: list[float] = []
    while True:
        best = max((i for i in range(len(probs)) if heads[i] < len(probs[i])), key=lambda i: probs[i][heads[i]], default=None)
        if best is None:
            return order, gains
        order.append(best)
        gains.append(probs[best][heads[best]])
        heads[best] += 1


def _decode_ms(cost: CostModel, fixed_rows: int, prompt_rows: int) -> float:
    """What the round's tokens are weighed against: the time of its forward without the prompt
    chunks it also carries. A prompt chunk must be read anyway; charging its time to the decoding
    requests would make a long prefill forward look slow, so that any tokens its extra rows bring,
    at almost no extra time, would seem to pay however costly the drafter call that made them."""
    return cost.verify(max(fixed_rows - prompt_rows, 1))


def cut_batch(items: list[tuple[BudgetPolicy, DraftTree]], fixed_rows: int, base_tokens: float,
              prompt_rows: int = 0, drafted: list[bool] | None = None,
              alternatives: list[DraftTree | None] | None = None) -> list[DraftTree]:
    """Each request's tree to verify this round under ``choose_batch``, with each drafted request's
    policy updated as ``BudgetPolicy.cut`` updates it (``drafted``, ``alternatives``: as ``choose_batch``)."""
    drafted = drafted if drafted is not None else [True] * len(items)
    choices = choose_batch(items, fixed_rows, base_tokens, prompt_rows, drafted, alternatives)
    return [policy.apply(tree, c) if d else _kept(tree, c.budget) for (policy, tree), c, d in zip(items, choices, drafted)]


def _kept(tree: DraftTree, budget: int) -> DraftTree:
    """The ranked tree's best ``budget`` nodes (none: the root alone, a plain step)."""
    return tree.prefix(budget) if budget else DraftTree.empty(tree.tokens.device)


# The most tree nodes a batch's drafting plan considers in all (the calibration times forwards up to 128 rows).
PLAN_MAX_NODES = 128


def _increments(curve: list[float], most: int) -> list[float]:
    """A cumulative expected-gain curve's increments, largest first, at most ``most`` of them (a
    curve's increments fall with rank already, so the sort only guards against rounding)."""
    return sorted((b - a for a, b in zip(curve, curve[1:])), reverse=True)[:most]


def plan_drafting(policies: list[BudgetPolicy], fixed_rows: int, base_tokens: float, prompt_rows: int = 0) -> list[bool]:
    """Before a batch's drafter call: which of the requests about to draft should (True), when
    drafting is priced as ``choose_batch`` prices it but with each request's ``expected_gains`` for
    its tree not yet drawn.

    Drafting k requests costs the round k shares of one batched drafter call and of one batch of
    tree builds, plus the rows their nodes add to a forward of ``fixed_rows``; it commits
    ``base_tokens`` plus their expected gains. The plan takes the k (the requests with the most to
    gain first) and the nodes that maximise expected tokens per ms, k = 0 (no drafter call at all)
    included, so that where rows and drafter calls cost more than the drafter can bring the batch
    does not even probe. A request with nothing drafted yet (no estimate) always drafts: its round
    is what the estimate is made of. The plan costs no drafter call; it is re-made every round, so
    drafting returns as soon as the batch shrinks or a request's expected gains grow."""
    cost = policies[0].cost
    decode_ms = _decode_ms(cost, fixed_rows, prompt_rows)
    known = sorted((i for i, p in enumerate(policies) if p.expected_gains is not None),
                   key=lambda i: policies[i].expected_gains[-1], reverse=True)  # the most to gain first
    unknown = len(policies) - len(known)

    def calls_ms(drafting: int) -> float:  # the shares of one drafter call and one batch of builds
        return drafting * (cost.draft_share(drafting) + cost.tree_share(drafting))

    rates = [base_tokens / (decode_ms + calls_ms(unknown))]  # k = 0: only the requests with no estimate draft
    # First a bound that is cheap to take: every gain at no extra rows. Where even that loses (a
    # batch too large for the drafter's tokens to pay its calls, the usual case), nothing more to weigh.
    total = 0.0
    bound = []
    for k, i in enumerate(known, start=1):
        total += policies[i].expected_gains[-1]
        bound.append((base_tokens + total) / (decode_ms + calls_ms(k + unknown)))
    if max(bound, default=0.0) <= rates[0]:
        return [p.expected_gains is None for p in policies]
    most = min(PLAN_MAX_NODES, sum(len(policies[i].expected_gains) - 1 for i in known))
    verify_ms = [cost.verify(fixed_rows + m) for m in range(most + 1)]
    merged: list[float] = []  # the drafting requests' increments merged best first, as choose_batch merges nodes
    for k, i in enumerate(known, start=1):
        # two descending runs: the sort is a linear merge, so the plan stays O(requests x nodes)
        merged = sorted(merged + _increments(policies[i].expected_gains, most), reverse=True)[:most]
        fixed_ms = decode_ms + calls_ms(k + unknown) - verify_ms[0]
        rates.append(max((base_tokens + g) / (fixed_ms + v) for g, v in zip(accumulate(merged, initial=0.0), verify_ms)))
    best_k = max(range(len(rates)), key=rates.__getitem__)  # the first of equal rates: fewer drafter calls
    chosen = set(known[:best_k])
    return [p.expected_gains is None or i in chosen for i, p in enumerate(policies)]
