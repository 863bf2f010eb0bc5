"""Structured output: every method writes exactly constrained greedy decoding (float64 tiny models, a
one-byte-per-token vocabulary the grammar engine reads), whatever shares the batch; bad formats are
refused before decoding; on the default model JSON answers validate against their schemas."""

import json

import pytest
import torch
from conftest import VOCAB
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import byte_grammars

from dartree.errors import DartreeError
from dartree.structured import Constraint, OutputFormat

TOKENS = [b"<eos>", b"a", b"b", b"c", b"{", b"}", b"1", b"2"]  # token 0 ends the text
assert len(TOKENS) == VOCAB
FORMATS = [{"regex": "(ab|c)+"}, {"regex": "a[bc]*1{2,5}"}, {"choice": ["abc", "acb", "ba{12}"]},
           {"grammar": 'start: "{" item ("," item)* "}"\nitem: "a" | "b1" | "c2"'.replace(",", "c")}]
METHODS = ("ar", "dflash", "ddtree", "dartree", "dartree-fixed", "ngram", "ngram-chain")


@pytest.fixture(scope="module")
def grammars():
    return byte_grammars(TOKENS)


def with_grammars(pipe, grammars):
    pipe._grammars = grammars  # the tiny models' word-level tokenizer has no bytes for the grammar engine
    return pipe


def constrained_greedy(model, grammars, fmt, prompt, n):
    """The reference: one full forward per token, the forbidden tokens' logits at -inf, argmax."""
    constraint = Constraint(grammars.compile(OutputFormat.parse(fmt)), VOCAB)
    out = []
    for _ in range(n):
        logits = model(torch.tensor([prompt + out])).logits[0, -1:]
        token = int(constraint.mask(logits, [()]).argmax(-1))
        out.append(token)
        constraint.advance([token])
        if token == 0 or constraint.done:
            break
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6), fmt=st.sampled_from(FORMATS),
       family=st.sampled_from(["llama", "qwen3"]))
def test_every_method_writes_constrained_greedy_decoding(pipelines, grammars, prompt, fmt, family):
    pipe = with_grammars(pipelines[(family, "domino")], grammars)
    want = constrained_greedy(pipe.target_model, grammars, fmt, prompt, 20)
    ar = pipe.generate(input_ids=prompt, method="ar", max_new_tokens=20, response_format=fmt, stop_token_ids=[0])
    assert ar.token_ids == want and ar.stats.finish_reason == ("length" if len(want) == 20 and want[-1] != 0 else "stop")
    text = b"".join(TOKENS[t] for t in want if t != 0).decode()
    if "regex" in fmt and ar.stats.finish_reason == "stop":
        import re
        assert re.fullmatch(fmt["regex"], text), text
    for method in METHODS[1:]:
        for budget in ("auto", 6):
            got = pipe.generate(input_ids=prompt, method=method, max_new_tokens=20, budget=budget, response_format=fmt,
                                stop_token_ids=[0])
            assert got.token_ids == want and got.stats.finish_reason == ar.stats.finish_reason, (method, budget)


def test_forced_tokens_are_accepted_for_free_and_pruned_nodes_cost_no_row(pipelines, grammars):
    """A choice list forces most of its tokens: a speculating method accepts them in few rounds, and no
    verified node ever carries a token the grammar forbids there."""
    pipe = with_grammars(pipelines[("llama", "domino")], grammars)
    fmt = {"choice": ["ab1212121212", "c"]}
    ar = pipe.generate(input_ids=[1, 2], method="ar", max_new_tokens=20, response_format=fmt, stop_token_ids=[0])
    tree = pipe.generate(input_ids=[1, 2], method="dartree", budget=8, max_new_tokens=20, response_format=fmt,
                         stop_token_ids=[0])
    assert tree.token_ids == ar.token_ids and ar.stats.rounds == len(ar.token_ids) - 1  # the first comes with the prompt
    # the first token comes from the prompt's last row ("a" or "c"); every later one is the grammar's only
    # allowed token (the rest of "ab1212121212", then the end), chosen without an output-layer row
    assert ar.stats.output_rows == tree.stats.output_rows == 1, (ar.stats.output_rows, tree.stats.output_rows)
    # a text the grammar fixes from its first token: `ar` computes no output-layer row at all; a tree may verify a
    # row past the text's end (after the end token), whose path the grammar no longer reads: its row is computed
    for method, rows in (("ar", 0), ("dartree", 1)):
        fixed = pipe.generate(input_ids=[1, 2], method=method, budget=8, max_new_tokens=20, response_format={"regex": "ab12c"},
                              stop_token_ids=[0])
        assert fixed.token_ids == [1, 2, 6, 7, 3] and fixed.stats.output_rows <= rows, (method, fixed.stats.output_rows)
    if ar.token_ids[0] == 1:  # "ab1212121212": after "a" the rest is forced
        assert tree.stats.rounds <= 3
    constraint = Constraint(grammars.compile(OutputFormat.parse({"regex": "(ab|c)+"})), VOCAB)
    from dartree.trees import DraftTree
    drafted = DraftTree.from_lists([1, 3, 2, 1, 6], [0, 0, 1, 3, 0], [1, 1, 2, 3, 1])  # "a", "c", "ab", "aba", "1"
    drafted.log_probs = torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.05], dtype=torch.float64)
    drafted.rank = torch.tensor([4, 0, 1, 2, 3])
    pruned = constraint.prune(drafted)
    assert pruned.paths() == {(1,), (3,), (1, 2), (1, 2, 1)} and pruned.rank.tolist() == [0, 1, 2, 3]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6), fmt=st.sampled_from(FORMATS),
       method=st.sampled_from(METHODS), temperature=st.sampled_from([0.0, 1.0]))
def test_the_reference_round_skips_the_same_output_rows_under_a_grammar(pipelines, grammars, prompt, fmt, method,
                                                                       temperature):
    """Where the grammar allows one token the round takes it without the output layer's row, in the batched
    round as in the reference round: the same tokens, the same rounds, the same output-layer rows (at T = 0 and
    at T > 0, where a point mass is sampled as its token whatever the draw)."""
    from dartree.engine import run_alone, run_reference
    from dartree.settings import GenerationSettings

    pipe = with_grammars(pipelines[("llama", "domino")], grammars)
    settings_ = GenerationSettings.from_kwargs(None, method=method, budget=6, temperature=temperature, seed=1,
                                               max_new_tokens=16).validate()
    batched, reference = (pipe.request(torch.tensor(prompt), settings_, [0], alone=False, response_format=fmt)
                          for _ in range(2))
    run_alone(pipe.target, batched)
    run_reference(pipe.target, reference)
    assert reference.output == batched.output
    for stat in ("acceptance_lengths", "tree_sizes", "rounds", "output_rows"):
        assert getattr(reference.stats, stat) == getattr(batched.stats, stat), stat


def test_a_constrained_request_and_free_ones_share_rounds_each_as_alone(pipelines, grammars):
    pipe = with_grammars(pipelines[("qwen3", "markov")], grammars)
    from dartree.settings import GenerationSettings
    from dartree.trees import TreeSettings

    settings_ = GenerationSettings(method="dartree", max_new_tokens=16, tree=TreeSettings(budget=8))
    asks = [([1, 2, 3], FORMATS[0]), ([4, 5], None), ([6, 1], FORMATS[1]), ([2, 2], None)]
    alone = [pipe.generate(input_ids=p, settings=settings_, response_format=f, stop_token_ids=[0]).token_ids for p, f in asks]
    engine = pipe.engine(4)
    requests = [pipe.request(torch.tensor(p), settings_, [0], alone=False, response_format=f) for p, f in asks]
    for r in requests:
        engine.submit(r)
    engine.run()
    assert [r.output for r in requests] == alone


@pytest.mark.parametrize("fmt, message", [
    ({"regex": "(ab"}, "the regex does not compile"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "invalid"),
    ({"grammar": "start: nothing_defined_here"}, "invalid grammar"),
    ({"type": "json_schema"}, "needs a 'json_schema' object"),
    ({"type": "xml"}, "unsupported response_format type"),
    ({"regex": "a", "choice": ["b"]}, "give one structured output format"),
    ({"choice": []}, "non-empty list"),
])
def test_bad_formats_are_refused_before_decoding(pipelines, grammars, fmt, message):
    pipe = with_grammars(pipelines[("llama", "domino")], grammars)
    with pytest.raises(DartreeError, match=message):
        pipe.generate(input_ids=[1], method="dartree", max_new_tokens=4, response_format=fmt)


def test_openai_and_vllm_spellings_name_the_same_format():
    from pydantic import BaseModel

    from dartree.server.protocol import RequestError, structured_format

    class Person(BaseModel):
        name: str
        age: int

    schema = Person.model_json_schema()
    same = [OutputFormat.parse(Person), OutputFormat.parse(schema),
            OutputFormat.parse({"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}),
            OutputFormat.parse(structured_format({"guided_json": schema})),
            OutputFormat.parse(structured_format({"json_schema": schema})),
            OutputFormat.parse(structured_format({"structured_outputs": {"json": schema}}))]
    assert all(f == same[0] for f in same) and same[0].kind == "json_schema"
    assert OutputFormat.parse(structured_format({"guided_choice": ["x", "y"]})).kind == "choice"
    assert structured_format({"response_format": {"type": "text"}}) is None
    with pytest.raises(RequestError, match="give one structured output format"):
        structured_format({"guided_regex": "a", "response_format": {"type": "json_object"}})


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3}}, "required": ["colors"]},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {"name": {"type": "string"},
                                                                                  "population": {"type": "number"}},
                                               "required": ["name", "population"]}}, "required": ["city"]},
]


@pytest.fixture(scope="module")
def default_pipe():
    import dartree

    return dartree.load()


@pytest.mark.slow
@pytest.mark.parametrize("schema", SCHEMAS)
def test_the_default_model_answers_valid_json_with_every_method_alike(default_pipe, schema):
    import jsonschema

    messages = [{"role": "user", "content": "Answer in JSON: describe something from everyday life."}]
    ar = default_pipe.generate(messages=messages, method="ar", max_new_tokens=64, response_format=schema)
    assert ar.stats.finish_reason == "stop"
    jsonschema.validate(json.loads(ar.text), schema)
    for method in ("dartree", "ngram", "ddtree"):
        got = default_pipe.generate(messages=messages, method=method, max_new_tokens=64, response_format=schema)
        assert got.token_ids == ar.token_ids, method


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(paths=st.lists(st.lists(st.integers(1, VOCAB - 1), max_size=5).map(tuple), min_size=1, max_size=6),
       fmt=st.sampled_from(FORMATS))
def test_masks_of_many_rows_are_each_rows_own(grammars, paths, fmt):
    """Rows masked together (the grammar rolled back only as far as their paths differ) get what each
    gets alone, and the committed state is left as it was."""
    compiled = OutputFormat.parse(fmt)
    together = Constraint(grammars.compile(compiled), VOCAB)
    logits = torch.randn(len(paths), VOCAB, dtype=torch.float64)
    got = together.mask(logits, paths)
    for i, path in enumerate(paths):
        alone = Constraint(grammars.compile(compiled), VOCAB)
        assert torch.equal(got[i], alone.mask(logits[i:i + 1], [path])[0])
    assert torch.equal(together.mask(logits[:1], [()]), Constraint(grammars.compile(compiled), VOCAB).mask(logits[:1], [()]))


def test_the_draft_is_steered_where_every_branch_shares_the_grammar_state(grammars):
    """``Constraint.steer``: the forced run's depths keep only the forced token, the depth after it only the
    tokens the grammar allows there (the engine's own masks), deeper depths are untouched; where the
    drafter's vocabulary lacks a forced token the steering stops before it; the constraint's state is as
    before."""
    from dartree.drafter import DraftOutput
    from dartree.structured import STEER_PENALTY

    torch.manual_seed(0)
    constraint = Constraint(grammars.compile(OutputFormat.parse({"choice": ["ab12", "c"]})), VOCAB)
    base = torch.randn(6, VOCAB)
    root = constraint.steer(DraftOutput(bonus=1, hidden=torch.zeros(6, 4), base_logits=base))  # "a" or "c": no forced run
    allowed = constraint.mask(torch.zeros(1, VOCAB), [()])[0] == 0
    assert allowed.tolist() == [t in (1, 3) for t in range(VOCAB)]
    assert torch.equal(root.base_logits[0], base[0] - STEER_PENALTY * (~allowed).float())
    assert torch.equal(root.base_logits[1:], base[1:])
    constraint.advance([1])  # "a": the rest, "b12", is forced
    assert constraint.forced() == [2, 6, 7]
    steered = constraint.steer(DraftOutput(bonus=1, hidden=torch.zeros(6, 4), base_logits=base))
    assert steered.base_logits[:3].argmax(-1).tolist() == [2, 6, 7]
    assert (steered.base_logits[:3].topk(2).values[:, 1] < base.min() - STEER_PENALTY / 2).all()
    after = constraint.mask(torch.zeros(1, VOCAB), [(2, 6, 7)])[0] == 0
    assert not after.all()
    assert torch.equal(steered.base_logits[3], base[3] - STEER_PENALTY * (~after).float())
    assert torch.equal(steered.base_logits[4:], base[4:]) and constraint.forced() == [2, 6, 7]
    # a reduced draft vocabulary without "1" (draft ids 0..4 are target ids 0, 1, 2, 3, 7): only "b" is steered
    d2t = torch.tensor([0, 0, 0, 0, 3])
    reduced = constraint.steer(DraftOutput(bonus=1, hidden=torch.zeros(6, 4), base_logits=base[:, :5], d2t=d2t))
    assert reduced.base_logits[0].argmax() == 2 and torch.equal(reduced.base_logits[1:], base[1:, :5])
    # a proposal holding a draft (the drafter with the n-gram tree) is steered the same way
    from dartree.proposers.combined import DraftAndNgram
    from dartree.trees import DraftTree
    both = constraint.steer(DraftAndNgram(DraftOutput(bonus=1, hidden=torch.zeros(6, 4), base_logits=base), DraftTree.empty()))
    assert torch.equal(both.draft.base_logits, steered.base_logits)
