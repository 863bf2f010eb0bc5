"""The n-gram proposer: its index, its trees, what it learns, and the methods on it (exact)."""

import torch
from conftest import VOCAB, hf_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dartree.proposers import NgramChainProposer, NgramProposer, Proposer
from dartree.trees import DraftTree


def seen(proposer, tokens):
    proposer.observe(torch.tensor(tokens), None)
    return proposer


def test_the_longest_repeated_suffix_gives_every_recent_continuation_as_branches():
    p = seen(NgramProposer(), [5, 1, 2, 3, 9, 1, 2, 4, 4, 7, 1])
    assert isinstance(p, Proposer)
    tree = p.propose(2)  # the text ends "1 2": it was followed by "3 9 ..." and by "4 4 7 1 2"
    got = tree.paths()
    assert (3,) in got and (4,) in got and (3, 9) in got and (4, 4, 7, 1, 2) in got
    assert len(got) == len(tree)  # shared prefixes are one node
    assert max(len(x) for x in got) <= NgramProposer.num_depths
    # ranked: every prefix of the rank is a tree, and a child never outscores its parent
    parents = tree.parents.tolist()
    placed = set()
    for node in tree.rank.tolist():
        assert parents[node] == 0 or parents[node] - 1 in placed
        placed.add(node)
    lp = tree.log_probs.tolist()
    assert all(lp[i] <= lp[parents[i] - 1] for i in range(len(lp)) if parents[i] > 0)


@settings(max_examples=150, deadline=None)
@given(text=st.lists(st.integers(0, 6), min_size=2, max_size=80), bonus=st.integers(0, 6))
def test_the_tree_is_numbered_best_first(text, bonus):
    """The nodes are numbered in rank order (so the budget's cut is a slice): scores never rise along the node
    order, equal scores keep the shallower first, parents come before their children, and the rank is the
    identity; the same paths and scores as the tree rebuilt in depth order."""
    tree = seen(NgramProposer(), text).propose(bonus)
    lp, depths, parents = tree.log_probs.tolist(), tree.depths.tolist(), tree.parents.tolist()
    assert tree.rank.tolist() == list(range(len(tree)))
    assert all(lp[i] >= lp[i + 1] for i in range(len(lp) - 1))
    assert all(depths[i] <= depths[i + 1] for i in range(len(lp) - 1) if lp[i] == lp[i + 1])
    assert all(p <= i for i, p in enumerate(parents))  # row p (node p - 1) before node i (row i + 1)
    by_depth = sorted(range(len(tree)), key=lambda i: depths[i])  # any numbering: the same tree
    paths = tree.node_paths()
    assert {paths[i]: lp[i] for i in by_depth} == dict(zip(paths, lp)) and len(set(paths)) == len(paths)


def test_the_chain_variant_takes_the_latest_occurrence_only():
    p = seen(NgramChainProposer(), [5, 1, 2, 3, 9, 1, 2, 4, 4, 7, 1])
    tree = p.propose(2)
    assert tree.node_paths()[-1] == (4, 4, 7, 1, 2) and len(tree) == 5  # one chain


def test_nothing_seen_before_proposes_nothing():
    assert len(seen(NgramProposer(), [1, 2, 3]).propose(4)) == 0
    assert len(NgramProposer().propose(4)) == 0


@settings(max_examples=50, deadline=None)
@given(text=st.lists(st.integers(0, 5), min_size=1, max_size=60), bonus=st.integers(0, 5))
def test_the_index_finds_what_a_scan_finds(text, bonus):
    """The tree's depth-1 tokens are exactly what followed the latest occurrences of the longest
    suffix that occurred before (a brute-force scan of the text)."""
    p = seen(NgramProposer(), text)
    history = text + [bonus]
    want: set[int] = set()
    for n in range(min(NgramProposer.max_match, len(history)), 0, -1):
        suffix = history[-n:]
        ends = [e for e in range(n, len(history)) if history[e - n:e] == suffix]
        if ends:
            want = {history[e] for e in ends[-NgramProposer.max_matches:]}
            break
    tree = p.propose(bonus)
    assert {t for t, d in zip(tree.tokens.tolist(), tree.depths.tolist()) if d == 1} == want


def test_it_learns_from_what_the_target_accepted():
    p = seen(NgramProposer(), [1, 2, 3, 1, 2, 3, 1, 2, 3, 1])
    first = p.propose(2)
    before = first.log_probs[0].item()
    for _ in range(6):  # the target keeps accepting the whole proposed chain
        tree = p.propose(2)
        assert tree.parents.tolist() == list(range(len(tree)))  # one chain: every occurrence continues alike
        p.learn(tree, list(range(len(tree) + 1)))
    assert p.propose(2).log_probs[0].item() > before
    for _ in range(60):  # and then keeps rejecting its first node
        tree = p.propose(2)
        p.learn(tree, [0])
    assert p.propose(2).log_probs[0].item() < before


def test_ngram_methods_reproduce_greedy_decoding(pipelines):
    """Drafter-free methods on a pipeline with no drafter: exact on prompts built to repeat, and the
    proposals are accepted (not only plain steps)."""
    pipe = pipelines[("llama", None)]
    assert {"ngram", "ngram-chain"} <= set(pipe.methods)
    rng = torch.Generator().manual_seed(0)
    accepted = {"ngram": 0, "ngram-chain": 0}
    for _ in range(10):
        pattern = torch.randint(VOCAB, (int(torch.randint(2, 5, (1,), generator=rng)),), generator=rng).tolist()
        prompt = pattern * 3
        want = hf_greedy(pipe.target_model, prompt, 24)
        for method in accepted:
            for budget in ("auto", 3, 16):
                got = pipe.generate(input_ids=prompt, method=method, max_new_tokens=24, budget=budget, stop_token_ids=[])
                assert got.token_ids == want, (method, budget)
                accepted[method] += sum(got.stats.acceptance_lengths) - got.stats.rounds
    assert all(n > 0 for n in accepted.values()), accepted


def test_merged_trees_keep_every_path_once_with_its_best_score_and_a_valid_ranking():
    from dartree.trees.common import merge_ranked

    def ranked(tokens, parents, log_probs):
        t = DraftTree.from_lists(tokens, parents, [0] * len(tokens))
        depth = []
        for p in parents:
            depth.append(1 if p == 0 else depth[p - 1] + 1)
        t.depths = torch.tensor(depth)
        t.log_probs = torch.tensor(log_probs, dtype=torch.float64)
        t.rank = torch.sort(t.log_probs, descending=True, stable=True).indices
        return t

    a = ranked([5, 6, 7], [0, 1, 0], [-0.1, -0.5, -2.0])   # 5, 5-6, 7
    b = ranked([5, 8, 6], [0, 1, 1], [-0.3, -0.2, -0.4])   # 5, 5-8, 5-6
    merged = merge_ranked([a, b], budget=10, beta=0.0)
    got = dict(zip(merged.node_paths(), merged.log_probs.tolist()))
    assert got == {(5,): -0.1, (5, 6): -0.4, (5, 8): -0.2, (7,): -2.0}
    parents, placed = merged.parents.tolist(), set()
    for node in merged.rank.tolist():
        assert parents[node] == 0 or parents[node] - 1 in placed
        placed.add(node)
    top2 = merge_ranked([a, b], budget=2, beta=0.0)
    assert top2.paths() == {(5,), (5, 8)}  # one top-B over both sources


def test_the_ngram_setting_is_validated_and_read_by_dartree_only():
    import pytest
    from dartree.errors import DartreeError
    from dartree.trees import TreeSettings, make_builder

    assert TreeSettings(ngram=True).validate().ngram is True
    with pytest.raises(DartreeError, match="ngram must be on or off"):
        TreeSettings(ngram="maybe").validate()
    assert make_builder("dartree", TreeSettings(ngram=True)).proposer == "drafter+ngram"
    assert make_builder("dartree", TreeSettings()).proposer == "drafter+ngram"  # on by default
    assert make_builder("dartree", TreeSettings(ngram=False)).proposer == "drafter"


def test_dartree_with_ngram_merged_reproduces_greedy_decoding(pipelines):
    pipe = pipelines[("llama", "domino")]
    rng = torch.Generator().manual_seed(1)
    extra = 0
    for _ in range(8):
        pattern = torch.randint(VOCAB, (int(torch.randint(2, 5, (1,), generator=rng)),), generator=rng).tolist()
        prompt = pattern * 3
        want = hf_greedy(pipe.target_model, prompt, 24)
        for budget in ("auto", 3, 16):
            got = pipe.generate(input_ids=prompt, method="dartree", ngram=True, max_new_tokens=24, budget=budget,
                                stop_token_ids=[])
            assert got.token_ids == want, budget
            extra += sum(got.stats.acceptance_lengths) - got.stats.rounds
    assert extra > 0


def test_the_suffix_cache_proposes_earlier_answers_and_evicts_the_least_recently_used():
    from dartree.proposers.suffix_cache import SuffixCache

    cache = SuffixCache(1.0)
    cache.capacity_tokens = 30  # three answers of ten tokens (with their prompt tails)
    cache.add([9, 9, 1, 2], [3, 4, 5, 6, 50, 51])
    cache.add([9, 9, 1, 2], [3, 4, 7, 8, 60, 61])
    p = seen(NgramProposer(shared=cache), [20, 21, 1, 2])
    tree = p.propose(3)  # "1 2 3" was followed by "4 5 ..." and "4 7 ..." in earlier answers
    assert (4, 7, 8, 60, 61) in tree.paths() and (4, 5, 6, 50, 51) in tree.paths()
    assert seen(NgramProposer(), [20, 21, 1, 2]).propose(3).paths() == set()  # without the cache: nothing
    cache.add([0, 0, 0, 0], [70, 71, 72, 73, 74, 75])  # full: 30 tokens
    cache.continuations([5, 6], 8, 8)  # the first answer is used, so the second is now the oldest
    cache.add([0, 0, 0, 0], [80, 81, 82, 83, 84, 85])
    assert cache.continuations([7, 8], 8, 8) == (0, [])  # evicted
    assert cache.continuations([5, 6], 8, 8) == (2, [[50, 51]]) and cache.tokens == 30


def test_the_suffix_cache_stays_within_its_megabytes():
    import random
    import tracemalloc

    from dartree.proposers.suffix_cache import SuffixCache

    rng = random.Random(0)
    answers = [[rng.randrange(49152) for _ in range(96)] for _ in range(200)]  # every n-gram new: the worst case
    tracemalloc.start()
    try:
        cache = SuffixCache(0.5)
        for a in answers * 2:
            cache.add([1, 2, 3, 4], a)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cache.tokens <= cache.capacity_tokens and len(cache.entries) < len(answers)  # it did evict
    assert held <= 0.5 * 2**20, held


def test_a_suffix_cache_raises_acceptance_and_leaves_the_output_as_it_was(pipelines):
    """A later request whose answer repeats an earlier one's accepts more with the cache; every output
    is greedy decoding's, with or without it."""
    pipe = pipelines[("llama", "domino")]
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(VOCAB, (5,), generator=rng).tolist() for _ in range(6)]
    accepted = {}
    try:
        for cache_mb in (None, 1.0):
            pipe.use_suffix_cache(cache_mb)
            accepted[cache_mb] = 0
            for prompt in prompts:
                want = hf_greedy(pipe.target_model, prompt, 24)
                pipe.generate(input_ids=prompt, method="ngram", max_new_tokens=24, stop_token_ids=[])  # seen once
                got = pipe.generate(input_ids=prompt, method="ngram", budget=16, max_new_tokens=24, stop_token_ids=[])
                assert got.token_ids == want
                accepted[cache_mb] += sum(got.stats.acceptance_lengths) - got.stats.rounds
    finally:
        pipe.use_suffix_cache(None)
    assert accepted[1.0] > accepted[None], accepted


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_merge_with_one_nonempty_source_is_the_general_merge(data):
    """merge_ranked's shortcut for one non-empty source (the n-gram tree found nothing) gives the
    tree the union's general construction gives, node for node, scores and ranking included; a
    source with siblings of one token, or out of depth order, takes the general way."""
    import dartree.trees.common as common

    n = data.draw(st.integers(1, 12))
    parents, depths = [], []
    for i in range(n):
        p = data.draw(st.integers(0, i))
        parents.append(p)
        depths.append(1 if p == 0 else depths[p - 1] + 1)
    tokens = [data.draw(st.integers(0, 3)) for _ in range(n)]
    scores = []
    for i, p in enumerate(parents):  # never increasing along a path
        scores.append((scores[p - 1] if p else 0.0) - data.draw(st.floats(0.0, 3.0)))
    tree = DraftTree.from_lists(tokens, parents, depths)
    tree.log_probs = torch.tensor(scores, dtype=torch.float32)
    tree.rank = torch.sort(tree.log_probs, descending=True, stable=True).indices
    budget, beta = data.draw(st.integers(1, 14)), data.draw(st.sampled_from([0.0, -0.2, -1.0]))
    nothing = DraftTree.empty()  # as the n-gram proposer hands it: no nodes, no scores
    nothing.log_probs, nothing.rank = torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    shortcut = common.merge_ranked([tree, nothing], budget, beta)
    real = common._depth_ordered_and_distinct
    try:
        common._depth_ordered_and_distinct = lambda t: False
        general = common.merge_ranked([tree, nothing], budget, beta)
    finally:
        common._depth_ordered_and_distinct = real
    for field in ("tokens", "parents", "depths", "log_probs", "rank"):
        assert torch.equal(getattr(shortcut, field), getattr(general, field)), field


def test_the_merge_shortcut_takes_depth_ordered_trees_with_distinct_siblings_only():
    from dartree.trees.common import _depth_ordered_and_distinct

    assert _depth_ordered_and_distinct(DraftTree.from_lists([5, 6, 7, 8], [0, 0, 1, 2], [1, 1, 2, 2]))
    assert not _depth_ordered_and_distinct(DraftTree.from_lists([5, 5, 7], [0, 0, 1], [1, 1, 2]))  # siblings of one token
    assert not _depth_ordered_and_distinct(DraftTree.from_lists([5, 6, 7], [0, 1, 0], [1, 2, 1]))  # out of depth order
