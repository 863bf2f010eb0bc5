"""The per-round budget: ranked prefixes, the choice on synthetic cost models, losslessness."""

import pytest
import torch
from conftest import FAMILIES, VOCAB, hf_greedy, synthetic_cost
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dartree
from dartree.budget import BudgetPolicy
from dartree.costmodel import CostModel
from dartree.drafter import DraftOutput
from dartree.settings import GenerationSettings
from dartree.heads import DominoHead
from dartree.trees import DraftTree, TreeSettings, make_builder


def ranked_tree(probs: list[float]) -> DraftTree:
    """A chain whose node i is accepted with probability probs[i] (already a path probability)."""
    tree = DraftTree.chain(torch.arange(len(probs)))
    tree.log_probs = torch.tensor(probs, dtype=torch.float64).log()
    tree.rank = torch.arange(len(probs))
    return tree


def random_draft(seed, depths=6, vocab=40, hidden=16):
    g = torch.Generator().manual_seed(seed)
    head = DominoHead(hidden, 12, 8, vocab, pure_prefix=1)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    embed = torch.nn.Embedding(vocab, hidden)
    head.bind(embed)
    draft = DraftOutput(bonus=1, hidden=torch.randn(depths, hidden, generator=g), base_logits=3 * torch.randn(depths, vocab, generator=g))
    return draft, head


def test_cost_model_interpolates_and_extrapolates():
    cost = synthetic_cost(10.0, 1.0)
    assert cost.verify(1) == 10.0 and cost.verify(3) == 12.0 and cost.verify(100) == pytest.approx(109.0)
    assert cost.verify(200) == pytest.approx(209.0)
    assert CostModel.from_json(cost.to_json()).verify_ms == cost.verify_ms


def test_a_cheap_verify_takes_a_large_budget_and_an_expensive_one_a_small_one():
    tree = ranked_tree([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2] + [0.1] * 24)
    cheap = BudgetPolicy(synthetic_cost(10.0, 0.01))  # a GPU-like staircase: extra rows are nearly free
    assert cheap.choose(tree).budget == len(tree)
    middling = BudgetPolicy(synthetic_cost(10.0, 2.0))
    chosen = middling.choose(tree).budget
    assert 1 <= chosen < 12
    # the choice is the global argmax of expected tokens per ms over every prefix
    rates = [(1 + sum([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2][:b] + [0.1] * max(0, b - 8))) / (10.0 + 2.0 * b)
             for b in range(1, len(tree) + 1)]
    assert chosen == 1 + max(range(len(rates)), key=rates.__getitem__)


def test_the_build_covers_every_prefix_the_policy_chose_lately_and_grows_when_it_binds():
    """A round builds max_budget nodes until the policy has chosen; then twice the largest choice
    of the recent drafted rounds (at least min_build), doubling while the choice reaches the limit;
    plain steps in between leave it as the drafted rounds set it."""
    policy = BudgetPolicy(synthetic_cost(10.0, 0.01), min_build=4)  # a cheap verify takes every node
    assert policy.round_budget(64) == 64
    budgets = []
    for _ in range(6):
        budget = policy.round_budget(64)
        budgets.append(budget)
        policy.cut(ranked_tree([0.9] * budget))  # chooses the whole tree it was given
    assert budgets == [64, 64, 64, 64, 64, 64]
    policy = BudgetPolicy(synthetic_cost(10.0, 2.0), min_build=4)  # takes 3 of these nodes
    tree = ranked_tree([0.9, 0.8, 0.5, 0.1, 0.05, 0.01] * 2)
    policy.cut(tree)
    assert policy.history == [3] and policy.round_budget(64) == 6 and policy.round_budget(5) == 5
    policy.history += [-1] * 3 * policy.recent_rounds  # plain steps since
    assert policy.round_budget(64) == 6
    policy.history += [0] * policy.recent_rounds  # drafted rounds that verified the root alone
    assert policy.round_budget(64) == 4
    grow = BudgetPolicy(synthetic_cost(10.0, 0.01), min_build=4)
    grow.history = [4]
    assert grow.round_budget(64) == 8
    grow.cut(ranked_tree([0.9] * 8))
    assert grow.round_budget(64) == 16


def test_an_expensive_verify_or_a_hopeless_draft_takes_plain_steps():
    tree = ranked_tree([0.9, 0.8, 0.7])
    assert BudgetPolicy(synthetic_cost(10.0, 20.0)).choose(tree).budget == 0
    assert BudgetPolicy(synthetic_cost(10.0, 0.5)).choose(ranked_tree([0.01, 0.001])).budget == 0


def test_a_drawn_tree_is_used_but_a_costly_drafter_stops_the_drafting():
    # The round's draft is already paid: with a cheap verify its tree is worth verifying ...
    policy = BudgetPolicy(synthetic_cost(10.0, 0.1, draft_ms=30.0), probe_every=5)
    tree = ranked_tree([0.9, 0.8, 0.7])
    assert policy.choose(tree).budget == 3
    # ... but a whole round (30 ms of drafting + ~10 ms of verify for 3.4 tokens) loses to plain steps
    # (3.4 tokens in 40 ms against 4 in 40 ms), so the next rounds do not draft.
    assert len(policy.cut(tree)) == 3
    assert [policy.speculate() for _ in range(6)] == [False] * 5 + [True]
    # The same drafter at 1 ms a call pays for itself: drafting goes on round after round.
    cheap = BudgetPolicy(synthetic_cost(10.0, 0.1, draft_ms=1.0), probe_every=5)
    for _ in range(10):
        assert cheap.speculate() and len(cheap.cut(tree)) == 3


def test_plain_steps_then_probes_that_back_off():
    policy = BudgetPolicy(synthetic_cost(10.0, 20.0, draft_ms=1.0), probe_every=3, max_probe_every=8)
    assert len(policy.cut(ranked_tree([0.9, 0.8]))) == 0  # speculation loses: verify the root alone
    assert [policy.speculate() for _ in range(4)] == [False] * 3 + [True]  # then 3 plain steps, then a probe
    assert len(policy.cut(ranked_tree([0.9, 0.8]))) == 0  # the probe loses again: twice as many plain steps
    assert [policy.speculate() for _ in range(7)] == [False] * 6 + [True]
    policy.cut(ranked_tree([0.9, 0.8]))
    assert [policy.speculate() for _ in range(9)] == [False] * 8 + [True]  # capped at max_probe_every
    policy.cost = synthetic_cost(10.0, 0.1, draft_ms=1.0)  # now speculation pays: the back-off resets
    assert len(policy.cut(ranked_tree([0.9, 0.8]))) > 0 and policy.lost_probes == 0
    # A new request starts drafting at once; what the calibration learnt carries over.
    policy.cost = synthetic_cost(10.0, 20.0, draft_ms=1.0)
    policy.cut(ranked_tree([0.9, 0.8]))
    learnt = list(policy.predicted)
    policy.start_request()
    assert policy.speculate() and policy.predicted == learnt


def test_calibration_learns_from_acceptances_and_follows_the_text():
    policy = BudgetPolicy(synthetic_cost(10.0, 1.0), prior=1.0)
    tree = ranked_tree([0.5, 0.25])
    for _ in range(40):
        policy.observe(tree, [0])  # nothing is ever accepted
    assert policy.probabilities(tree).max() < 0.1
    for _ in range(200):
        policy.observe(tree, [0, 1, 2])  # everything is
    assert policy.probabilities(tree).min() > 0.85
    # Old evidence fades: 60 rounds of rejections after 200 of acceptances bring the estimate down.
    for _ in range(60):
        policy.observe(tree, [0])
    assert policy.probabilities(tree).max() < 0.1
    frozen = BudgetPolicy(synthetic_cost(10.0, 1.0), prior=1.0, decay=1.0)  # no fading: 200 rounds outweigh 60
    for accepted in ([0, 1, 2],) * 200 + ([0],) * 60:
        frozen.observe(tree, accepted)
    assert frozen.probabilities(tree).min() > 0.5


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 40), method=st.sampled_from(["dartree", "ddtree", "heap"]))
def test_every_prefix_of_a_ranked_tree_is_the_tree_of_that_budget(seed, budget, method):
    """dartree's ranking is its deferred top-B order: the best b nodes of the B=48 tree are exactly
    the tree it builds with budget b. The heaps' pop order has the same property."""
    draft, head = random_draft(seed)
    big = make_builder(method, TreeSettings(budget=48, width=6, tree_top_k=8)).build(draft, head, 48)
    small = make_builder(method, TreeSettings(budget=budget, width=6, tree_top_k=8)).build(draft, head, budget)
    cut = big.prefix(budget)
    assert cut.paths() == small.paths()
    parents = cut.parents.tolist()
    assert all(p <= i for i, p in enumerate(parents))  # parents come before children (row p <= node row i + 1)
    ranked_first = set()
    for node in cut.rank.tolist():  # every prefix of the cut's own ranking is a tree too
        assert parents[node] == 0 or parents[node] - 1 in ranked_first
        ranked_first.add(node)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["dartree", "ddtree", "heap", "domino-ddtree"])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), per_row=st.sampled_from([0.0, 0.3, 3.0]))
def test_auto_budget_is_lossless_with_switches_to_plain_steps(pipelines, family, method, prompt, per_row):
    """budget='auto' with synthetic cost models that make rounds cheap (large trees), middling, or
    costly (plain steps with probes in between): the output is greedy decoding, token for token."""
    pipe = pipelines[(family, "domino")]
    pipe.use_cost_model(synthetic_cost(1.0, per_row))
    got = pipe.generate(input_ids=prompt, method=method, max_new_tokens=24, budget="auto", stop_token_ids=[])
    assert got.token_ids == hf_greedy(pipe.target_model, prompt, 24)
    history = next(iter(pipe._policies.values())).history
    if per_row == 3.0:
        assert min(history) <= 0  # rounds verified the root alone (a plain step), drafted or not
    if per_row == 0.0:
        assert max(history) > 1  # large trees were verified


def test_the_draft_reaches_twice_as_deep_as_recent_prefixes_and_at_least_the_minimum():
    """draft_depth: None before any drafted round; then build_headroom times the deepest node the
    recent drafted rounds verified, at least min_draft_depth; a round verifying the root alone counts 0."""
    policy = BudgetPolicy(synthetic_cost(10.0, 2.0), min_draft_depth=3)
    assert policy.draft_depth() is None
    chain = DraftTree.chain(torch.arange(6))
    chain.log_probs = torch.log(torch.tensor([0.9, 0.8, 0.7, 0.05, 0.01, 0.01]))
    chain.rank = torch.arange(6)
    kept = policy.cut(chain)
    assert policy.depth_history == [int(kept.depths.max())] and len(kept) == 3
    assert policy.draft_depth() == 2 * 3
    policy.depth_history = [0] * policy.recent_rounds  # recent rounds verified nothing drafted
    assert policy.draft_depth() == 3
    policy.depth_history.append(5)
    assert policy.draft_depth() == 10
    assert policy.fork().depth_history == []  # a new request starts drawing every depth


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", ["dartree", "ddtree", "domino-ddtree"])
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), min_depth=st.sampled_from([1, 2, 3]))
def test_auto_budget_with_shallow_drafts_is_lossless(pipelines, family, method, prompt, min_depth, monkeypatch):
    """Budget auto drafts only as deep as recent prefixes looked (here as shallow as one depth): the
    drafter runs a shorter block, and the output is still greedy decoding, token for token."""
    from dartree.proposers import drafter as drafter_module

    pipe = pipelines[(family, "domino")]
    pipe.use_cost_model(synthetic_cost(1.0, 0.3))
    blocks, block_length = [], drafter_module.block_length
    monkeypatch.setattr(drafter_module, "block_length", lambda cfg, limits: blocks.append(block_length(cfg, limits)) or blocks[-1])
    policy = pipe.budget_policy(GenerationSettings(method=method))  # the defaults: budget "auto"
    monkeypatch.setattr(policy, "min_draft_depth", min_depth)
    monkeypatch.setattr(policy, "build_headroom", 1)
    got = pipe.generate(input_ids=prompt, method=method, max_new_tokens=24, budget="auto", stop_token_ids=[])
    assert got.token_ids == hf_greedy(pipe.target_model, prompt, 24)
    full = pipe.drafter.config.block_size
    assert blocks[0] == full and min(blocks) < full  # every depth first, then shorter blocks


def test_auto_budget_switches_mid_generation_and_stays_exact(pipelines):
    """Start with a cost model under which speculation pays, then make verification expensive in the
    middle of a generation: the policy moves to plain steps, and the output is still greedy."""
    pipe = pipelines[("llama", "domino")]
    measured = pipe.cost_model()
    pipe.use_cost_model(synthetic_cost(1.0, 0.0))
    calls = {"n": 0}
    policy_apply = BudgetPolicy.apply

    def apply_then_get_expensive(self, tree, choice):
        calls["n"] += 1
        if calls["n"] == 3:
            self.cost = synthetic_cost(1.0, 50.0)
        return policy_apply(self, tree, choice)

    BudgetPolicy.apply = apply_then_get_expensive
    try:
        for prompt in ([1, 2, 3], [5], [0, 7, 7, 1]):
            pipe.use_cost_model(synthetic_cost(1.0, 0.0))
            calls["n"] = 0
            got = pipe.generate(input_ids=prompt, method="dartree", max_new_tokens=30, budget="auto", stop_token_ids=[])
            history = next(iter(pipe._policies.values())).history
            assert got.token_ids == hf_greedy(pipe.target_model, prompt, 30)
            assert max(history[:2]) > 1 and min(history[3:]) <= 0
    finally:
        BudgetPolicy.apply = policy_apply
    pipe.use_cost_model(measured)


def test_native_dtype_follows_the_cpu_flags(monkeypatch):
    from dartree import hardware

    monkeypatch.setattr(hardware, "cpu_info", lambda: ("Intel Xeon", frozenset({"avx2", "amx_bf16", "avx512_bf16"})))
    assert hardware.native_dtype("cpu") == torch.bfloat16
    monkeypatch.setattr(hardware, "cpu_info", lambda: ("AMD EPYC", frozenset({"avx2", "fma"})))
    assert hardware.native_dtype("cpu") == torch.float32
    assert "AMD EPYC" in hardware.describe_machine()


def test_generation_settings_validate_and_round_trip():
    from dartree import DartreeError, GenerationSettings

    s = GenerationSettings.from_kwargs(method="ddtree", budget=16, temperature=0.7, top_p=0.9)
    assert s.method == "ddtree" and s.tree.budget == 16 and s.tree.width == TreeSettings().width
    assert GenerationSettings.from_dict(s.to_dict()) == s
    assert s.used_tree_settings() == {"budget": 16}
    assert GenerationSettings.from_kwargs(s, width=None).tree.width == s.tree.width  # None keeps the base's value
    for bad, message in [({"method": "nope"}, "unknown method"), ({"budget": "big"}, "budget must be"),
                         ({"budget": 0}, "budget must be"), ({"beta": 0.1}, "beta must be <= 0"),
                         ({"temperature": -1}, "temperature"), ({"max_new_tokens": 0}, "max_new_tokens"),
                         ({"top_p": 1.5}, "top_p")]:
        with pytest.raises(DartreeError, match=message):
            GenerationSettings.from_kwargs(**bad).validate()
    with pytest.raises(DartreeError, match="unknown generation setting"):
        GenerationSettings.from_kwargs(temprature=1.0)


def test_calibrate_prints_the_cost_table_and_draws_it(model_dirs, tmp_path, monkeypatch, capsys):
    from dartree.cli import main

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    argv = ["calibrate", "--target", str(model_dirs[("llama", "target")]), "--drafter", str(model_dirs[("llama", "domino")]),
            "--context", "16", "--plot", str(tmp_path / "cost.png"), "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| rows in the forward | ms |" in out and "| 128 |" in out and (tmp_path / "cost.png").stat().st_size > 0
    assert len(list((tmp_path / "cache" / "costmodel").glob("*.json"))) == 1
    assert main(argv + ["--json"]) == 0  # the second call reads the cache
    assert '"verify_ms"' in capsys.readouterr().out


def test_the_calibration_times_the_drafter_as_deep_as_budget_auto_first_drafts(pipelines, monkeypatch):
    """The cost model prices the drafter call budget "auto" makes when recent prefixes were shallow
    (min_draft_depth depths), and leaves the proposer's own depth limit as it was."""
    from dartree import calibration
    from dartree.proposers import drafter as drafter_module

    pipe = pipelines[("llama", "domino")]
    monkeypatch.setattr(BudgetPolicy, "min_draft_depth", 2)
    limits, block_length = [], drafter_module.block_length
    monkeypatch.setattr(drafter_module, "block_length", lambda cfg, given: limits.append(list(given)) or block_length(cfg, given))
    pipe.proposer.depth_limit = None
    calibration.measure(pipe.target, pipe.proposer, pipe.head, context=12, rows=(1, 2), repeats=1, max_budget=4, progress=False)
    assert limits and all(given == [2] * len(given) for given in limits)
    assert pipe.proposer.depth_limit is None
    # a timing that fails leaves it as it was too
    monkeypatch.setattr(drafter_module, "block_length", lambda cfg, given: (_ for _ in ()).throw(RuntimeError("failed")))
    pipe.proposer.depth_limit = 5
    with pytest.raises(RuntimeError, match="failed"):
        calibration.measure(pipe.target, pipe.proposer, pipe.head, context=12, rows=(1, 2), repeats=1, max_budget=4, progress=False)
    assert pipe.proposer.depth_limit == 5


def test_one_budget_across_a_batch_speculates_less_as_rows_stop_being_free():
    """choose_batch: with one request it is the single-request choice; as the batch grows under a
    cost model whose forward gets expensive past 16 rows, each request gets fewer nodes, and none
    at all where the rows cost more than they bring; the best nodes of the batch are the ones taken."""
    from dartree.budget import choose_batch

    cost = CostModel({"machine": "synthetic"}, 256, {1: 10.0, 16: 11.0, 32: 30.0, 64: 70.0, 128: 150.0})
    trees = [ranked_tree([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]) for _ in range(16)]
    for tree in trees[:4]:
        policy = BudgetPolicy(cost)
        assert choose_batch([(policy, tree)], 1, 1.0)[0] == policy.choose(tree)
    per_request = []
    for k in (1, 2, 4, 8, 16):
        choices = choose_batch([(BudgetPolicy(cost), t) for t in trees[:k]], k, float(k))
        assert max(c.budget for c in choices) - min(c.budget for c in choices) <= 1  # equal trees share alike
        per_request.append(sum(c.budget for c in choices) / k)
    assert per_request[0] == 8 and per_request == sorted(per_request, reverse=True) and per_request[-1] == 0
    # Unequal requests: the more likely nodes win the rows.
    good, poor = ranked_tree([0.95, 0.9, 0.85, 0.8]), ranked_tree([0.2, 0.1, 0.05, 0.01])
    items = [(BudgetPolicy(cost), good)] + [(BudgetPolicy(cost), poor)] + [(BudgetPolicy(cost), ranked_tree([0.9] * 4)) for _ in range(6)]
    chosen = choose_batch(items, 8, 8.0)
    assert chosen[0].budget >= chosen[1].budget and chosen[1].budget == 0


def test_a_forked_policy_has_its_own_state_and_hands_its_calibration_back():
    shared = BudgetPolicy(synthetic_cost(1.0, 0.1))
    shared.observe(ranked_tree([0.9, 0.5]), [0, 1])
    fork = shared.fork()
    assert fork.predicted == shared.predicted and fork.history == [] and fork.predicted is not shared.predicted
    fork.cut(ranked_tree([0.9, 0.8]))
    fork.observe(ranked_tree([0.9, 0.8]), [0, 1, 2])
    assert shared.history == [] and shared.predicted != fork.predicted
    fork.hand_back()
    assert shared.predicted == fork.predicted and shared.accepted == fork.accepted


def test_the_cost_curve_is_remembered_per_table():
    cost = CostModel({"machine": "synthetic"}, 256, {1: 10.0, 4: 16.0})
    assert cost.verify(2) == pytest.approx(12.0) and cost.verify(2) == cost.verify(2)
    cost.verify_ms = {1: 10.0, 4: 13.0}  # a new table: a new curve
    assert cost.verify(2) == pytest.approx(11.0)


def test_a_request_pays_its_share_of_a_batched_drafter_call():
    cost = CostModel({"machine": "synthetic"}, 256, {1: 10.0, 2: 11.0}, draft_ms=4.0, draft_batch_ms={4: 8.0, 16: 16.0})
    assert cost.draft_share(1) == 4.0 and cost.draft_share(4) == 2.0 and cost.draft_share(16) == 1.0
    assert cost.draft_share(8) == pytest.approx((8.0 + 4 * (16.0 - 8.0) / 12) / 8)
    assert cost.draft_share(32) == pytest.approx((16.0 + 16 * (16.0 - 8.0) / 12) / 32)  # the last slope beyond
    again = CostModel.from_json(cost.to_json())
    assert again.draft_batch_ms == {4: 8.0, 16: 16.0} and again.draft_share(8) == cost.draft_share(8)
    assert CostModel({"machine": "synthetic"}, 256, {1: 10.0}, draft_ms=4.0).draft_share(8) == 4.0  # no batch times
    trees = CostModel({"machine": "synthetic"}, 256, {1: 10.0}, tree_ms=3.0, tree_batch_ms={4: 6.0})
    assert trees.tree_share(1) == 3.0 and trees.tree_share(4) == 1.5
    assert CostModel.from_json(trees.to_json()).tree_batch_ms == {4: 6.0}


def test_in_a_batch_a_lost_probe_waits_longer_and_the_next_request_starts_backed_off():
    """A probe's drafter call holds up the whole batch: after a lost round in a batch of n the plain
    steps before the next probe are stretched by n t(1) / t(n); a request forked after one that ended
    so starts with that many plain steps. Alone the same tree, cut alone, backs off probe_every steps, and
    the next request drafts at once but, losing too, waits as long as the last one's next wait."""
    from dartree.budget import cut_batch

    cost = synthetic_cost(10.0, 0.5, draft_ms=30.0)  # t(8) = 13.5 ms: 8 requests run 8 * 10 / 13.5 = 5.9x faster together
    hopeless = ranked_tree([0.05, 0.01])
    shared = BudgetPolicy(cost, probe_every=4)
    batch = [shared.fork() for _ in range(8)]
    for p in batch:
        p.start_request()
        assert p.speculate()
    cut_batch([(p, hopeless) for p in batch], 8, 8.0)
    stretched = round(8 * 10.0 / 13.5 * 4)
    for p in batch:
        assert [p.speculate() for _ in range(stretched + 1)] == [False] * stretched + [True]
    batch[0].hand_back()
    joining = shared.fork()
    joining.start_request()
    assert [joining.speculate() for _ in range(stretched + 1)] == [False] * stretched + [True]
    short = shared.fork()  # a request that ends within the wait it started with hands that wait on unchanged
    short.start_request()
    assert not short.speculate()
    short.hand_back()
    assert (shared.start_plain, shared.start_lost) == (stretched, 1)

    alone_shared = BudgetPolicy(cost, probe_every=4)
    alone = alone_shared.fork()
    alone.start_request()
    cut_batch([(alone, hopeless)], 1, 1.0)
    assert [alone.speculate() for _ in range(5)] == [False] * 4 + [True]
    alone.hand_back()
    after = alone_shared.fork()
    after.start_request()
    assert after.speculate()  # alone, the next request probes at once ...
    cut_batch([(after, hopeless)], 1, 1.0)  # ... and, losing again, waits as long as the last one would have
    assert after.lost_probes == 2 and [after.speculate() for _ in range(9)] == [False] * 8 + [True]
    won = alone_shared.fork()  # a won probe (rows and calls made free here) resets the back-off, for the next request too
    won.start_request()
    won.cost = synthetic_cost(10.0, 0.0)
    cut_batch([(won, ranked_tree([0.99, 0.98, 0.97]))], 1, 1.0)
    assert won.lost_probes == 0
    won.hand_back()
    fresh = alone_shared.fork()
    fresh.start_request()
    assert fresh.speculate() and fresh.lost_probes == 0
    # the pipeline's own policy (``generate``, one request after another, nothing forked) likewise
    own = BudgetPolicy(cost, probe_every=4)
    for lost_before in range(3):
        own.start_request()
        assert own.speculate() and own.lost_probes == lost_before
        cut_batch([(own, hopeless)], 1, 1.0)
        wait = 4 * 2 ** lost_before
        assert [own.speculate() for _ in range(wait + 1)] == [False] * wait + [True]


def test_in_a_batch_the_next_request_starts_as_deep_in_the_back_off_as_the_last_one_ended():
    """Two lost probes in a batch double the wait before the third; a request forked after that one
    starts with the doubled wait and, if its first probe loses too, waits twice as long again
    (capped at max_probe_every, stretched), rather than probing afresh after probe_every."""
    from dartree.budget import cut_batch

    cost = synthetic_cost(10.0, 0.5, draft_ms=30.0)
    hopeless = ranked_tree([0.05, 0.01])
    scale = 8 * 10.0 / 13.5
    shared = BudgetPolicy(cost, probe_every=4, max_probe_every=32)
    batch = [shared.fork() for _ in range(8)]
    for p in batch:
        p.start_request()
    for waited in (0, round(scale * 4)):
        for p in batch:
            assert [p.speculate() for _ in range(waited + 1)] == [False] * waited + [True]
        cut_batch([(p, hopeless) for p in batch], 8, 8.0)
    assert batch[0].lost_probes == 2
    batch[0].hand_back()
    joining = shared.fork()
    joining.start_request()
    doubled = round(scale * 8)
    assert [joining.speculate() for _ in range(doubled + 1)] == [False] * doubled + [True]
    cut_batch([(joining, hopeless)] + [(p, hopeless) for p in batch[1:]], 8, 8.0)
    assert joining.plain_left == round(scale * 16) and joining.lost_probes == 3


def test_the_cost_model_is_handed_to_the_pipeline_and_never_measured_inside_generate(model_dirs, monkeypatch):
    """cost_model="auto" (the default) measures this machine's model when the pipeline is made; a
    generate call never starts a calibration. With cost_model=None, budget "auto" is refused with
    what to do, fixed budgets and ar run, and a handed-in model is used as given."""
    from dartree import DartreeError

    target, drafter = model_dirs[("llama", "target")], model_dirs[("llama", "domino")]
    pipe = dartree.load(target, drafter, dtype=torch.float64)
    measured = pipe.cost_model()
    assert measured.verify_ms and measured.draft_ms > 0

    def no_calibration(*args, **kwargs):
        raise AssertionError("generate must not calibrate")

    monkeypatch.setattr("dartree.pipeline.load_or_measure", no_calibration)
    assert pipe.generate(input_ids=[1, 2], max_new_tokens=4, budget="auto", stop_token_ids=[]).token_ids
    bare = dartree.load(target, drafter, dtype=torch.float64, cost_model=None)
    with pytest.raises(DartreeError, match="calibrate"):
        bare.generate(input_ids=[1, 2], max_new_tokens=4, budget="auto")
    assert bare.generate(input_ids=[1, 2], max_new_tokens=4, budget=3, stop_token_ids=[]).token_ids == \
        pipe.generate(input_ids=[1, 2], max_new_tokens=4, method="ar", stop_token_ids=[]).token_ids
    given_model = synthetic_cost(1.0, 0.5, draft_ms=1.0)
    assert bare.use_cost_model(given_model) is given_model
    assert bare.budget_policy(GenerationSettings.from_kwargs(budget="auto").validate()).cost is given_model


def test_a_measured_cost_model_scales_each_stage_by_what_the_rounds_took():
    """MeasuredCostModel: each stage's prices are the calibration's times the running geometric
    mean of measured / predicted (the first measurement replaces the guess of 1; one stalled round
    counts at most 4x); the curve's shape stays the calibration's; it saves as the calibration."""
    from dartree.costmodel import MeasuredCostModel
    from dartree.errors import DartreeError

    base = CostModel({"machine": "synthetic"}, 256, {1: 10.0, 16: 20.0}, draft_ms=4.0, tree_ms=2.0, draft_batch_ms={4: 8.0})
    live = MeasuredCostModel.following(base, weight=0.5)
    assert live.verify(16) == 20.0 and live.draft_share(4) == 2.0 and live.round_ms(3) == base.round_ms(3)
    live.observe("verify", live.calibrated_verify(1), 5.0)  # the forward runs twice as fast as calibrated
    assert live.scales["verify"] == pytest.approx(0.5) and live.verify(16) == pytest.approx(10.0)
    assert live.verify(16) / live.verify(1) == pytest.approx(base.verify(16) / base.verify(1))
    live.observe("verify", 10.0, 10.0)  # then as calibrated: halfway back, geometrically
    assert live.scales["verify"] == pytest.approx(0.5 ** 0.5)
    live.observe("draft", live.calibrated_draft(4), 16.0)  # the batched call of 4 took twice its 8 ms
    assert live.draft_share(4) == pytest.approx(4.0) and live.draft_share(1) == pytest.approx(8.0)
    assert live.scales["tree"] == 1.0 and live.observed == {"verify": 2, "draft": 1, "tree": 0}
    assert live.round_ms(3) == pytest.approx(8.0 + 2.0 + live.verify(4))
    live.observe("tree", 2.0, 1000.0)  # a stalled round
    assert live.scales["tree"] == pytest.approx(4.0)
    assert CostModel.from_json(live.to_json()) == base  # what is saved is the calibration, not this process's scales
    with pytest.raises(DartreeError, match="unknown stage"):
        live.observe("commit", 1.0, 1.0)
    with pytest.raises(DartreeError, match="weight"):
        MeasuredCostModel.following(base, weight=0.0)


def test_a_batch_does_not_even_call_the_drafter_where_drafting_cannot_pay():
    """plan_drafting: with each request's expected gains known, a batch whose drafter calls cost more
    than the drafter's tokens bring drafts nothing; where calls are cheap and gains large every
    request drafts; the requests with most to gain draft first; a request with nothing drafted yet
    always drafts (its round makes the estimate); a long prompt chunk in the forward does not make
    the drafter look cheap (its time is not the decoding requests')."""
    from dartree.budget import plan_drafting

    def learnt(cost, probs):
        p = BudgetPolicy(cost)
        p.note_gains(probs)
        return p

    costly = synthetic_cost(10.0, 0.5, draft_ms=30.0, tree_ms=10.0)
    poor = [0.4, 0.2, 0.1]
    assert plan_drafting([learnt(costly, poor) for _ in range(8)], 8, 8.0) == [False] * 8
    fresh = BudgetPolicy(costly)
    assert plan_drafting([learnt(costly, poor), fresh], 2, 2.0) == [False, True]
    cheap = synthetic_cost(10.0, 0.05, draft_ms=0.5, tree_ms=0.5)
    assert plan_drafting([learnt(cheap, [0.9, 0.8, 0.7]) for _ in range(8)], 8, 8.0) == [True] * 8
    # One request can pay its call, the other cannot: only the first drafts, whatever the order.
    middling = synthetic_cost(10.0, 0.05, draft_ms=3.0, tree_ms=1.0)
    good, bad = learnt(middling, [0.95, 0.9, 0.85, 0.8]), learnt(middling, [0.05, 0.01])
    assert plan_drafting([bad, good, learnt(middling, [0.05])], 3, 3.0) == [False, True, False]
    # 64 prompt rows beside 4 decoding requests: charged to the 4 tokens, the long forward would make
    # 16 ms of drafter calls for 3 tokens look worth it; against a 4-row forward's 11.5 ms they are not.
    modest = synthetic_cost(10.0, 0.5, draft_ms=3.0, tree_ms=1.0)
    assert plan_drafting([learnt(modest, [0.5, 0.3]) for _ in range(4)], 68, 4.0, prompt_rows=64) == [False] * 4
    assert plan_drafting([learnt(modest, [0.5, 0.3]) for _ in range(4)], 68, 4.0) == [True] * 4
    # The running estimate follows the drafted rounds (weight ``smoothing``), curves of any length.
    p = learnt(cheap, [0.5])
    p.note_gains([1.0, 1.0])
    assert p.expected_gains == pytest.approx([0.0, 0.5 + 0.2 * 0.5, 0.5 + 0.2 * 1.5])
    fork = p.fork()
    fork.note_gains([0.0])
    fork.hand_back()
    assert p.expected_gains == fork.expected_gains and fork.expected_gains is not p.expected_gains


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=8, unique=True), data=st.data())
def test_the_cost_lookup_is_exact_at_measured_sizes_linear_between_and_beyond(sizes, data):
    """``costmodel._piecewise`` against the definition: each measured size's own value; between two
    sizes the line through them; below the smallest its value; beyond the largest the last slope."""
    from dartree.costmodel import _piecewise

    table = {s: float(data.draw(st.integers(1, 1000))) for s in sizes}
    xs = sorted(table)
    for x in range(1, 400):
        if x in table:
            want = table[x]
        elif x < xs[0] or len(xs) == 1:
            want = table[xs[0]] if x < xs[0] else table[xs[-1]]
        else:  # the measured neighbours of x, or the last two sizes beyond the largest
            lo, hi = (max(s for s in xs if s < x), min(s for s in xs if s > x)) if x < xs[-1] else (xs[-2], xs[-1])
            want = table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo)
        assert _piecewise(table, x) == pytest.approx(want, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(curves=st.lists(st.one_of(st.none(), st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40)), min_size=2, max_size=9),
       fixed=st.integers(2, 30), prompt=st.integers(0, 64), draft=st.floats(0.1, 20.0))
def test_the_drafting_plan_is_the_best_k_of_a_brute_force_search(curves, fixed, prompt, draft):
    """``plan_drafting`` against an exhaustive reference: for every k (the k requests with most to
    gain) and every node count, expected tokens per ms, with the gains merged by a full sort; the
    plan drafts exactly the reference's best k, plus every request without an estimate."""
    from dartree.budget import PLAN_MAX_NODES, _decode_ms, plan_drafting

    cost = synthetic_cost(10.0, 0.3, draft_ms=draft, tree_ms=1.0)
    policies = []
    for probs in curves:
        p = BudgetPolicy(cost)
        if probs is not None:
            p.note_gains(sorted(probs, reverse=True))
        policies.append(p)
    rows, base = fixed + prompt, float(fixed)
    known = sorted((i for i, p in enumerate(policies) if p.expected_gains is not None),
                   key=lambda i: policies[i].expected_gains[-1], reverse=True)
    unknown = len(policies) - len(known)
    decode = _decode_ms(cost, rows, prompt)

    def calls(k):
        return k * (cost.draft_share(k) + cost.tree_share(k))

    most = min(PLAN_MAX_NODES, sum(len(policies[i].expected_gains) - 1 for i in known))
    rates = [base / (decode + calls(unknown))]
    for k in range(1, len(known) + 1):
        steps = sorted((b - a for i in known[:k] for a, b in zip(policies[i].expected_gains, policies[i].expected_gains[1:])),
                       reverse=True)[:most]
        gains = [sum(steps[:m]) for m in range(len(steps) + 1)]
        fixed_ms = decode + calls(k + unknown) - cost.verify(rows)
        rates.append(max((base + g) / (fixed_ms + cost.verify(rows + m)) for m, g in enumerate(gains)))
    best = max(rates)
    plan = plan_drafting(policies, rows, base, prompt)
    chosen = [i for i in known if plan[i]]
    assert all(plan[i] for i, p in enumerate(policies) if p.expected_gains is None)
    assert chosen == known[:len(chosen)]  # the requests with most to gain draft first
    assert rates[len(chosen)] == pytest.approx(best, rel=1e-9)
