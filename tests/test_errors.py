"""Every bad input raises a ValueError whose message says what was wrong and what is expected."""

import json
import math

import pytest
import torch
from tiny import make_tiny_drafter, make_tiny_target

import dartree


@pytest.fixture(scope="module")
def pipe(pipelines):
    return pipelines[("llama", "domino")]


def test_errors_are_value_errors():
    assert issubclass(dartree.DartreeError, ValueError) and issubclass(dartree.CheckpointError, ValueError)


def test_unknown_method(pipe):
    with pytest.raises(ValueError, match=r"unknown method 'medusa'.*dartree"):
        pipe.generate(input_ids=[1], method="medusa")


def test_positive_beta(pipe):
    with pytest.raises(ValueError, match=r"beta must be <= 0, got 0.5"):
        pipe.generate(input_ids=[1], method="dartree", beta=0.5)


@pytest.mark.parametrize("name", ["budget", "width", "tree_top_k"])
@pytest.mark.parametrize("value", [0, -3])
def test_sizes_below_one(pipe, name, value):
    with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1, got {value}"):
        pipe.generate(input_ids=[1], method="dartree", **{name: value})


def test_max_new_tokens_below_one(pipe):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        pipe.generate(input_ids=[1], max_new_tokens=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_non_finite_or_negative_temperature(pipe, bad):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        pipe.generate(input_ids=[1], temperature=bad)


def test_empty_prompt(pipe):
    with pytest.raises(ValueError, match="prompt is empty"):
        pipe.generate("   ")
    with pytest.raises(ValueError, match="input_ids is empty"):
        pipe.generate(input_ids=[])
    with pytest.raises(ValueError, match="messages must be a non-empty list"):
        pipe.generate(messages=[])


def test_out_of_vocabulary_ids(pipe):
    with pytest.raises(ValueError, match=r"input_ids must be integers in \[0, 8\)"):
        pipe.generate(input_ids=[1, 99])


def test_prompt_longer_than_context(tmp_path):
    target = make_tiny_target(tmp_path / "t", vocab_size=8, max_positions=16)
    p = dartree.load(target, make_tiny_drafter(tmp_path / "d", target), dtype=torch.float64)
    with pytest.raises(ValueError, match=r"prompt has 20 tokens but the target's context is 16 tokens"):
        p.generate(input_ids=[1] * 20, method="dflash")
    with pytest.raises(ValueError, match=r"lower max_new_tokens to at most"):
        p.generate(input_ids=[1] * 5, method="dflash", max_new_tokens=30)


def test_hidden_size_mismatch(tmp_path, model_dirs):
    wide = make_tiny_target(tmp_path / "wide", vocab_size=8, hidden_size=48)
    with pytest.raises(ValueError, match=r"drafter hidden_size 32 does not match the target's 48"):
        dartree.load(wide, model_dirs[("llama", "domino")])


def test_vocabulary_mismatch(tmp_path, model_dirs):
    big = make_tiny_target(tmp_path / "big", vocab_size=16)
    with pytest.raises(ValueError, match=r"drafter vocab_size 8 does not match the target's lm_head \(16 tokens\)"):
        dartree.load(big, model_dirs[("llama", "domino")])


def test_tapped_layer_out_of_range(tmp_path, model_dirs):
    target = model_dirs[("llama", "target")]
    d = make_tiny_drafter(tmp_path / "d", target, tapped=[0, 7])
    with pytest.raises(ValueError, match=r"taps target layer 7, out of range for a target with 4 layers"):
        dartree.load(target, d)


def test_missing_checkpoint_files(tmp_path, model_dirs):
    target = model_dirs[("llama", "target")]
    with pytest.raises(ValueError, match="target directory .* does not exist"):
        dartree.load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="drafter directory .* does not exist"):
        dartree.load(target, tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        dartree.load(target, empty)
    d = make_tiny_drafter(tmp_path / "noweights", target)
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no .safetensors weights"):
        dartree.load(target, d)


def test_corrupt_checkpoint_files(tmp_path, model_dirs):
    target = model_dirs[("llama", "target")]
    d = make_tiny_drafter(tmp_path / "trunc", target)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        dartree.load(target, d)
    d2 = make_tiny_drafter(tmp_path / "badjson", target)
    (d2 / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        dartree.load(target, d2)
    d3 = make_tiny_drafter(tmp_path / "nofield", target)
    raw = json.loads((d3 / "config.json").read_text())
    del raw["block_size"]
    (d3 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="lacks the field 'block_size'"):
        dartree.load(target, d3)


def test_corrupt_target_weights(tmp_path):
    target = make_tiny_target(tmp_path / "t", vocab_size=8)
    w = target / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        dartree.load(target)


def test_method_needs_a_head(pipelines):
    with pytest.raises(ValueError, match=r"method 'dartree' needs a drafter with a correction head"):
        pipelines[("llama", None)].generate(input_ids=[1], method="dartree")


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        dartree.load("x", dtype="float8")


def test_bad_sampling_settings(pipe):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        pipe.generate(input_ids=[1], temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match=r"top_k \(sampling top-k\) must be a positive integer"):
        pipe.generate(input_ids=[1], temperature=1.0, top_k=0)
    assert math.isfinite(pipe.generate(input_ids=[1], temperature=1.0, top_p=0.9, max_new_tokens=3).stats.mean_acceptance)


def test_retired_spellings_name_the_new_one(pipe):
    """``sampling_top_k`` became ``top_k`` (sampling top-k, as in Hugging Face and vLLM) and DARTree's
    K, once ``top_k``, became ``tree_top_k``: every retired spelling is a DartreeError naming the new one."""
    from dartree import GenerationSettings, TreeSettings

    renamed = r"'sampling_top_k' was renamed 'top_k'"
    with pytest.raises(dartree.DartreeError, match=renamed):
        pipe.generate(input_ids=[1], temperature=1.0, sampling_top_k=5)
    with pytest.raises(dartree.DartreeError, match=renamed):
        GenerationSettings(sampling_top_k=5)
    with pytest.raises(dartree.DartreeError, match=renamed):
        GenerationSettings.from_kwargs(sampling_top_k=5)
    with pytest.raises(dartree.DartreeError, match=r"'top_k' was renamed 'tree_top_k'.*top_k is now sampling top-k"):
        TreeSettings(top_k=8)
    with pytest.raises(dartree.DartreeError, match=r"'top_k' was renamed 'tree_top_k'"):
        GenerationSettings(tree=TreeSettings(top_k=8))
    # top_k is sampling top-k now, and tree_top_k DARTree's K: each reaches its own setting
    s = GenerationSettings.from_kwargs(top_k=5, tree_top_k=9)
    assert s.top_k == 5 and s.tree.tree_top_k == 9 and s.sampler().top_k == 5
    # an unknown keyword is an error too, with the known ones
    with pytest.raises(dartree.DartreeError, match=r"unknown generation setting\(s\) tree_topk; known: .*tree_top_k"):
        pipe.generate(input_ids=[1], tree_topk=5)


def test_a_pipeline_runs_by_default_the_best_method_it_has(pipelines, model_dirs):
    """dartree with a drafter and its head, DDTree with a drafter alone, ngram with none; each one's default text is
    greedy decoding's."""
    import dartree

    alone = dartree.load(model_dirs[("llama", "target")], dtype=torch.float64)
    for pipe, method in ((pipelines[("llama", "domino")], "dartree"), (pipelines[("llama", None)], "ddtree"),
                         (alone, "ngram")):
        assert pipe.default_method == method and method in pipe.methods
        want = pipe.generate(input_ids=[1, 2, 3, 1, 2], method="ar", max_new_tokens=8, stop_token_ids=[]).token_ids
        assert pipe.generate(input_ids=[1, 2, 3, 1, 2], max_new_tokens=8, stop_token_ids=[], budget=4).token_ids == want
