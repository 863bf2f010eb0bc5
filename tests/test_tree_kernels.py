"""The compiled DARTree grower builds the Python grower's trees, node for node (float64), and the
builder uses it where it runs."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from dartree.drafter import DraftOutput
from dartree.heads import DominoHead, MarkovHead
from dartree.trees import TreeSettings, make_builder
from dartree.trees import grow_kernel
from dartree.trees.dartree import Supertree, _ranked_top_b, grow_supertree

pytestmark = pytest.mark.skipif(not grow_kernel.available(), reason="no compiler for the tree kernels")

HIDDEN, TARGET_VOCAB = 24, 97


def make_head(kind: str, seed: int, draft_vocab: int | None, pure_prefix: int):
    gen = torch.Generator().manual_seed(seed)
    out_vocab = draft_vocab or TARGET_VOCAB
    head = DominoHead(HIDDEN, 20, 12, out_vocab, pure_prefix) if kind == "domino" else MarkovHead(TARGET_VOCAB, 10, out_vocab)
    head = head.double()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    embed = nn.Embedding(TARGET_VOCAB, HIDDEN).double()
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape, generator=gen, dtype=torch.float64))
    d2t = None
    if draft_vocab:  # draft id i is target id picks[i]: offsets picks[i] - i
        picks = torch.randperm(TARGET_VOCAB, generator=gen)[:draft_vocab].sort().values
        d2t = picks - torch.arange(draft_vocab)
    head.bind(embed, d2t)
    return head, d2t


def make_draft(seed: int, depths: int, vocab: int, d2t):
    gen = torch.Generator().manual_seed(seed + 1)
    return DraftOutput(bonus=int(torch.randint(TARGET_VOCAB, (1,), generator=gen)),
                       hidden=torch.randn(depths, HIDDEN, generator=gen, dtype=torch.float64),
                       base_logits=torch.randn(depths, vocab, generator=gen, dtype=torch.float64) * 3, d2t=d2t)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["domino", "markov"]), seed=st.integers(0, 10_000), depths=st.integers(1, 8),
       reduced=st.booleans(), pure_prefix=st.integers(0, 2), tree_top_k=st.integers(1, 40), width=st.integers(1, 12),
       budget=st.one_of(st.none(), st.integers(1, 60)), beta=st.sampled_from([0.0, -0.1, -0.7]))
def test_compiled_grower_builds_the_python_growers_tree(kind, seed, depths, reduced, pure_prefix, tree_top_k, width, budget, beta):
    head, d2t = make_head(kind, seed, 61 if reduced else None, pure_prefix)
    draft = make_draft(seed, depths, 61 if reduced else TARGET_VOCAB, d2t)
    want = grow_supertree(draft, head, tree_top_k, lambda depth, placed: width, budget=budget, beta=beta)
    grown = grow_kernel.grow_supertree(draft, head, tree_top_k, width, budget, beta)
    assert grown is not None
    got = Supertree(*grown)
    for name in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-12, atol=1e-12)
    if budget is not None:
        a, b = _ranked_top_b(got, budget, beta), _ranked_top_b(want, budget, beta)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.equal(a.rank, b.rank)


def test_builder_takes_the_compiled_grower_and_follows_weight_changes():
    head, d2t = make_head("domino", 3, 61, 1)
    draft = make_draft(3, 6, 61, d2t)
    builder = make_builder("dartree", TreeSettings(budget=16))
    first = builder.build_tree(draft, head)
    assert head.__dict__.get("_grow_tables") is not None  # the compiled path ran
    with torch.no_grad():  # a head trained further: its tables are made again
        head.prefix_gru.weight_hh_l0.mul_(-1.0)
    again = builder.build_tree(draft, head)
    want = grow_supertree(draft, head, builder.settings.tree_top_k, lambda d, p: builder.settings.width, budget=16,
                          beta=builder.settings.beta)
    ranked = _ranked_top_b(want, 16, builder.settings.beta)
    # build_tree hands out target ids
    assert torch.equal(again.tokens, draft.to_target(ranked.tokens)) and torch.equal(again.parents, ranked.parents)
    assert len(first) == len(again) == 16
    # a parameter replaced on its module (not changed in place) is seen too
    gen = torch.Generator().manual_seed(5)
    w2 = head.embed_proj[2].weight
    head.embed_proj[2].weight = torch.nn.Parameter(torch.randn(w2.shape, generator=gen, dtype=w2.dtype) * 3)
    third = builder.build_tree(draft, head)
    want = grow_supertree(draft, head, builder.settings.tree_top_k, lambda d, p: builder.settings.width, budget=16,
                          beta=builder.settings.beta)
    ranked = _ranked_top_b(want, 16, builder.settings.beta)
    assert torch.equal(third.tokens, draft.to_target(ranked.tokens)) and torch.equal(third.parents, ranked.parents)
    assert not (torch.equal(third.tokens, again.tokens) and torch.equal(third.parents, again.parents))


def test_heads_the_kernel_does_not_take_keep_the_python_grower():
    head, d2t = make_head("markov", 5, None, 0)
    draft = make_draft(5, 4, TARGET_VOCAB, d2t)
    head32 = make_head("markov", 5, None, 0)[0].float()
    head32.bind(nn.Embedding(TARGET_VOCAB, HIDDEN), None)
    assert grow_kernel.grow_supertree(draft, head32, 8, 4, 8, 0.0) is None  # float64 logits, float32 head
    unbound = MarkovHead(TARGET_VOCAB, 10, TARGET_VOCAB).double()
    assert grow_kernel.head_tables(unbound) is None  # no embedding bound


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["domino", "markov"]), seed=st.integers(0, 10_000), requests=st.integers(2, 9),
       dtype=st.sampled_from([torch.float64, torch.float32]), width=st.integers(1, 12),
       budgets=st.lists(st.one_of(st.none(), st.integers(1, 60)), min_size=9, max_size=9))
def test_trees_grown_together_are_each_the_tree_grown_alone(kind, seed, requests, dtype, width, budgets):
    """One compiled call for a batch (the requests over the threads) gives each request's supertree bit for bit."""
    head, d2t = make_head(kind, seed, 61, 1)
    head = head.to(dtype)
    head.bind(nn.Embedding.from_pretrained(head._embed.weight.to(dtype)), d2t)
    drafts = [make_draft(seed + 7 * i, 6, 61, d2t) for i in range(requests)]
    drafts = [DraftOutput(bonus=d.bonus, hidden=d.hidden.to(dtype), base_logits=d.base_logits.to(dtype), d2t=d2t) for d in drafts]
    together = grow_kernel.grow_supertrees(drafts, head, 24, width, budgets[:requests], -0.2)
    assert together is not None and len(together) == requests
    for draft, budget, got in zip(drafts, budgets, together):
        alone = grow_kernel.grow_supertree(draft, head, 24, width, budget, -0.2)
        for a, b in zip(got, alone):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_builder_grows_a_batch_in_one_compiled_call(monkeypatch):
    head, d2t = make_head("domino", 11, 61, 1)
    drafts = [make_draft(11 + i, 6, 61, d2t) for i in range(4)]
    builder = make_builder("dartree", TreeSettings(budget=16, ngram=False))
    alone = [builder.build_tree(d, head) for d in drafts]
    calls = []
    compiled = grow_kernel.load()

    class Spy:
        def __getattr__(self, name):
            return getattr(compiled, name)

        def grow_supertrees(self, *args):
            calls.append(len(args[0]))
            return compiled.grow_supertrees(*args)

    monkeypatch.setattr(grow_kernel, "load", lambda: Spy())
    from dartree.trees import build_trees

    together = build_trees([builder] * 4, drafts, head, [None] * 4)
    assert calls == [4]
    for a, b in zip(together, alone):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) and torch.equal(a.rank, b.rank)


@pytest.mark.parametrize("reduced", [False, True])
def test_the_root_read_from_the_token_table_is_the_heads_initial_state(reduced):
    head, d2t = make_head("domino", 3, 61 if reduced else None, 1)
    tables = grow_kernel.head_tables(head)
    in_draft = 0
    for bonus in range(TARGET_VOCAB):
        in_draft += int(tables.draft_id[bonus]) >= 0 if bonus < tables.draft_id.numel() else 0
        torch.testing.assert_close(grow_kernel._root(head, tables, bonus), head.initial_state(bonus)[0], rtol=1e-12, atol=1e-12)
    assert in_draft == (61 if reduced else TARGET_VOCAB)  # both ways were taken where the vocabulary is reduced


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["domino", "markov"]), seed=st.integers(0, 10_000), depths=st.integers(1, 8),
       reduced=st.booleans(), pure_prefix=st.integers(0, 2), budget=st.integers(1, 40))
def test_compiled_chain_is_the_python_corrected_chain(kind, seed, depths, reduced, pure_prefix, budget):
    """grow_kernel.corrected_chain: the head-corrected greedy chain's tokens of the Python reference
    (common.corrected_chain_logits), its corrected logits to float64 rounding, and so the same `domino`
    chain and `domino-ddtree` tree node for node; the builders take it."""
    from dartree.trees import common
    from dartree.trees.common import best_first_marginals, corrected_chain_logits

    head, d2t = make_head(kind, seed, 61 if reduced else None, pure_prefix)
    draft = make_draft(seed, depths, 61 if reduced else TARGET_VOCAB, d2t)
    want_tokens, want_logits = corrected_chain_logits(draft, head)
    with pytest.MonkeyPatch.context() as patched:  # a context per example (hypothesis reuses fixtures)
        patched.setattr(common, "corrected_chain_logits", lambda *a: pytest.fail("fell back to the Python chain"))
        tokens, logits = grow_kernel.corrected_chain(draft, head)
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)
    want_tree = best_first_marginals(want_logits.log_softmax(-1), budget)
    for method, want in (("domino", None), ("domino-ddtree", want_tree)):
        built = make_builder(method, TreeSettings(budget=budget)).build(draft, head, budget)
        if want is None:
            assert torch.equal(built.tokens, want_tokens) and torch.equal(built.depths, torch.arange(1, depths + 1))
        else:
            assert torch.equal(built.tokens, want.tokens) and torch.equal(built.parents, want.parents)
            assert torch.equal(built.rank, want.rank)


def test_the_chain_builders_call_the_compiled_chain(monkeypatch):
    from dartree.trees import common

    head, d2t = make_head("domino", 7, 61, 1)
    draft = make_draft(7, 6, 61, d2t)
    calls = []
    real = grow_kernel.corrected_chain
    monkeypatch.setattr(grow_kernel, "corrected_chain", lambda d, h: calls.append(1) or real(d, h))
    monkeypatch.setattr(common, "corrected_chain_logits", lambda *a: pytest.fail("fell back to the Python chain"))
    for method in ("domino", "domino-ddtree"):
        make_builder(method, TreeSettings(budget=8)).build_tree(draft, head)
    assert len(calls) == 2


@settings(max_examples=80, deadline=None)
@given(depths=st.integers(1, 8), vocab=st.integers(1, 12), budget=st.integers(1, 80), dtype=st.sampled_from(["float32", "float64"]),
       seed=st.integers(0, 10_000), coarse=st.booleans())
def test_compiled_best_first_heap_pops_as_the_python_heap(depths, vocab, budget, dtype, seed, coarse):
    """grow_kernel.best_first_marginals: DDTree's best-first tree node for node, scores bit for bit and
    the same pop order as the Python heap (common.best_first_marginals; ties, many of them with coarse
    log-probabilities, by push order), without falling back to it."""
    from dartree.trees import common

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(depths, vocab, generator=gen, dtype=torch.float64)
    if coarse:  # a few distinct values: equal scores everywhere
        logits = (logits * 2).round() / 2
    logprobs = logits.log_softmax(-1).to(getattr(torch, dtype))
    want = common.best_first_marginals(logprobs, budget)
    with pytest.MonkeyPatch.context() as patched:  # a context per example (hypothesis reuses fixtures)
        patched.setattr(common, "best_first_marginals", lambda *a: pytest.fail("fell back to the Python heap"))
        got = grow_kernel.best_first_marginals(logprobs, budget)
    for field in ("tokens", "parents", "depths", "log_probs", "rank"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field


def test_ddtree_builders_take_the_compiled_heap(monkeypatch):
    from dartree.trees import common

    head, d2t = make_head("domino", 9, 61, 1)
    draft = make_draft(9, 6, 61, d2t)
    monkeypatch.setattr(common, "best_first_marginals", lambda *a: pytest.fail("fell back to the Python heap"))
    for method in ("ddtree", "domino-ddtree"):
        assert len(make_builder(method, TreeSettings(budget=8)).build_tree(draft, head)) == 8


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), inner=st.integers(1, 40), cols=st.integers(1, 80), accumulate=st.booleans(),
       seed=st.integers(0, 10_000))
def test_float32_row_products_are_the_in_order_sum_bit_for_bit(rows, inner, cols, accumulate, seed):
    """The head's float32 products (AVX-512 / AVX2 register tiles, or the plain loop, whichever this build
    took) give the bits of y + x[:, 0] w[0] + x[:, 1] w[1] + ... summed in that order, each a product then a
    sum, for any row count and any column count (the tiles' remainders included)."""
    import numpy
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, generator=gen)
    wt = torch.randn(inner, cols, generator=gen)
    y = torch.randn(rows, cols, generator=gen)
    expected = y.numpy().copy() if accumulate else numpy.zeros((rows, cols), dtype=numpy.float32)
    for i in range(inner):  # float32 numpy: each product and each sum correctly rounded, no fused multiply-add
        expected = expected + x.numpy()[:, i:i + 1] * wt.numpy()[i:i + 1, :]
    grow_kernel.load().rows_times_f32(x, wt, y, accumulate)
    assert numpy.array_equal(y.numpy().view(numpy.int32), expected.view(numpy.int32))


@pytest.mark.parametrize("rows, inner, cols", [(12, 256, 768), (1, 64, 8192), (7, 256, 810)])
def test_float32_products_split_over_threads_are_the_in_order_sum(rows, inner, cols):
    """Above ``SPLIT_MACS`` a product called outside a parallel region (one request's tree alone: the GRU's
    hidden product 12 x 256 x 768, the chain's output rows 64 x 8192) splits its columns over two threads;
    each output is still the sum over i in order, bit for bit, and the last columns (810 is no multiple of a
    tile) are summed as before."""
    import numpy
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(rows * inner + cols)
        x = torch.randn(rows, inner, generator=gen)
        wt = torch.randn(inner, cols, generator=gen)
        y = torch.empty(rows, cols)
        expected = numpy.zeros((rows, cols), dtype=numpy.float32)
        for i in range(inner):
            expected = expected + x.numpy()[:, i:i + 1] * wt.numpy()[i:i + 1, :]
        grow_kernel.load().rows_times_f32(x, wt, y, False)
        assert numpy.array_equal(y.numpy().view(numpy.int32), expected.view(numpy.int32))
    finally:
        torch.set_num_threads(previous)


def test_a_tree_alone_on_both_threads_is_its_tree_in_a_batch_at_the_shipped_heads_shapes():
    """The shipped Domino head's sizes (GRU state 256, rank 64, 16 depths, K = 64, W = 12, B = 64) in float32:
    a request's tree grown alone (its products split over the threads) is its tree grown beside others (each
    request on one thread), node for node and bit for bit."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(3)
        vocab, draft_vocab, hidden = 300, 200, 48
        head = DominoHead(hidden, 256, 64, draft_vocab, 1)
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        picks = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
        d2t = picks - torch.arange(draft_vocab)
        head.bind(nn.Embedding.from_pretrained(torch.randn(vocab, hidden, generator=gen)), d2t)
        drafts = [DraftOutput(bonus=int(picks[i]), hidden=torch.randn(16, hidden, generator=gen),
                              base_logits=torch.randn(16, draft_vocab, generator=gen) * 3, d2t=d2t) for i in range(3)]
        together = grow_kernel.grow_supertrees(drafts, head, 64, 12, [64] * 3, 0.0)
        for draft, got in zip(drafts, together):
            alone = grow_kernel.grow_supertree(draft, head, 64, 12, 64, 0.0)
            assert len(alone[0]) >= 64  # the supertree, before its cut to the best B
            for a, b in zip(got, alone):
                assert torch.equal(a, b)
    finally:
        torch.set_num_threads(previous)


@settings(max_examples=60, deadline=None)
@given(depths=st.integers(1, 6), vocab=st.integers(1, 300), k=st.integers(1, 80), rank=st.integers(0, 9),
       dtype=st.sampled_from([torch.float32, torch.float64]), coarse=st.booleans(), nans=st.booleans(), seed=st.integers(0, 10_000))
def test_candidates_are_the_top_k_in_order_with_their_logits_and_output_rows(depths, vocab, k, rank, dtype, coarse, nans, seed):
    """The compiled candidates: each depth's top k base logits, best first, equal logits by the smaller draft id and
    NaN above every number (a stable descending sort's first k), their logits and the head's output rows of them
    transposed; where no logit ties, exactly torch.topk's candidates (candidate_tables, the Python growers')."""
    gen = torch.Generator().manual_seed(seed)
    k = min(k, vocab)
    base = torch.randn(depths, vocab, generator=gen, dtype=dtype)
    if coarse:  # many ties, at the K-th logit too
        base = (base * 2).round()
    if nans:
        base[torch.rand(depths, vocab, generator=gen) < 0.05] = float("nan")
    out_rows = torch.randn(vocab, rank, generator=gen, dtype=dtype)
    tokens, values, rows_t = grow_kernel.load().candidates(base, out_rows, k)
    expected = torch.sort(base, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(tokens, expected)
    assert torch.equal(values.view(-1).view(torch.uint8), base.gather(1, expected).reshape(-1).view(torch.uint8))  # bits: NaN too
    assert rows_t.shape == (depths, rank, k) and torch.equal(rows_t, out_rows[expected].transpose(1, 2))
    if not coarse and not nans:
        assert torch.equal(tokens, base.topk(k, dim=-1).indices)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_hidden_projection_is_the_heads_start_round(dtype):
    """The grower's own W_z z_d (every depth's hidden projection, one compiled call) is DominoHead.start_round's up
    to the order of the sums, and the same bits on every call."""
    head, d2t = make_head("domino", 5, 61, 1)
    head = head.to(dtype)
    head.bind(nn.Embedding.from_pretrained(head._embed.weight.to(dtype)), d2t)
    tables = grow_kernel.head_tables(head)
    draft = make_draft(4, 7, 61, d2t)
    hidden = draft.hidden.to(dtype)
    got = grow_kernel.load().hidden_projection(hidden.contiguous(), tables.w_z_t)
    expected = head.start_round(hidden, draft.base_logits.to(dtype)).hidden_proj
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    assert torch.equal(got, grow_kernel.load().hidden_projection(hidden.contiguous(), tables.w_z_t))
