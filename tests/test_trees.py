"""Tree builders and Lemma 1 (deferred top-B equals a best-first heap on the supertree)."""

import heapq

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dartree.drafter import DraftOutput
from dartree.errors import DartreeError
from dartree.heads import DominoHead, MarkovHead
from dartree.trees import BUILDERS, METHODS, DraftTree, TreeSettings, make_builder, subtree
from dartree.trees.common import best_first_marginals, select_top_b

# ---------------------------------------------------------------- Lemma 1


@st.composite
def monotone_supertrees(draw):
    n = draw(st.integers(1, 40))
    parents, scores, depths = [], [], []
    for i in range(n):
        parent = draw(st.integers(0, i))  # row 0 is the root; node i has row i+1
        base = 0.0 if parent == 0 else scores[parent - 1]
        # small integer decrements make ties frequent, including parent/child ties (decrement 0)
        scores.append(base - draw(st.sampled_from([0.0, 0.0, 1.0, 2.0, 3.0])))
        parents.append(parent)
        depths.append(1 if parent == 0 else depths[parent - 1] + 1)
    budget = draw(st.integers(1, n + 2))
    return torch.tensor(scores, dtype=torch.float64), torch.tensor(parents), torch.tensor(depths), budget


def reference_heap(scores, parents, budget):
    """Best-first max-heap on the supertree: start from the root's children, pop the best frontier
    node (ties to the smaller row), push its children."""
    children = {}
    for i, p in enumerate(parents.tolist()):
        children.setdefault(p, []).append(i)
    frontier = [(-scores[i].item(), i) for i in children.get(0, [])]
    heapq.heapify(frontier)
    popped = []
    while frontier and len(popped) < budget:
        _, i = heapq.heappop(frontier)
        popped.append(i)
        for c in children.get(i + 1, []):
            heapq.heappush(frontier, (-scores[c].item(), c))
    return sorted(popped)


@settings(max_examples=400, deadline=None)
@given(monotone_supertrees())
def test_deferred_top_b_equals_best_first_heap(tree):
    scores, parents, _, budget = tree
    kept = select_top_b(scores.tolist(), parents.tolist(), budget)
    assert kept == reference_heap(scores, parents, budget)
    assert len(kept) == min(budget, scores.numel())
    kept_rows = {i + 1 for i in kept}
    assert all(int(parents[i]) == 0 or int(parents[i]) in kept_rows for i in kept), "not ancestor-closed"


@settings(max_examples=100, deadline=None)
@given(monotone_supertrees(), st.sampled_from([0.0, -0.2, -1.0]))
def test_depth_bonus_keeps_monotonicity(tree, beta):
    scores, parents, depths, budget = tree
    kept = select_top_b((scores + beta * depths).tolist(), parents.tolist(), budget)
    assert kept == reference_heap(scores + beta * depths, parents, budget)


def test_non_monotone_scores_are_rejected():
    with pytest.raises(DartreeError, match="never increase"):
        select_top_b([-1.0, -0.5], [0, 1], 1)


def test_positive_beta_is_rejected():
    with pytest.raises(DartreeError, match="beta must be <= 0"):
        make_builder("dartree", TreeSettings(beta=0.1))


def test_subtree_renumbers_parents():
    tokens, parents, depths = torch.tensor([5, 6, 7, 8]), torch.tensor([0, 0, 2, 3]), torch.tensor([1, 1, 2, 3])
    t = subtree(tokens, parents, depths, torch.tensor([1, 2, 3]))
    assert t.tokens.tolist() == [6, 7, 8] and t.parents.tolist() == [0, 1, 2]


# ---------------------------------------------------------------- builders on random drafts

D, V, H = 6, 40, 16


def random_draft(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(D, H, generator=g, dtype=dtype)
    return DraftOutput(bonus=int(torch.randint(V, (1,), generator=g)), hidden=hidden,
                       base_logits=2 * torch.randn(D, V, generator=g, dtype=dtype))


def random_head(kind, seed):
    torch.manual_seed(seed)
    head = DominoHead(H, 12, 8, V, pure_prefix=1) if kind == "domino" else MarkovHead(V, 8)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.8)
    head = head.double()
    embed = torch.nn.Embedding(V, H).double()
    head.bind(embed)
    return head


def check_well_formed(tree: DraftTree):
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    for i, p in enumerate(parents):
        assert p <= i, "parent must precede child"
        assert depths[i] == (1 if p == 0 else depths[p - 1] + 1)
    siblings = list(zip(parents, tree.tokens.tolist()))
    assert len(set(siblings)) == len(siblings), "two siblings carry the same token"


@pytest.mark.parametrize("kind", ["domino", "markov"])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 30), tree_top_k=st.sampled_from([3, 8, 40]),
       beta=st.sampled_from([0.0, -0.2, -1.5]))
def test_heap_and_dartree_pick_the_same_tree_when_the_beam_is_wide(kind, seed, budget, tree_top_k, beta):
    draft, head = random_draft(seed), random_head(kind, seed)
    s = TreeSettings(budget=budget, width=budget, tree_top_k=tree_top_k, beta=beta)  # W >= B keeps every node the heap visits
    heap_tree = make_builder("heap", s).build(draft, head, budget)
    dar_tree = make_builder("dartree", s).build(draft, head, budget)
    check_well_formed(heap_tree)
    check_well_formed(dar_tree)
    assert len(heap_tree) == len(dar_tree) == budget
    assert heap_tree.paths() == dar_tree.paths()


@pytest.mark.parametrize("method", [m for m in METHODS if BUILDERS[m].proposer == "drafter"])  # trees from drafts
@pytest.mark.parametrize("budget", [1, 5, 16, 64])
def test_builders_make_valid_trees(method, budget):
    draft, head = random_draft(budget), random_head("domino", budget)
    tree = make_builder(method, TreeSettings(budget=budget, width=4, tree_top_k=8)).build(draft, head, budget)
    check_well_formed(tree)
    if method in ("dflash", "domino"):
        assert len(tree) == D and tree.depths.tolist() == list(range(1, D + 1))
    elif method == "dartree":
        assert len(tree) == min(budget, 4 * D)
    else:
        assert len(tree) == budget


def test_dartree_fixed_spreads_the_budget_over_depths():
    draft, head = random_draft(1), random_head("domino", 1)
    tree = make_builder("dartree-fixed", TreeSettings(budget=24, tree_top_k=8)).build(draft, head, 24)
    assert torch.bincount(tree.depths)[1:].tolist() == [4] * D


def test_ddtree_is_the_top_b_of_the_factorised_distribution():
    draft = random_draft(7)
    logp = draft.base_logits.log_softmax(-1)
    tree = best_first_marginals(logp, 20)

    def score(path):
        return sum(logp[d, t].item() for d, t in enumerate(path))

    chosen = tree.paths()
    worst_in = min(score(p) for p in chosen)
    # every one-step extension of the tree (child or sibling) scores no better than the worst member
    for p in chosen:
        for t in range(V):
            for q in (p[:-1] + (t,), p + (t,) if len(p) < D else None):
                if q is not None and q not in chosen:
                    assert score(q) <= worst_in + 1e-12


def test_domino_chain_uses_the_corrected_argmax():
    draft, head = random_draft(3), random_head("domino", 3)
    tree = make_builder("domino").build(draft, head, TreeSettings().build_budget)
    rnd = head.start_round(draft.hidden, draft.base_logits)
    state = head.initial_state(draft.bonus)
    for depth, token in enumerate(tree.tokens.tolist()):  # the token at depth + 1
        assert token == int(head.logits(rnd, depth, state)[0].argmax())
        state = head.advance(state, torch.tensor([token]))
    assert tree.tokens[0] == draft.base_logits[0].argmax(), "pure-draft prefix slot must be uncorrected"


@pytest.mark.parametrize("kind", ["domino", "markov"])
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 40), width=st.integers(1, 12),
       beta=st.sampled_from([0.0, -0.2, -1.5]), scale=st.sampled_from([0.3, 1.0, 4.0]))
def test_early_stop_does_not_change_the_tree(kind, seed, budget, width, beta, scale):
    """Stopping once nothing deeper can enter the top-B selects the same nodes as full expansion."""
    from dartree.trees import grow_supertree

    draft, head = random_draft(seed), random_head(kind, seed)
    draft.base_logits = draft.base_logits * scale

    def pick(st_):
        keep = select_top_b((st_.scores + beta * st_.depths.to(st_.scores.dtype)).tolist(), st_.parents.tolist(), budget)
        return subtree(st_.tokens, st_.parents, st_.depths, torch.tensor(keep, dtype=torch.long)).paths()

    full = grow_supertree(draft, head, 8, lambda s, p: width)
    early = grow_supertree(draft, head, 8, lambda s, p: width, budget=budget, beta=beta)
    assert pick(full) == pick(early)


@pytest.mark.parametrize("kind", ["domino", "markov"])
@settings(max_examples=25, deadline=None)
@given(seeds=st.lists(st.integers(0, 10_000), min_size=2, max_size=5, unique=True),
       budgets=st.lists(st.integers(1, 40), min_size=5, max_size=5), width=st.integers(1, 12),
       tree_top_k=st.sampled_from([3, 8, 40]), beta=st.sampled_from([0.0, -0.2, -1.5]))
def test_dartree_builds_many_requests_as_it_builds_each_alone(kind, seeds, budgets, width, tree_top_k, beta):
    """The batched expansion (every live branch of every request corrected in one batch per depth,
    each request stopping on its own budget) gives each request the tree, ranking and scores it
    gets alone."""
    from dartree.trees import BUILDERS

    head = random_head(kind, seeds[0])
    drafts = [random_draft(s) for s in seeds]
    budgets = budgets[: len(seeds)]
    builder = make_builder("dartree", TreeSettings(budget=max(budgets), width=width, tree_top_k=tree_top_k, beta=beta))
    together = BUILDERS["dartree"].build_many([builder] * len(drafts), drafts, head, budgets)
    for draft, budget, tree in zip(drafts, budgets, together):
        alone = builder.build(draft, head, budget)
        check_well_formed(tree)
        assert torch.equal(tree.tokens, alone.tokens) and torch.equal(tree.parents, alone.parents)
        assert torch.equal(tree.depths, alone.depths) and torch.equal(tree.rank, alone.rank)
        torch.testing.assert_close(tree.log_probs, alone.log_probs, rtol=1e-12, atol=1e-12)


def test_a_tree_moves_to_the_targets_device_whole():
    """``DraftTree.to``: the same tree where it already is; elsewhere every tensor moves, scores and rank
    included (a proposer's tree is built on the CPU; a target on a GPU verifies it there)."""
    from dartree.trees import DraftTree

    tree = DraftTree.from_lists([5, 6, 7], [0, 1, 1], [1, 2, 2])
    tree.log_probs, tree.rank = torch.tensor([-0.1, -0.5, -0.3], dtype=torch.float64), torch.tensor([0, 2, 1])
    assert tree.to("cpu") is tree
    moved = tree.to("meta")
    assert all(t.device.type == "meta" for t in (moved.tokens, moved.parents, moved.depths, moved.log_probs, moved.rank))
    assert moved.log_probs.dtype == torch.float64 and len(moved) == 3
    assert DraftTree.empty().to("meta").log_probs is None


@settings(max_examples=200, deadline=None)
@given(data=st.data(), best_first=st.booleans())
def test_prefix_of_a_tree_numbered_best_first_is_the_restricted_tree(data, best_first):
    """``DraftTree.prefix`` slices a tree whose nodes are numbered best first (the compiled grower's, the
    n-gram proposer's) instead of renumbering it: the same tree, scores and ranking as ``restricted``,
    field for field, and a tree numbered otherwise still goes through ``restricted``."""
    n = data.draw(st.integers(1, 30))
    parents, scores, depths = [], [], []
    for i in range(n):
        parent = data.draw(st.integers(0, i))
        scores.append((0.0 if parent == 0 else scores[parent - 1]) - data.draw(st.sampled_from([0.0, 1.0, 2.5])))
        parents.append(parent)
        depths.append(1 if parent == 0 else depths[parent - 1] + 1)
    # best first, ties to the shallower then earlier node: every prefix of the ranking is a tree
    rank = sorted(range(n), key=lambda j: (-scores[j], depths[j], j))
    if best_first:  # renumber the nodes in rank order
        row = {old: new + 1 for new, old in enumerate(rank)}
        parents = [row[parents[old] - 1] if parents[old] else 0 for old in rank]
        scores, depths = [scores[old] for old in rank], [depths[old] for old in rank]
        tokens = [1000 + old for old in rank]
        rank = list(range(n))
    else:
        tokens = [1000 + j for j in range(n)]
    tree = DraftTree.from_lists(tokens, parents, depths)
    tree.log_probs, tree.rank = torch.tensor(scores, dtype=torch.float64), torch.tensor(rank)
    budget = data.draw(st.integers(0, n - 1))
    got = tree.prefix(budget)
    want = tree.restricted(tree.rank[:budget].sort().values)
    for name in ("tokens", "parents", "depths", "log_probs", "rank"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
