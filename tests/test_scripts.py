"""The analysis scripts under scripts/ that compute committed numbers."""

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vocab_ceiling_counts_the_rounds_a_vocabulary_would_have_ended():
    """A round ends on its last committed token (the target's own choice after the accepted drafts);
    it counts when that token is outside the vocabulary, unless the round accepted every depth."""
    ended_outside = load_script("vocab_ceiling").ended_outside
    depth = 4
    # rounds of 2, 5 (every depth plus the bonus), 1 and 3 tokens
    tokens = [10, 11, 20, 21, 22, 23, 99, 12, 30, 31, 98]
    record = {"method": "dartree", "budget": 16, "turns": [{"token_ids": tokens, "acceptance_lengths": [2, 5, 1, 3]}]}
    other = {"method": "ddtree", "budget": 16, "turns": record["turns"]}
    everything = set(range(100))
    assert ended_outside([record, other], everything, 16, depth) == (0, 4)
    # round ends: 11, 99 (a full round: not a rejection), 12, 98
    assert ended_outside([record], everything - {11, 98}, 16, depth) == (2, 4)
    assert ended_outside([record], everything - {99}, 16, depth) == (0, 4)
    assert ended_outside([record], everything - {11}, 64, depth) == (0, 0)
