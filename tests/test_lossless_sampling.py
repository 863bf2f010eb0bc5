"""Temperature 1: the joint distribution of the first generated tokens is the target's own.

t1 comes from the prefill; t2 and t3 come from the first draft round (the root's sample, then the
sample at the accepted child), so the joint of (t1, t2, t3) checks the acceptance rule itself.
"""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import byte_grammars, make_tiny_drafter, make_tiny_target

import dartree
from dartree.trees import HEAD_METHODS
from dartree.verify import Sampler

VOCAB = 4
PROMPT = [1, 2]
SAMPLES = 2000
P_VALUE_Z = 3.719  # one-sided normal quantile for p = 1e-4


@pytest.fixture(scope="module")
def small_pipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinyvocab")
    target = make_tiny_target(root / "t", vocab_size=VOCAB, hidden_size=16, num_layers=2, seed=3)
    pipes = {}
    for head in ("domino", "markov"):
        drafter = make_tiny_drafter(root / f"d-{head}", target, head=head, block_size=4, seed=5)
        pipes[head] = dartree.load(target, drafter, dtype=torch.float64)
    return pipes


def exact_joint(model, prompt, length):
    """p(t1..tn | prompt) for every token sequence, by enumeration with full forwards."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=length):
        ids = torch.tensor([prompt + list(seq)])
        with torch.no_grad():
            logp = model(ids).logits[0].log_softmax(-1)
        total = sum(logp[len(prompt) - 1 + i, seq[i]].item() for i in range(length))
        probs[seq] = math.exp(total)
    return probs


def chi_square_rejects(counts, probs, n):
    """Pearson chi-square goodness of fit at p = 1e-4 (cells with expectation < 5 pooled)."""
    stat, pooled_obs, pooled_exp, df = 0.0, 0, 0.0, -1
    for cell, p in probs.items():
        expected = n * p
        if expected < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(cell, 0) - expected) ** 2 / expected
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-12)
        df += 1
    # Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + P_VALUE_Z * math.sqrt(2 / (9 * df))) ** 3
    return stat > crit, stat, crit


def empirical(pipe, method, length=3):
    counts = {}
    for seed in range(SAMPLES):
        res = pipe.generate(input_ids=PROMPT, method=method, max_new_tokens=length, temperature=1.0, seed=seed,
                            budget=4, width=2, tree_top_k=4, stop_token_ids=[])
        key = tuple(res.token_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module")
def truth(small_pipes):
    return exact_joint(small_pipes["domino"].target_model, PROMPT, 3)


METHODS_BY_HEAD = [("domino", m) for m in dartree.METHODS] + [("markov", m) for m in HEAD_METHODS]


@pytest.mark.parametrize("head,method", METHODS_BY_HEAD)
def test_joint_distribution_matches_target(small_pipes, truth, head, method):
    counts = empirical(small_pipes[head], method)
    rejected, stat, crit = chi_square_rejects(counts, truth, SAMPLES)
    assert not rejected, f"{method}: chi-square {stat:.1f} > {crit:.1f}"


def test_first_round_accepts_drafts(small_pipes):
    """The check above is only meaningful if the walk does accept draft nodes at T = 1."""
    res = [small_pipes["domino"].generate(input_ids=PROMPT, method="dartree", max_new_tokens=3, temperature=1.0, seed=s,
                                          budget=4, width=2, tree_top_k=4, stop_token_ids=[]) for s in range(200)]
    assert sum(r.stats.acceptance_lengths[0] >= 2 for r in res) >= 20


def test_a_draft_trusting_walk_is_caught(small_pipes, truth, monkeypatch):
    """Wrong rule: follow the first child unconditionally. The test must reject it."""
    from dartree import engine

    def trusting_walk(tree, known=None):  # as verify.walk_steps: yields the rows it needs, is sent their choices
        accepted = [0]
        kids = [i + 1 for i, p in enumerate(tree.parents.tolist()) if p == 0]
        if kids:
            accepted.append(kids[0])
        known = known or {}
        last = accepted[-1]
        return accepted, known[last] if last in known else (yield [last])[0]

    monkeypatch.setattr(engine, "walk_steps", trusting_walk)
    rejected, stat, crit = chi_square_rejects(empirical(small_pipes["domino"], "dartree"), truth, SAMPLES)
    assert rejected, f"wrong rule not detected: {stat:.1f} <= {crit:.1f}"


def test_shared_noise_across_nodes_is_caught(small_pipes, truth, monkeypatch):
    """Wrong rule: one uniform number reused at every depth of a tree (the right rule shares u_p only
    between rows choosing the same position p, of which one is kept): committed tokens not independent."""

    def shared_noise(self, logits, positions):
        probs = self.probabilities(logits)
        u = self.uniform(positions[0])
        return (probs.cumsum(-1) < u).sum(-1).clamp(max=probs.shape[-1] - 1)

    monkeypatch.setattr(Sampler, "__call__", shared_noise)
    rejected, stat, crit = chi_square_rejects(empirical(small_pipes["domino"], "dartree"), truth, SAMPLES)
    assert rejected, f"wrong rule not detected: {stat:.1f} <= {crit:.1f}"


def test_top_k_and_top_p_warp_the_target_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.float64)
    p = Sampler(1.0, top_k=2).probabilities(logits)[0]
    assert p[2] == 0 and p[3] == 0 and torch.isclose(p[:2].sum(), torch.tensor(1.0, dtype=torch.float64))
    full = logits.softmax(-1)[0]
    q = Sampler(1.0, top_p=float(full[0]) + 1e-9).probabilities(logits)[0]
    assert q[0] > 0 and q[1] > 0 and q[2] == 0 and q[3] == 0
    assert torch.allclose(Sampler(0.5).probabilities(logits), (logits / 0.5).softmax(-1))


def full_sort_reference(logits: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """The sampled distribution by its definition, over one full sort of the vocabulary: top-k keeps every token
    scoring at least the k-th best; top-p keeps, best first (ties by lower id), each token while the mass before it
    is below top_p; the kept tokens renormalised."""
    scores = logits.to(torch.float64) / temperature
    keep = scores > -math.inf
    if top_k is not None and top_k < scores.numel():
        keep &= scores >= scores.topk(top_k).values[-1]
    weights = torch.where(keep, (scores - scores.max()).exp(), torch.zeros_like(scores))
    if top_p is not None and top_p < 1:
        order = sorted(range(scores.numel()), key=lambda i: (-float(weights[i]), i))
        before, total, nucleus = 0.0, float(weights.sum()), torch.zeros_like(keep)
        for i in order:
            if before >= top_p * total:
                break
            nucleus[i] = True
            before += float(weights[i])
        weights = torch.where(nucleus, weights, torch.zeros_like(weights))
    return weights / weights.sum()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 1500), st.sampled_from([0.3, 1.0, 2.5]),
       st.one_of(st.none(), st.integers(1, 80)), st.one_of(st.none(), st.floats(0.05, 0.999)), st.booleans(),
       st.sampled_from([None, 1, 5, 100]))
def test_the_nucleus_found_among_the_best_tokens_is_the_full_sorts(seed, vocab, temperature, top_k, top_p, ties, allowed):
    """``Sampler.support`` looks for the top-p nucleus among the best 64 tokens, then 512, then all: the kept tokens
    and their probabilities are those of one full sort, for peaked and flat rows, with ties (equal logits) at
    the nucleus's edge or not, and with a grammar's mask (``allowed`` tokens finite, the rest -inf)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * float(torch.rand((), generator=gen) * 8)
    if ties:  # equal logits in runs, the best ones included
        logits = (logits * 2).round() / 2
    if allowed is not None and allowed < vocab:
        logits[torch.randperm(vocab, generator=gen)[allowed:]] = -math.inf
    sampler = Sampler(temperature, top_k=top_k, top_p=top_p)
    got = sampler.probabilities(logits[None])[0]
    want = full_sort_reference(logits, temperature, top_k, top_p)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-15)
    draws = sampler(torch.stack([logits] * 8), list(range(8)))  # every draw inside the support
    assert bool((want[draws] > 0).all())


@pytest.mark.parametrize("rank", [64, 512])
def test_a_run_of_equal_logits_across_the_candidates_edge_keeps_the_lower_ids(rank):
    """Equal logits spanning the rank where the nucleus search stops taking candidates (the 64th, the 512th best),
    the run's higher ids placed first, and top-p ending inside the run: the kept tokens of the run are its lowest
    ids, as one full sort with ties by lower id keeps them."""
    vocab, run = 2000, 40
    logits = torch.full((vocab,), -30.0)
    logits[1000:1000 + rank - run // 2] = 5.0  # the best tokens, just before the run in rank
    logits[torch.arange(vocab - 1, vocab - 1 - run, -1)] = 4.0  # the run, at the highest ids
    total = float((logits.double() - 5.0).exp().sum())
    before_run = (rank - run // 2) / total
    top_p = before_run + 0.5 * run * math.exp(-1.0) / total  # the nucleus ends half-way through the run
    got = Sampler(1.0, top_p=top_p).probabilities(logits[None])[0]
    want = full_sort_reference(logits, 1.0, None, top_p)
    assert torch.equal(got > 0, want > 0)
    kept_run = (got[vocab - run:] > 0).nonzero().squeeze(1) + vocab - run
    assert 0 < kept_run.numel() < run and int(kept_run.max()) < vocab - run + kept_run.numel()  # its lowest ids


REPEATING = [1, 2, 1, 2, 1]  # a prompt the n-gram proposers continue ("2 1 2 ...") from its first round on


@pytest.mark.parametrize("method,extra", [("ngram", {}), ("ngram-chain", {}), ("dartree", {"ngram": True})])
def test_ngram_proposals_keep_the_targets_distribution(small_pipes, method, extra):
    """At T = 1 on a prompt that repeats, so that the n-gram proposals are verified and sometimes
    accepted in most rounds: the joint of the three sampled tokens is still the target's."""
    pipe = small_pipes["domino"]
    counts, drafted, accepted = {}, 0, 0
    for seed in range(SAMPLES):
        res = pipe.generate(input_ids=REPEATING, method=method, max_new_tokens=3, temperature=1.0, seed=seed, budget=4,
                            stop_token_ids=[], **extra)
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        drafted += res.stats.tree_sizes[0] > 0
        accepted += res.stats.acceptance_lengths[0] >= 2
    assert drafted >= SAMPLES // 2 and accepted >= SAMPLES // 20, (drafted, accepted)
    rejected, stat, crit = chi_square_rejects(counts, exact_joint(pipe.target_model, REPEATING, 3), SAMPLES)
    assert not rejected, f"{method} {extra}: chi-square {stat:.1f} > {crit:.1f}"


GRAMMAR_TOKENS = [b"<eos>", b"a", b"b", b"c"]
FORCING = {"regex": "ab[abc]+|c[ab]a[abc]*"}  # after "a" a "b" is forced, after "ca" or "cb" an "a"


@pytest.mark.parametrize("method", ["ar", "dartree", "ngram", "ddtree", "dflash"])
def test_structured_output_samples_the_constrained_distribution(small_pipes, method):
    """At T = 1 under a grammar that forbids and forces tokens: the joint of the three sampled tokens is
    the target's distribution renormalised over what the grammar allows at each step (by enumeration)."""
    from dartree.structured import Constraint, OutputFormat

    pipe = small_pipes["domino"]
    pipe._grammars = grammars = byte_grammars(GRAMMAR_TOKENS)  # the tiny tokenizer has no bytes for the grammar engine
    fmt = OutputFormat.parse(FORCING)
    truth = {}
    for seq in itertools.product(range(VOCAB), repeat=3):
        constraint, p = Constraint(grammars.compile(fmt), VOCAB), 1.0
        with torch.no_grad():
            logits = pipe.target_model(torch.tensor([PROMPT + list(seq)])).logits[0, len(PROMPT) - 1:]
        for i, token in enumerate(seq):
            p *= constraint.mask(logits[i:i + 1], [()]).softmax(-1)[0, token].item()
            if p == 0.0:
                break
            constraint.advance([token])
        truth[seq] = p
    counts, forced = {}, 0
    for seed in range(SAMPLES):
        res = pipe.generate(input_ids=PROMPT, method=method, max_new_tokens=3, temperature=1.0, seed=seed, budget=4,
                            stop_token_ids=[], response_format=FORCING)
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        forced += res.stats.acceptance_lengths[0] >= 2
    assert set(counts) <= {s for s, p in truth.items() if p > 0}
    if method != "ar":
        assert forced >= SAMPLES // 4, forced  # the forced tokens were verified and accepted in the first round
    rejected, stat, crit = chi_square_rejects(counts, truth, SAMPLES)
    assert not rejected, f"{method}: chi-square {stat:.1f} > {crit:.1f}"
