"""A budget per round: how much of the ranked draft tree to verify, or whether to speculate at all.

Every prefix of DARTree's ranked top-B list is a valid tree (parents rank before their children).
Node i is accepted exactly when its whole path is, with probability p_i; the expected number of
tokens a round over the best b nodes commits is then 1 + sum_{i<=b} p_i, and it costs
t_draft + t_tree + t_verify(b + 1) on this machine (``CostModel``). The policy takes the b that
maximises committed tokens per second, the global argmax over b = 1..B (the cost curve is a
staircase, so a local search could stop on a step), as the DSpark planners of vLLM and TensorRT-LLM
do on GPUs.

p_i starts as the drafter's own path probability and is calibrated online, per depth, by what the
target actually accepted: c_d = (prior + accepted nodes at depth d) / (prior + predicted at depth d).

When even the best b is expected to lose to a plain target step (1 / t_verify(1) tokens per ms),
the policy takes plain steps, without a drafter call, and probes speculation again after
``probe_every`` steps (doubling after each lost probe, up to ``max_probe_every``) so that the
calibration can notice a drafter that starts to do well. Only what
is verified changes, never how: the output stays exactly what the target alone would write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .costmodel import CostModel
from .trees import DraftTree


@dataclass
class BudgetChoice:
    nodes: int  # tree nodes to verify (0: a plain step)
    expected_tokens: float  # committed tokens expected from the round
    expected_ms: float


@dataclass
class AdaptiveBudget:
    cost: CostModel
    max_depth: int = 16
    prior: float = 2.0  # pseudo-count of the calibration: how much evidence it takes to move c_d
    probe_every: int = 16  # plain steps before the first probe of speculation; doubles after each lost probe
    max_probe_every: int = 256  # the most plain steps between two probes
    predicted: list[float] = field(default_factory=list)  # per depth: sum of p over verified nodes
    accepted: list[float] = field(default_factory=list)  # per depth: accepted verified nodes
    plain_left: int = 0  # plain steps to take before the next probe
    lost_probes: int = 0  # consecutive rounds that chose plain steps (probes that lost)
    history: list[int] = field(default_factory=list)  # nodes verified per round (0 = plain step)

    def __post_init__(self):
        self.predicted = [0.0] * (self.max_depth + 1)
        self.accepted = [0.0] * (self.max_depth + 1)

    # ------------------------------------------------------------- decisions
    def speculate(self) -> bool:
        """Whether this round drafts at all (False: a plain target step)."""
        if self.plain_left > 0:
            self.plain_left -= 1
            self.history.append(0)
            return False
        return True

    def calibration(self, depths: torch.Tensor) -> torch.Tensor:
        c = torch.tensor([(self.prior + a) / (self.prior + p) for a, p in zip(self.accepted, self.predicted)],
                         dtype=torch.float64)
        return c[depths.clamp(max=self.max_depth).cpu()]

    def probabilities(self, tree: DraftTree) -> torch.Tensor:
        """Calibrated acceptance probability of every node (in node order)."""
        p = tree.log_probs.detach().to(torch.float64).cpu().exp()
        return (p * self.calibration(tree.depths)).clamp(0.0, 1.0)

    def choose(self, tree: DraftTree) -> BudgetChoice:
        """The prefix size b (0..len(tree)) that maximises expected tokens per ms, or b = 0 with a
        plain step when no b beats one."""
        plain = BudgetChoice(0, 1.0, self.cost.verify(1))
        if len(tree) == 0 or tree.rank is None:
            return plain
        p = self.probabilities(tree)[tree.rank.cpu()]
        gains = 1.0 + torch.cumsum(p, 0)
        sizes = torch.arange(1, len(tree) + 1)
        ms = torch.tensor([self.cost.round_ms(int(b)) for b in sizes], dtype=torch.float64)
        rates = gains / ms
        best = int(torch.argmax(rates))  # the global argmax: the cost curve is a staircase
        spec = BudgetChoice(int(sizes[best]), float(gains[best]), float(ms[best]))
        # The draft is already paid for this round; the choice between speculating and plain steps
        # is made on whole rounds, which is what the next rounds will cost.
        return spec if spec.expected_tokens / spec.expected_ms > 1.0 / plain.expected_ms else plain

    def cut(self, tree: DraftTree) -> DraftTree:
        """The tree to verify this round. When speculation is expected to lose, the round verifies the
        root alone (this round's draft is spent) and the next ``probe_every`` rounds are plain steps."""
        choice = self.choose(tree)
        if choice.nodes == 0:
            # Back off: a drafter that keeps losing is probed ever less often (each probe costs a
            # drafter call and a tree build for one token).
            self.plain_left = min(self.probe_every * 2 ** self.lost_probes, self.max_probe_every)
            self.lost_probes += 1
            self.history.append(0)
            return DraftTree.empty(tree.tokens.device)
        self.lost_probes = 0
        self.history.append(choice.nodes)
        return tree.prefix(choice.nodes)

    # ------------------------------------------------------------- learning
    def observe(self, tree: DraftTree, accepted_rows: list[int]) -> None:
        """Update the per-depth calibration with one verified tree (rows: root = 0, node i = i + 1)."""
        if len(tree) == 0 or tree.log_probs is None:
            return
        p = tree.log_probs.detach().to(torch.float64).cpu().exp().tolist()
        on_path = set(accepted_rows[1:])
        for i, (d, pi) in enumerate(zip(tree.depths.tolist(), p)):
            d = min(d, self.max_depth)
            self.predicted[d] += pi
            self.accepted[d] += 1.0 if (i + 1) in on_path else 0.0
