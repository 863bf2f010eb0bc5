"""Replay gives the decoder's own per-round acceptance lengths at T = 0, without target forwards."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FAMILIES, HEADS, VOCAB
from dartree.errors import DartreeError
from dartree.bench.replay import replay
from dartree.trees import TreeSettings, make_builder


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
    settings_ = TreeSettings(budget=budget, width=3, top_k=8)
    methods = [m for m in pipe.methods if m != "ar"]
    greedy = None
    if hand_over:  # the bench hands over ar's own (stopped) output; replay extends it itself
        greedy = pipe.generate(input_ids=prompt, method="ar", max_new_tokens=max_new, stop_token_ids=stop).token_ids
    ids = pipe.encode(input_ids=prompt)
    output, lengths = replay(pipe, ids, {m: make_builder(m, settings_) for m in methods}, max_new, set(stop), greedy)
    for m in methods:
        got = pipe.generate(input_ids=prompt, method=m, max_new_tokens=max_new, budget=budget, width=3, top_k=8,
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
    with pytest.raises(DartreeError, match="drafter methods"):
        replay(pipe, torch.tensor([1, 2]), {"ar": make_builder("ar")}, 8, set())
