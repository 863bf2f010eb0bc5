"""The batched engine: requests joining and leaving between rounds, one forward over all of them,
each request's text equal to the text it gets alone (T = 0 and T > 0, float64 and float32), a
cancelled request's text a prefix of it, and the round's finish reasons."""

import pytest
import torch
from conftest import synthetic_cost
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dartree
from dartree.drafter import DrafterCache
from dartree.engine import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP
from dartree.targets import LeanTarget
from dartree.settings import GenerationSettings
from dartree.trees import available_methods

METHODS = available_methods(True, True)


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["fp64", "fp32"])
def lean_pipe(request, model_dirs):
    pipe = dartree.load(model_dirs[("llama", "target")], model_dirs[("llama", "domino")], dtype=request.param)
    assert isinstance(pipe.target, LeanTarget)
    pipe.use_cost_model(synthetic_cost(1.0, 0.05, draft_ms=0.5, tree_ms=0.2))  # speculation pays, but not without limit
    return pipe


request_strategy = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(0, 7), min_size=1, max_size=10),
    "method": st.sampled_from(METHODS),
    "budget": st.sampled_from([3, 12, "auto"]),
    "max_new_tokens": st.integers(1, 20),
    "temperature": st.sampled_from([0.0, 0.0, 1.0]),
    "seed": st.integers(0, 5),
    "join": st.integers(0, 6),  # the round before which it is submitted
    "cancel": st.one_of(st.none(), st.integers(1, 8)),  # the round after which its client goes away
})


def _settings(spec) -> GenerationSettings:
    return GenerationSettings.from_kwargs(None, method=spec["method"], budget=spec["budget"], seed=spec["seed"],
                                          max_new_tokens=spec["max_new_tokens"], temperature=spec["temperature"]).validate()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(request_strategy, min_size=1, max_size=6), max_batch=st.integers(1, 4))
def test_a_request_gets_its_text_alone_whatever_shares_its_rounds(lean_pipe, specs, max_batch):
    pipe = lean_pipe
    alone = [pipe.generate(input_ids=s["prompt"], settings=_settings(s), stop_token_ids=[]).token_ids for s in specs]
    engine = pipe.engine(max_batch)
    streamed = [[] for _ in specs]
    cancelled = [False] * len(specs)
    requests = [pipe.request(torch.tensor(s["prompt"]), _settings(s), [], on_tokens=streamed[i].extend,
                             cancelled=lambda i=i: cancelled[i], alone=False) for i, s in enumerate(specs)]
    step = 0
    while step <= 6 or engine.busy:
        for i, s in enumerate(specs):
            if s["join"] == step:
                engine.submit(requests[i])
            if s["cancel"] == step:
                cancelled[i] = True
        engine.step()
        assert len(engine.active) <= max_batch
        step += 1
        assert step < 500
    for spec, r, ref, got in zip(specs, requests, alone, streamed):
        assert r.finished and got == r.output
        if r.stats.finish_reason == FINISH_CANCELLED:
            assert r.output == ref[:len(r.output)]
        else:
            assert r.stats.finish_reason == FINISH_LENGTH and r.output == ref, spec
    assert max(engine.batch_sizes, default=0) <= max_batch


def test_requests_share_forwards_and_finish_with_their_reasons(lean_pipe):
    """Four requests in one engine: every round is one target forward over all active requests;
    a stop token, the length limit and a cancellation each end a request with its own reason."""
    pipe = lean_pipe
    settings_ = _settings({"method": "dartree", "budget": 8, "seed": 0, "max_new_tokens": 12, "temperature": 0.0})
    prompts = [[1, 2, 3], [4], [5, 6, 7, 0, 1], [2, 2]]
    refs = [pipe.generate(input_ids=p, settings=settings_, stop_token_ids=[]).token_ids for p in prompts]
    stop_token = refs[0][3]
    flag = {"cancel": False}
    forwards = []
    original = pipe.target.forward_parts
    pipe.target.forward_parts = lambda parts: forwards.append(len(parts)) or original(parts)
    try:
        engine = pipe.engine(4)
        reqs = [pipe.request(torch.tensor(prompts[0]), settings_, [stop_token], alone=False)]
        reqs += [pipe.request(torch.tensor(p), settings_, [], alone=False) for p in prompts[1:3]]
        reqs.append(pipe.request(torch.tensor(prompts[3]), settings_, [], cancelled=lambda: flag["cancel"], alone=False))
        for r in reqs:
            engine.submit(r)
        engine.step()
        flag["cancel"] = True
        engine.run()
    finally:
        pipe.target.forward_parts = original
    assert forwards[0] == 4 and max(forwards) == 4 and len(forwards) == engine.rounds
    first_stop = refs[0].index(stop_token)
    assert reqs[0].output == refs[0][:first_stop + 1] and reqs[0].stats.finish_reason == FINISH_STOP
    assert reqs[1].output == refs[1] and reqs[1].stats.finish_reason == FINISH_LENGTH
    assert reqs[2].output == refs[2]
    assert reqs[3].stats.finish_reason == FINISH_CANCELLED and reqs[3].output == refs[3][:len(reqs[3].output)]
    assert engine.free == [0, 1, 2, 3] and not engine.busy


def test_a_long_prompt_is_prefilled_in_chunks_beside_decoding_requests(lean_pipe):
    """A prompt joining busy rounds goes in PREFILL_ROWS_BESIDE_DECODING rows a round, so the
    others' tokens keep coming; its text is still its text alone."""
    from dartree.engine import PREFILL_ROWS_BESIDE_DECODING

    pipe = lean_pipe
    settings_ = _settings({"method": "ar", "budget": 8, "seed": 0, "max_new_tokens": 30, "temperature": 0.0})
    long_prompt = [(3 * i + 1) % 8 for i in range(2 * PREFILL_ROWS_BESIDE_DECODING + 5)]
    ref_long = pipe.generate(input_ids=long_prompt, settings=settings_, stop_token_ids=[]).token_ids
    ref_short = pipe.generate(input_ids=[1, 2], settings=settings_, stop_token_ids=[]).token_ids
    engine = pipe.engine(2)
    short = pipe.request(torch.tensor([1, 2]), settings_, [], alone=False)
    long = pipe.request(torch.tensor(long_prompt), settings_, [], alone=False)
    engine.submit(short)
    engine.step()
    engine.submit(long)
    progress = []
    while long.prefilling:
        engine.step()
        progress.append((long.prefilled, len(short.output)))
    assert [p for p, _ in progress] == [64, 128, 133]
    assert [n for _, n in progress] == [2, 3, 4]  # the short request committed a token every round
    engine.run()
    assert long.output == ref_long and short.output == ref_short


def _two_good_and_one_bad(pipe):
    """``dartree`` requests of one prompt on a 3-request engine: its greedy tokens, the engine, two
    requests to leave intact and one to break."""
    settings_ = _settings({"method": "dartree", "budget": 8, "seed": 0, "max_new_tokens": 10, "temperature": 0.0})
    ref = pipe.generate(input_ids=[3, 1], settings=settings_, stop_token_ids=[]).token_ids
    good = [pipe.request(torch.tensor([3, 1]), settings_, [], alone=False) for _ in range(2)]
    return ref, pipe.engine(3), good, pipe.request(torch.tensor([3, 1]), settings_, [], alone=False)


def _drafter_proposer(request):
    """The request's drafter proposer, inside the drafter + n-gram pair where ``ngram`` is on."""
    return getattr(request.proposer, "drafter", request.proposer)


def test_a_request_that_fails_ends_alone_and_the_others_go_on(lean_pipe):
    ref, engine, good, bad = _two_good_and_one_bad(lean_pipe)

    class BrokenCache(DrafterCache):  # every drafter call of this request fails, alone or batched
        @property
        def length(self):
            raise RuntimeError("drafter broke")

    drafter = _drafter_proposer(bad)
    drafter.reset = lambda: setattr(drafter, "cache", BrokenCache(1))
    for r in (good[0], bad, good[1]):
        engine.submit(r)
    engine.run()
    assert bad.stats.finish_reason == "error" and "drafter broke" in str(bad.error)
    assert [r.output for r in good] == [ref, ref]


def test_a_batched_proposer_call_that_fails_is_retried_alone_and_only_its_request_ends(lean_pipe):
    """A request whose drafter works on its first call (alone) and breaks once batched: the batch's call
    fails, each request is proposed for again alone with the states it had not read, and only the
    broken one ends."""
    ref, engine, good, bad = _two_good_and_one_bad(lean_pipe)

    class BreaksOnceFilled(DrafterCache):
        @property
        def length(self):
            if self.keys[0] is not None:
                raise RuntimeError("drafter broke")
            return 0

    drafter = _drafter_proposer(bad)
    drafter.reset = lambda: (setattr(drafter, "cache", BreaksOnceFilled(1)), setattr(drafter, "unread", []))
    for r in (good[0], bad, good[1]):
        engine.submit(r)
    engine.run()
    assert bad.stats.finish_reason == "error" and "drafter broke" in str(bad.error)
    assert [r.output for r in good] == [ref, ref] and all(r.error is None for r in good)


def test_a_forward_grows_the_store_for_the_widest_part_beside_a_nearly_full_slot(lean_pipe):
    """Rows see ``width`` new rows after their own slot's length: a one-row step in a nearly full slot
    beside a prompt chunk needs room for the chunk's width there too."""
    from dartree.engine import Part
    from dartree.targets.lean import KVStore

    target = LeanTarget(lean_pipe.target_model, lean_pipe.target.tapped_layers, weights=lean_pipe.target.weights)
    target.store = KVStore(target.weights, slots=2, capacity=16)
    target.store.lengths = [14, 0]
    chunk = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0])
    parts = [Part(0, torch.tensor([3]), torch.zeros(1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool)),
             Part(1, chunk, torch.arange(8), torch.ones(8, 8, dtype=torch.bool).tril())]
    together = target.forward_parts(parts)
    assert target.store.capacity >= 14 + 8 and target.store.lengths == [15, 8]
    alone = LeanTarget(lean_pipe.target_model, lean_pipe.target.tapped_layers, weights=lean_pipe.target.weights)
    alone.reserve_slots(2)
    assert torch.equal(alone.forward_parts([parts[1]])[0][0], together[1][0])


def _drafted_by_batch(pipe, engine, requests) -> list[tuple[int, bool, int]]:
    """Run ``requests`` in ``engine``; per request-round: (requests in the round, drafted?, the
    request's drafted rounds before it)."""
    for r in requests:
        engine.submit(r)
    seen = []
    while engine.busy:
        active = list(engine.active) + list(engine.waiting)[:engine.max_batch - len(engine.active)]
        before = {id(r): len(r.stats.drafted) for r in active}
        engine.step()
        for r in active:
            if len(r.stats.drafted) > before[id(r)]:
                seen.append((len(active), r.stats.drafted[-1], sum(r.stats.drafted[:-1])))
    return seen


def test_a_batch_skips_the_drafter_where_it_cannot_pay_and_drafts_where_it_can(lean_pipe):
    """Where a drafter call costs 50 one-row forwards, requests in a batch do not call it after
    their first drafted round (which makes their estimate; ``budget.plan_drafting``); where it is
    nearly free, they keep drafting in the batch. Either way each text is its text alone. The engine
    with measured costs reports every round's forward to its cost model."""
    pipe = lean_pipe
    prompts = [[1, 2, 3], [4, 5], [6, 0, 1, 2], [3, 3]]
    # 40 tokens: long enough that a request's own back-off would probe the drafter again in the batch
    settings_ = _settings({"method": "dartree", "budget": "auto", "seed": 0, "max_new_tokens": 40, "temperature": 0.0})
    cheap = pipe.cost_model()
    try:
        nearly_free = synthetic_cost(1.0, 0.001, draft_ms=0.001, tree_ms=0.001)
        for cost, expect_drafting in ((synthetic_cost(1.0, 0.05, draft_ms=50.0, tree_ms=20.0), False), (nearly_free, True)):
            pipe.use_cost_model(cost)
            refs = [pipe.generate(input_ids=p, settings=settings_, stop_token_ids=[]).token_ids for p in prompts]
            pipe.use_cost_model(cost)  # the batch starts with no estimates: each request's first round drafts
            engine = pipe.engine(4, measured_costs=True)
            requests = [pipe.request(torch.tensor(p), settings_, [], alone=False) for p in prompts]
            seen = _drafted_by_batch(pipe, engine, requests)
            assert [r.output for r in requests] == refs
            in_batch_after_first = [drafted for n, drafted, before in seen if n > 1 and before > 0]
            assert in_batch_after_first and any(in_batch_after_first) == expect_drafting
            # every forward is reported; a drafter call only where it was batched after a first one, or where a
            # request left alone at the end probes on its own back-off schedule
            lone_probes = sum(1 for n, drafted, before in seen if n == 1 and drafted and before > 0)
            assert engine.costs.observed["verify"] == engine.rounds
            assert engine.costs.observed["draft"] > lone_probes if expect_drafting else engine.costs.observed["draft"] == lone_probes
            assert all(r.policy.cost is engine.costs for r in requests)
    finally:
        pipe.use_cost_model(cheap)


@pytest.mark.parametrize("prompt", [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4], [5, 6, 5, 6, 5, 6, 5, 6], [7, 0, 2, 7, 0, 2]])
def test_rounds_without_a_drafter_call_still_verify_the_text_repeats(lean_pipe, prompt):
    """Where a drafter call costs 50 one-row forwards, budget auto backs off from drafting; its rounds
    without a call still verify the n-gram tree (``free_proposals``: no call), so where the text
    repeats they accept more than one token; the output is greedy decoding's, and the reference round
    runs the same rounds (trees, acceptances, which rounds drafted)."""
    from dartree.engine import run_alone, run_reference

    pipe = lean_pipe
    cheap = pipe.cost_model()
    try:
        pipe.use_cost_model(synthetic_cost(1.0, 0.05, draft_ms=50.0, tree_ms=20.0))
        settings_ = _settings({"method": "dartree", "budget": "auto", "seed": 0, "max_new_tokens": 48, "temperature": 0.0})
        ar = pipe.generate(input_ids=prompt, method="ar", max_new_tokens=48, stop_token_ids=[]).token_ids
        got = pipe.generate(input_ids=prompt, settings=settings_, stop_token_ids=[])
        assert got.token_ids == ar
        s = got.stats
        free = [(n, a) for d, n, a in zip(s.drafted, s.tree_sizes, s.acceptance_lengths) if not d]
        assert len(free) > len(s.drafted) // 2  # the drafter call does not pay: most rounds make none
        assert any(a > 1 for n, a in free) and all(a <= n + 1 for n, a in free)
        batched, reference = (pipe.request(torch.tensor(prompt), settings_, stop_token_ids=[], alone=False) for _ in range(2))
        shared = pipe.budget_policy(settings_)
        start = (shared.start_plain, shared.start_lost)
        run_alone(pipe.target, batched)
        shared.start_plain, shared.start_lost = start  # the reference starts as deep in the back-off as the batched one did
        run_reference(pipe.target, reference)
        assert reference.output == batched.output == ar
        for stat in ("acceptance_lengths", "tree_sizes", "drafted"):
            assert getattr(reference.stats, stat) == getattr(batched.stats, stat), stat
    finally:
        pipe.use_cost_model(cheap)
