"""The two written contracts and the round's reference.

- Every target (``targets/``) implements ``targets.base.Target``; ``prefill`` and ``forward_tree``
  are written once on it and agree across implementations.
- Every proposer (``proposers/``) implements ``proposers.base.Proposer``; a proposer registered from
  this file, with a tree method that reads it, runs through the unchanged round and is lossless.
- ``engine.reference_round`` (one request, straight through) gives ``run_round``'s tokens and stats.
"""

import pytest
import torch
from conftest import synthetic_cost
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dartree
from dartree.engine import Request, run_alone, run_reference
from dartree.proposers import PROPOSERS, Proposer, register
from dartree.settings import GenerationSettings
from dartree.targets import HFTarget, KnownTarget, LeanTarget, Target, forward_tree, prefill
from dartree.trees import DraftTree, TreeBuilder, TreeSettings, available_methods
from dartree.verify import Sampler

METHODS = available_methods(True, True)


@pytest.fixture(scope="module")
def lean_pipe(model_dirs):
    pipe = dartree.load(model_dirs[("llama", "target")], model_dirs[("llama", "domino")], dtype=torch.float32)
    pipe.use_cost_model(synthetic_cost(1.0, 0.05, draft_ms=0.5, tree_ms=0.2))
    return pipe


def test_every_target_implements_the_contract_and_agrees_on_prefill_and_trees(lean_pipe):
    model = lean_pipe.target_model
    hf, lean = HFTarget(model, [0, 1]), LeanTarget(model, [0, 1])
    known = KnownTarget(torch.arange(6), None, [])
    for target in (hf, lean, known):
        assert isinstance(target, Target), type(target).__name__
    assert hf.max_slots == 1 and lean.max_slots is None and lean.row_invariant and not hf.row_invariant
    ids = torch.tensor([3, 1, 4, 1, 5, 2, 6])
    (a, ta), (b, tb) = prefill(hf, ids), prefill(lean, ids)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(tb, ta, rtol=1e-3, atol=1e-3)
    assert hf.slot_length(0) == lean.slot_length(0) == ids.numel()
    tokens, depths = torch.tensor([5, 2, 7]), torch.tensor([0, 1, 1])
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    la, _ = forward_tree(hf, tokens, depths, visible)
    lb, _ = forward_tree(lean, tokens, depths, visible)
    torch.testing.assert_close(lb, la, rtol=1e-4, atol=1e-4)
    for target in (hf, lean):  # keep the root and the second node: the slot holds the prompt + those two rows
        target.keep(0, ids.numel(), torch.tensor([0, 2]))
        assert target.slot_length(0) == ids.numel() + 2


def _spec_settings(method, budget, temperature, seed, max_new_tokens):
    return GenerationSettings.from_kwargs(None, method=method, budget=budget, temperature=temperature, seed=seed,
                                          max_new_tokens=max_new_tokens).validate()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, 7), min_size=1, max_size=12), method=st.sampled_from(METHODS),
       budget=st.sampled_from([3, 12, "auto"]), temperature=st.sampled_from([0.0, 1.0]), seed=st.integers(0, 3),
       max_new_tokens=st.integers(1, 24))
def test_the_reference_round_gives_the_batched_rounds_tokens_and_stats(lean_pipe, prompt, method, budget, temperature,
                                                                       seed, max_new_tokens):
    settings_ = _spec_settings(method, budget, temperature, seed, max_new_tokens)
    ids = torch.tensor(prompt)
    # both made before either runs: each starts from the same budget calibration (a request hands its own back),
    # and the reference as deep in the back-off as the batched one started (that too is handed on)
    batched, reference = (lean_pipe.request(ids, settings_, stop_token_ids=[3], alone=False) for _ in range(2))
    shared = lean_pipe.budget_policy(settings_) if batched.policy is not None else None
    start = (shared.start_plain, shared.start_lost) if shared is not None else None
    run_alone(lean_pipe.target, batched)
    if shared is not None:
        shared.start_plain, shared.start_lost = start
    run_reference(lean_pipe.target, reference)
    assert reference.output == batched.output
    for stat in ("acceptance_lengths", "tree_sizes", "drafted", "finish_reason", "new_tokens", "rounds", "output_rows"):
        assert getattr(reference.stats, stat) == getattr(batched.stats, stat), stat


# ---------------------------------------------------------------- a proposer added from this file alone
@register
class RepeatLastTokens:
    """A toy proposer: a chain of the tokens that followed the last earlier occurrence of the
    bonus token (a one-token prompt lookup), scored log 1/2 per depth."""

    name = "test-repeat"
    reads_tapped_states = False
    head = None
    batch_key = "test-repeat"
    num_depths = 4

    def __init__(self):
        self.seen: list[int] = []
        self.calls = 0

    @classmethod
    def create(cls, pipeline):
        return cls()

    def reset(self):
        self.seen, self.calls = [], 0

    def observe(self, tokens, tapped_states):
        assert tapped_states is None or not self.reads_tapped_states
        self.seen += tokens.tolist()

    @classmethod
    def propose_batch(cls, proposers, bonuses, positions):
        out = []
        for p, bonus, position in zip(proposers, bonuses, positions):
            assert len(p.seen) == position  # it has seen every committed row before the bonus token
            p.calls += 1
            history = p.seen + [bonus]
            at = max((i for i, t in enumerate(history[:-1]) if t == bonus), default=None)
            chain = history[at + 1:at + 1 + cls.num_depths] if at is not None else []
            tree = DraftTree.chain(torch.tensor(chain, dtype=torch.long))
            tree.log_probs = torch.log(torch.tensor(0.5, dtype=torch.float64)) * tree.depths.double()
            tree.rank = torch.arange(len(tree))
            out.append(tree)
        return out


class ProposedTree(TreeBuilder):
    """A method whose tree is the proposer's finished tree (cut to the budget by its ranking)."""

    name = "test-proposed"
    proposer = "test-repeat"
    ranked = True

    def build(self, draft, head, budget):
        return draft.prefix(budget) if budget is not None and len(draft) else draft


def test_a_proposer_registered_in_a_test_file_runs_through_the_round_losslessly(lean_pipe):
    assert PROPOSERS["test-repeat"] is RepeatLastTokens and isinstance(RepeatLastTokens(), Proposer)
    from dartree.proposers import make_proposer

    rng = torch.Generator().manual_seed(0)
    accepted_drafts = 0
    for _ in range(8):
        pattern = torch.randint(8, (int(torch.randint(2, 5, (1,), generator=rng)),), generator=rng)
        prompt = pattern.repeat(4)  # prompts built to repeat, so the lookup has something to propose
        greedy = lean_pipe.generate(input_ids=prompt.tolist(), method="ar", max_new_tokens=24, stop_token_ids=[]).token_ids
        proposer = make_proposer("test-repeat", lean_pipe)
        request = Request(prompt, ProposedTree(TreeSettings(budget=4)), Sampler(0.0), 24, set(), proposer=proposer)
        run_alone(lean_pipe.target, request)
        assert request.output == greedy
        assert proposer.calls == request.stats.rounds and all(request.stats.drafted)
        assert request.stats.tree_sizes and max(request.stats.tree_sizes) <= 4
        accepted_drafts += sum(request.stats.acceptance_lengths) - request.stats.rounds
    assert accepted_drafts > 0  # the proposals were verified and some accepted, not only plain steps
