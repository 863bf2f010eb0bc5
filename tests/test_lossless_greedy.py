"""Temperature 0: every method reproduces Hugging Face greedy decoding token for token."""

import pytest
from conftest import FAMILIES, HEADS, VOCAB, hf_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dartree.trees import BUILDERS
from dartree.trees import METHODS as ALL_METHODS

# methods whose trees come from the drafter (the n-gram methods' own cases: tests/test_ngram.py)
TREE_METHODS = tuple(m for m, b in BUILDERS.items() if "budget" in b.reads and b.proposer == "drafter")
DRAFT_METHODS = tuple(m for m, b in BUILDERS.items() if b.proposer is not None)
HF_CACHE = {}


def reference(pipe, family, prompt, n):
    key = (family, tuple(prompt), n)
    if key not in HF_CACHE:
        HF_CACHE[key] = hf_greedy(pipe.target_model, prompt, n)
    return HF_CACHE[key]


prompts = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=7)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head", HEADS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=prompts,
    budget=st.sampled_from([1, 3, 8, 16]),
    width=st.sampled_from([1, 3, 12]),
    tree_top_k=st.sampled_from([2, 8, 64]),
    seed=st.integers(0, 2**16),
)
def test_every_method_matches_hf_greedy(pipelines, family, head, prompt, budget, width, tree_top_k, seed):
    pipe = pipelines[(family, head)]
    want = reference(pipe, family, prompt, 20)
    for method in pipe.methods:
        got = pipe.generate(input_ids=prompt, method=method, max_new_tokens=20, budget=budget, width=width,
                            tree_top_k=tree_top_k, seed=seed, stop_token_ids=[])
        assert got.token_ids == want, f"{method} diverged from greedy decoding"
        assert sum(got.stats.acceptance_lengths) >= len(want) - 1


def test_all_methods_are_exercised(pipelines):
    assert set(pipelines[("llama", "domino")].methods) == set(ALL_METHODS)
    assert set(pipelines[("llama", "markov")].methods) == set(ALL_METHODS)
    assert set(pipelines[("llama", None)].methods) == {"ar", "dflash", "ddtree", "ngram", "ngram-chain"}
    # the registry holds the published method names (part of the public contract)
    assert ALL_METHODS == ("ar", "dflash", "domino", "ddtree", "domino-ddtree", "heap", "dartree", "dartree-fixed",
                           "ngram", "ngram-chain")


@pytest.mark.parametrize("family", FAMILIES)
def test_trees_accept_several_tokens_per_round(pipelines, family):
    """The exactness tests above mean little if no draft is ever accepted: check they are."""
    pipe = pipelines[(family, "domino")]
    for method in ("ddtree", "dartree", "heap"):
        best = max(
            max(pipe.generate(input_ids=[p, (p + 3) % VOCAB], method=method, max_new_tokens=30, budget=16,
                              stop_token_ids=[]).stats.acceptance_lengths)
            for p in range(VOCAB)
        )
        assert best >= 3, method


def _round_with_long_acceptance(pipe, method, prompts, n):
    """Find (prompt, tokens, offset) where one round committed >= 3 tokens, the middle one fresh."""
    for prompt in prompts:
        res = pipe.generate(input_ids=prompt, method=method, max_new_tokens=n, budget=16, stop_token_ids=[])
        pos = 1  # first token comes from prefill
        for tau in res.stats.acceptance_lengths:
            if tau >= 3 and pos + 1 < n:
                mid = pos + 1  # strictly inside the accepted run
                if res.token_ids[mid] not in res.token_ids[:mid]:
                    return prompt, res.token_ids, mid
            pos += tau
    return None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", TREE_METHODS)
def test_stop_token_inside_an_accepted_run(pipelines, family, method):
    pipe = pipelines[(family, "domino")]
    prompts = [[a, b] for a in range(VOCAB) for b in range(VOCAB)]
    found = _round_with_long_acceptance(pipe, method, prompts, 30)
    assert found is not None, "no round accepted 3+ tokens with a fresh token inside"
    prompt, tokens, mid = found
    stop = tokens[mid]
    got = pipe.generate(input_ids=prompt, method=method, max_new_tokens=30, budget=16, stop_token_ids=[stop])
    assert got.token_ids == tokens[: mid + 1]
    assert got.token_ids == hf_greedy(pipe.target_model, prompt, 30, eos=stop)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method", DRAFT_METHODS)
def test_max_new_tokens_reached_mid_tree(pipelines, family, method):
    pipe = pipelines[(family, "domino")]
    prompts = [[a, b] for a in range(VOCAB) for b in range(VOCAB)]
    for prompt in prompts:
        full = pipe.generate(input_ids=prompt, method=method, max_new_tokens=30, budget=16, stop_token_ids=[])
        pos = 1
        for tau in full.stats.acceptance_lengths:
            if tau >= 2:
                limit = pos + 1  # ends inside this round's accepted run
                got = pipe.generate(input_ids=prompt, method=method, max_new_tokens=limit, budget=16, stop_token_ids=[])
                assert got.token_ids == full.token_ids[:limit] == hf_greedy(pipe.target_model, prompt, limit)
                assert len(got.token_ids) == limit
                return
            pos += tau
    pytest.fail("no round accepted 2+ tokens")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head", HEADS)
def test_one_token_prompt(pipelines, family, head):
    pipe = pipelines[(family, head)]
    for token in range(VOCAB):
        want = hf_greedy(pipe.target_model, [token], 12)
        for method in pipe.methods:
            assert pipe.generate(input_ids=[token], method=method, max_new_tokens=12, budget=8,
                                 stop_token_ids=[]).token_ids == want, method


def test_drafter_with_mask_embedding_and_text_prompt(model_dirs, tmp_path):
    import torch
    from tiny import make_tiny_drafter

    import dartree

    target = model_dirs[("llama", "target")]
    drafter = make_tiny_drafter(tmp_path / "d", target, head="domino", use_mask_embedding=True)
    pipe = dartree.load(target, drafter, dtype=torch.float64)
    prompt = "w1 w2 w3"
    ids = pipe.encode(prompt=prompt).tolist()
    want = hf_greedy(pipe.target_model, ids, 10)
    for method in pipe.methods:
        res = pipe.generate(prompt, method=method, max_new_tokens=10, stop_token_ids=[])
        assert res.token_ids == want
        assert res.text == pipe.tokenizer.decode(want, skip_special_tokens=True)


class RecordingStreamer:
    """Hugging Face streamer protocol: put(tensor) for the prompt, then for new tokens; end() once."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, max_new_tokens=st.integers(1, 25), stop=st.one_of(st.none(), st.integers(0, VOCAB - 1)),
       temperature=st.sampled_from([0.0, 1.0]))
def test_streamer_gets_exactly_the_output_round_by_round(pipelines, family, prompt, max_new_tokens, stop, temperature):
    pipe = pipelines[(family, "domino")]
    for method in pipe.methods:
        streamer = RecordingStreamer()
        res = pipe.generate(input_ids=prompt, method=method, max_new_tokens=max_new_tokens, budget=8,
                            temperature=temperature, stop_token_ids=[] if stop is None else [stop], streamer=streamer)
        assert streamer.puts[0] == [prompt] and streamer.ended == 1
        chunks = streamer.puts[1:]
        assert [t for c in chunks for t in c] == res.token_ids, method
        assert all(chunks) and len(chunks) <= res.stats.rounds + 1  # the prefill's token, then one chunk a round


def test_streamer_without_put_and_end_is_refused(pipelines):
    from dartree import DartreeError

    with pytest.raises(DartreeError, match="streamer must have put"):
        pipelines[("llama", "domino")].generate(input_ids=[1, 2], max_new_tokens=3, streamer=object())


@pytest.fixture(scope="module")
def reduced_vocab_pipelines(model_dirs, tmp_path_factory):
    """Drafters with a reduced output vocabulary (own lm_head over 5 of the 8 target ids + d2t)."""
    import torch
    from tiny import make_tiny_drafter

    import dartree

    root = tmp_path_factory.mktemp("reduced")
    out = {}
    for family in FAMILIES:
        for head in HEADS:
            d = make_tiny_drafter(root / f"{family}-{head}", model_dirs[(family, "target")], head=head, block_size=6,
                                  seed=7, draft_vocab=5)
            out[(family, head)] = dartree.load(model_dirs[(family, "target")], d, dtype=torch.float64)
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("head", HEADS)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, budget=st.sampled_from([1, 4, 16]), tree_top_k=st.sampled_from([2, 64]))
def test_reduced_draft_vocabulary_matches_hf_greedy(reduced_vocab_pipelines, family, head, prompt, budget, tree_top_k):
    pipe = reduced_vocab_pipelines[(family, head)]
    assert pipe.drafter.config.draft_vocab_size == 5
    want = reference(pipe, family, prompt, 20)
    for method in pipe.methods:
        got = pipe.generate(input_ids=prompt, method=method, max_new_tokens=20, budget=budget, tree_top_k=tree_top_k,
                            stop_token_ids=[])
        assert got.token_ids == want, f"{method} diverged from greedy decoding with a reduced draft vocabulary"


def test_reduced_vocabulary_trees_hold_target_ids_of_the_draft_vocabulary(reduced_vocab_pipelines):
    """Trees are built over draft ids and handed on as target ids from the draft vocabulary only."""
    import torch

    from dartree.trees import TreeSettings, make_builder

    pipe = reduced_vocab_pipelines[("llama", "domino")]
    allowed = set(pipe.drafter.draft_to_target(torch.arange(5)).tolist())
    assert len(allowed) == 5 and allowed != set(range(5))  # the mapping is not the identity
    ids = torch.tensor([1, 2, 3])
    from dartree.targets import prefill

    pipe.target.capture = True  # (a drafter-free method run before leaves it off)
    _, features = prefill(pipe.target, ids)
    pipe.proposer.reset()
    draft = pipe.proposer.draft(4, features, 3)
    assert draft.base_logits.shape[-1] == 5
    for method in ("dflash", "ddtree", "domino", "heap", "dartree"):
        tree = make_builder(method, TreeSettings(budget=16)).build_tree(draft, pipe.head)
        assert len(tree) > 0 and set(tree.tokens.tolist()) <= allowed, method


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 70), dtype=st.sampled_from(["float32", "float64"]),
       values=st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan"), 1e-30]),
                       min_size=1, max_size=350),
       transposed=st.booleans())
def test_the_samplers_argmax_is_torchs(rows, width, dtype, values, transposed):
    """``verify.argmax_rows`` (numpy's argmax on the CPU) picks torch's index on every row: the first of equal
    maxima, a NaN wherever torch picks one, -inf rows at 0, float32 and float64, a non-contiguous view."""
    import torch

    from dartree.verify import argmax_rows

    flat = torch.tensor((values * (rows * width // len(values) + 1))[:rows * width], dtype=getattr(torch, dtype))
    logits = flat.view(width, rows).t() if transposed else flat.view(rows, width)
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
