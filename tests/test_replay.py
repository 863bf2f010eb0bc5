"""Replay gives the decoder's own per-round acceptance lengths at T = 0, without target forwards."""

import pytest
import torch
from conftest import FAMILIES, HEADS, VOCAB, synthetic_cost
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dartree.replay import replay
from dartree.budget import BudgetPolicy
from dartree.errors import DartreeError
from dartree.trees import BUILDERS, TreeSettings, make_builder


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head", HEADS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=7),
    budget=st.sampled_from([1, 3, 8, 16]),
    max_new=st.integers(1, 24),
    stop=st.sampled_from([[], [0], [3, 5]]),
    hand_over=st.booleans(),
)
def test_replay_equals_decoding(pipelines, family, head, prompt, budget, max_new, stop, hand_over):
    pipe = pipelines[(family, head)]
    settings_ = TreeSettings(budget=budget, width=3, tree_top_k=8)
    methods = [m for m in pipe.methods if m != "ar"]
    greedy = None
    if hand_over:  # the bench hands over ar's own (stopped) output; replay extends it itself
        greedy = pipe.generate(input_ids=prompt, method="ar", max_new_tokens=max_new, stop_token_ids=stop).token_ids
    ids = pipe.encode(input_ids=prompt)
    output, lengths = replay(pipe, ids, {m: make_builder(m, settings_) for m in methods}, max_new, set(stop), greedy)
    for m in methods:
        got = pipe.generate(input_ids=prompt, method=m, max_new_tokens=max_new, budget=budget, width=3, tree_top_k=8,
                            stop_token_ids=stop)
        assert output == got.token_ids
        assert lengths[m] == got.stats.acceptance_lengths, m


def test_replay_sees_long_acceptances(pipelines):
    """Equality above means little if every round accepts one token: some rounds here accept more."""
    pipe = pipelines[("llama", "domino")]
    builders = {"dartree": make_builder("dartree", TreeSettings(budget=16))}
    best = max(
        max(replay(pipe, pipe.encode(input_ids=[p, (p + 3) % VOCAB]), builders, 30, set())[1]["dartree"])
        for p in range(VOCAB)
    )
    assert best >= 3


def test_replay_rejects_ar(pipelines):
    pipe = pipelines[("llama", "domino")]
    with pytest.raises(DartreeError, match="methods that speculate"):
        replay(pipe, torch.tensor([1, 2]), {"ar": make_builder("ar")}, 8, set())


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=7), max_new=st.integers(1, 40),
       per_row=st.sampled_from([0.05, 0.4, 3.0]))
def test_replayed_auto_budget_makes_the_decoders_choices(pipelines, family, prompt, max_new, per_row):
    """budget="auto" replayed: the same per-round choices (plain steps included) and acceptance lengths
    as decoding with the same cost model, and the modeled time is what those rounds cost on it."""
    pipe = pipelines[(family, "domino")]
    cost = synthetic_cost(10.0, per_row, draft_ms=2.0, tree_ms=1.0)
    pipe.use_cost_model(cost)  # a fresh policy on this cost model
    got = pipe.generate(input_ids=prompt, method="dartree", max_new_tokens=max_new, budget="auto", width=3, tree_top_k=8)
    decoded = next(iter(pipe._policies.values()))
    builder = make_builder("dartree", TreeSettings(budget="auto", width=3, tree_top_k=8))
    policy, modeled = BudgetPolicy(cost, max_depth=pipe.proposal_depth(builder.proposer)), {}
    output, lengths = replay(pipe, pipe.encode(input_ids=prompt), {"auto": builder}, max_new, set(), cost=cost,
                             policies={"auto": policy}, modeled=modeled)
    assert output == got.token_ids
    assert lengths["auto"] == got.stats.acceptance_lengths
    assert policy.history == decoded.history
    # Each history entry is a round: one without a drafter call (-1) costs a forward over what it verified
    # anyway (the n-gram tree it was offered, if any, + the root); a drafted round the drafter call, the tree
    # build and a forward over the verified nodes + the root.
    assert len(policy.history) == len(got.stats.tree_sizes)
    expected = sum(cost.verify(size + 1) if nodes < 0 else cost.round_ms(size)
                   for nodes, size in zip(policy.history, got.stats.tree_sizes))
    assert modeled["auto"] == pytest.approx(expected)


def test_replayed_auto_budget_covers_both_regimes(pipelines):
    """The equality above means little unless the policy both speculates and takes plain steps."""
    pipe = pipelines[("llama", "domino")]
    builder = make_builder("dartree", TreeSettings(budget="auto", width=3, tree_top_k=8))
    seen = set()
    for per_row, draft_ms in ((0.05, 0.5), (40.0, 5.0)):
        cost = synthetic_cost(10.0, per_row, draft_ms=draft_ms)
        policy = BudgetPolicy(cost, max_depth=pipe.proposal_depth(builder.proposer))
        for p in range(6):
            replay(pipe, pipe.encode(input_ids=[p, (p + 1) % VOCAB]), {"a": builder}, 30, set(), cost=cost, policies={"a": policy})
        seen |= {min(max(h, 0), 1) for h in policy.history}
        if per_row == 0.05:
            assert max(policy.history) > 1  # a cheap verify takes large prefixes
        else:
            assert sum(h <= 0 for h in policy.history) > len(policy.history) / 2  # an expensive one mostly plain steps
    assert seen == {0, 1}


def test_replayed_fixed_budget_models_each_round(pipelines):
    pipe = pipelines[("qwen3", "markov")]
    cost = synthetic_cost(7.0, 1.5, draft_ms=2.0, tree_ms=0.5)
    for prompt in ([1, 2, 3], [5], [7, 4, 4, 6]):
        got = pipe.generate(input_ids=prompt, method="dartree", max_new_tokens=25, budget=8, width=3, tree_top_k=8)
        modeled = {}
        replay(pipe, pipe.encode(input_ids=prompt), {"d": make_builder("dartree", TreeSettings(budget=8, width=3, tree_top_k=8))},
               25, set(), cost=cost, modeled=modeled)
        assert modeled["d"] == pytest.approx(sum(cost.round_ms(n) for n in got.stats.tree_sizes))


def test_replay_policies_need_a_cost_model_and_ranked_trees(pipelines):
    pipe = pipelines[("llama", "domino")]
    ids = torch.tensor([1, 2])
    policy = BudgetPolicy(synthetic_cost(10.0, 1.0))
    with pytest.raises(DartreeError, match="needs a cost model"):
        replay(pipe, ids, {"a": make_builder("dartree", TreeSettings(budget="auto"))}, 8, set(), policies={"a": policy})
    with pytest.raises(DartreeError, match="ranked"):
        replay(pipe, ids, {"a": make_builder("dflash")}, 8, set(), cost=policy.cost, policies={"a": policy})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_batched_greedy_answers_are_the_ones_generated_one_at_a_time(model_dirs, tmp_path, dtype):
    """The held-out evaluation's greedy answers, generated together on the batched engine
    (``GreedyAnswers.prefetch``), are the lists ``enough_greedy`` makes one prompt at a time, on many
    prompts of different lengths, with and without stop tokens hit early, and the file keeps them."""
    import dartree
    from dartree.greedy import GreedyAnswers
    from dartree.replay import enough_greedy
    from dartree.targets.lean import LeanTarget

    pipe = dartree.load(model_dirs[("llama", "target")], model_dirs[("llama", "domino")], dtype=dtype)
    assert isinstance(pipe.target, LeanTarget)  # batched rows, so the engine really runs several at once
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=gen) for n in torch.randint(1, 12, (14,), generator=gen)]
    for stop, new in (({2}, 9), (set(), 13)):
        store = GreedyAnswers(tmp_path / f"greedy-{new}.jsonl", ("i",))
        store.prefetch(pipe, [(p, {"i": i}) for i, p in enumerate(prompts)], new, stop, slots=5)
        single = [enough_greedy(pipe, p, new, stop) for p in prompts]
        assert [store.known[(i,)] for i in range(len(prompts))] == single
        reread = GreedyAnswers(tmp_path / f"greedy-{new}.jsonl", ("i",))
        assert [reread.known[(i,)] for i in range(len(prompts))] == single
        if stop:  # some answers stop early, so the cut after the stop token is exercised
            assert any(len(s) < new + pipe.proposer.num_depths + 1 for s in single)
