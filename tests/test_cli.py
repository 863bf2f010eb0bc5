"""Command line: generate (text and --json), bench-tree, errors as one clear line."""

import json

import pytest
from conftest import hf_greedy

from dartree.cli import main


def test_generate_json_is_lossless(model_dirs, pipelines, capsys):
    target, drafter = model_dirs[("llama", "target")], model_dirs[("llama", "domino")]
    rc = main(["generate", "w1 w2 w3", "--target", str(target), "--drafter", str(drafter), "--dtype", "float64",
               "-n", "10", "--budget", "8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    pipe = pipelines[("llama", "domino")]
    want = hf_greedy(pipe.target_model, pipe.encode(prompt="w1 w2 w3").tolist(), 10)
    assert out["token_ids"] == want
    assert set(out["stats"]) >= {"rounds", "acceptance_lengths", "mean_acceptance", "tokens_per_second", "stage_ms"}
    # the stage clock splits the round: propose (draft), grow (tree), verify, walk, commit, each timed
    from dartree.engine import ROUND_STAGES

    assert ROUND_STAGES == ("draft", "tree", "verify", "walk", "commit")
    assert set(out["stats"]["stage_ms"]) == {"prefill", *ROUND_STAGES}
    assert all(out["stats"]["stage_ms"][stage] > 0 for stage in ROUND_STAGES)


def test_generate_plain_text_and_stats_line(model_dirs, capsys):
    args = ["generate", "w4 w5", "--raw", "--target", str(model_dirs[("qwen3", "target")]),
            "--drafter", str(model_dirs[("qwen3", "markov")]), "-n", "12", "-m", "heap"]
    assert main(args + ["--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    rc = main(args)  # streamed as rounds are verified: the same text
    captured = capsys.readouterr()
    assert rc == 0 and text.strip() and captured.out == text + "\n"
    assert "[heap on lean]" in captured.err and "mean acceptance" in captured.err  # the method and the target it ran


def test_generate_says_when_budget_auto_took_plain_steps(model_dirs, capsys, monkeypatch):
    """A mean acceptance near 1 with budget auto must not read as a broken drafter: the stats line says
    how many rounds made no proposer call and why."""
    from conftest import synthetic_cost

    monkeypatch.setattr("dartree.pipeline.load_or_measure", lambda pipe, *a, **k: synthetic_cost(1.0, 50.0, draft_ms=1.0))
    args = ["generate", "w4 w5", "--raw", "--target", str(model_dirs[("llama", "target")]),
            "--drafter", str(model_dirs[("llama", "domino")]), "-n", "12", "--dtype", "float64"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "[budget auto]" in err and "made no proposer call" in err
    assert main(args + ["--budget", "4"]) == 0
    assert "[budget auto]" not in capsys.readouterr().err


def test_a_target_without_a_drafter_runs_the_drafter_free_method_unless_told(model_dirs, capsys):
    """No --drafter for a --target: the default method is the one that needs none (``ngram``), the same greedy text;
    a method that needs a drafter, asked for by name, is one clear error."""
    args = ["generate", "w4 w5 w4 w5", "--raw", "--target", str(model_dirs[("llama", "target")]), "-n", "12",
            "--dtype", "float64", "--budget", "4"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "[ngram on lean]" in captured.err
    assert main(args + ["--json", "-m", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == ar
    assert main(args + ["-m", "dartree"]) == 2
    assert "needs a drafter" in capsys.readouterr().err


def test_bench_beside_a_target_without_a_drafter_runs_the_methods_that_need_none(model_dirs, tmp_path, capsys):
    """The default list leaves out the drafter's methods with a note; one named is refused before any model loads."""
    from dartree.cli.bench import DEFAULT_METHODS

    target = str(model_dirs[("llama", "target")])
    assert main(["bench", "--target", target, "--methods", "ar,dartree", "--out", str(tmp_path / "x")]) == 2
    assert "dartree need a drafter" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["bench", "--target", target, "--methods", DEFAULT_METHODS, "--dtype", "float64", "--limit", "1",
                 "--datasets", "gsm8k", "-n", "4", "--out", str(tmp_path / "y")]) == 0
    err = capsys.readouterr().err
    assert "leaving out the methods that need a drafter" in err
    methods = {json.loads(line)["method"] for line in (tmp_path / "y" / "records.jsonl").read_text().splitlines()}
    assert methods and "ar" in methods and "ngram" in methods and "dartree" not in methods


def test_errors_are_one_clear_line(model_dirs, capsys):
    rc = main(["generate", "w1", "--target", str(model_dirs[("llama", "target")]),
               "--drafter", str(model_dirs[("llama", "domino")]), "--beta", "0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and "error: beta must be <= 0, got 0.5" in err and "Traceback" not in err
    assert main(["generate", "w1", "--target", "/nonexistent"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bench_tree_prints_the_ratio(tmp_path, capsys):
    out = tmp_path / "bt.md"
    rc = main(["bench-tree", "--sizes", "32x500", "--heads", "domino,markov", "--rounds", "2", "--gru", "16",
               "--rank", "8", "--budget", "8", "--width", "4", "--tree-top-k", "8", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "heap / dartree" in text and text.count("| 32 | 500 |") == 2 and "| yes |" in text
    assert out.read_text().strip() == text.strip()


@pytest.mark.parametrize("argv", [["generate", "hi", "--method", "nope"], ["generate", "hi", "--budget", "x"],
                                  ["bench", "--limit"], ["train", "drafter", "--steps", "many"], ["nope"]])
def test_usage_mistakes_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "usage:" not in err


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--beta", "0.5"], "beta must be <= 0"),
    (["generate", "hi", "--budget", "0"], "budget must be an integer >= 1"),
    (["generate", "   "], "the prompt is empty"),
    (["generate", "hi", "-t", "nan"], "temperature must be a finite number"),
    (["generate", "hi", "--threads", "0"], "threads must be an integer >= 1"),
    (["bench", "--methods", "dartree", "--betas", "0.3"], "beta must be <= 0"),
])
def test_bad_settings_are_rejected_before_any_model_loads(argv, message, monkeypatch, capsys):
    import dartree

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(dartree, "load", no_loading)
    monkeypatch.setattr("dartree.pipeline.load_target", no_loading)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--sampling-top-k", "5"], "--sampling-top-k was renamed --top-k"),
    (["serve", "--sampling-top-k=5"], "--sampling-top-k was renamed --top-k"),
    (["bench-tree", "--top-k", "8"], "--top-k was renamed --tree-top-k (DARTree's K"),
])
def test_retired_flags_are_an_error_that_names_the_new_flag(argv, message, capsys):
    """``--sampling-top-k`` became ``--top-k`` (sampling top-k, as in Hugging Face and vLLM) and DARTree's
    K, once ``--top-k``, became ``--tree-top-k``: a retired flag is one line naming the new one, and
    --help shows only the current ones."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_generate_help_says_which_top_k_is_which(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--top-k TOP_K top-k sampling on the target" in text
    assert "--tree-top-k TREE_TOP_K, -K TREE_TOP_K DARTree's K: candidate tokens per depth" in text
    assert "--sampling-top-k" not in text


def test_a_commands_threads_are_set_once_and_loading_keeps_them(model_dirs, monkeypatch, capsys):
    """--threads is applied by the command line once, before anything loads; ``load`` (threads=None)
    keeps that count rather than choosing again; an explicit count always wins."""
    import torch

    import dartree.hardware as hardware

    before = torch.get_num_threads()
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    target, drafter = model_dirs[("llama", "target")], model_dirs[("llama", "domino")]
    try:
        assert main(["generate", "w1 w2", "--target", str(target), "--drafter", str(drafter), "--threads", "1",
                     "-n", "2", "--budget", "4", "--json"]) == 0
        assert calls == [1] and torch.get_num_threads() == 1
        assert hardware.set_threads(None) == 1  # a later load keeps the chosen count
        assert hardware.set_threads(2) == 2 and torch.get_num_threads() == 2
    finally:
        real(before)


def test_every_generation_and_tree_setting_is_one_declaration_that_the_cli_the_api_and_the_server_derive():
    """Each declared setting is a flag of ``generate`` and ``serve`` (its default the declared one,
    parsed by its declaration), a keyword of ``Pipeline.generate`` and a field the server reads: a
    setting added to ``GenerationSettings`` or ``TreeSettings`` reaches all of them or this fails."""
    import inspect

    from dartree.cli import build_parser
    from dartree.cli.args import generation_settings
    from dartree.pipeline import Pipeline
    from dartree.server.protocol import parse_request
    from dartree.settings import GenerationSettings
    from dartree.trees import TreeSettings

    declared = list(GenerationSettings.declarations()) + list(TreeSettings.declarations())
    parser = build_parser()
    for command in (["generate", "hi"], ["serve"]):
        defaults = parser.parse_args(command)
        assert generation_settings(defaults) == GenerationSettings()
        given = GenerationSettings(method="ddtree", max_new_tokens=7, temperature=0.5, seed=3, top_k=5, top_p=0.9,
                                   tree=TreeSettings(budget=8, width=3, tree_top_k=9, beta=-0.5, max_budget=32, ngram=True))
        argv = list(command)
        for s in declared:
            value = getattr(given.tree if s.name in TreeSettings.__dataclass_fields__ else given, s.name)
            argv += [s.metadata["flags"][0], str(value)]
        assert generation_settings(parser.parse_args(argv)) == given
    keywords = set(inspect.signature(Pipeline.generate).parameters)
    assert {s.name for s in declared} <= keywords
    body = {"messages": [{"role": "user", "content": "x"}], "method": "ddtree", "max_tokens": 7, "temperature": 0.5,
            "seed": 3, "top_k": 5, "top_p": 0.9, "budget": 8, "width": 3, "tree_top_k": 9, "beta": -0.5, "max_budget": 32,
            "ngram": True}
    assert {s.metadata["request"] for s in declared} == set(body) - {"messages"}
    assert parse_request(body, GenerationSettings(), chat=True)[1] == given


def test_a_request_turns_off_what_the_servers_defaults_turn_on_as_in_vllm():
    """top_k -1 or 0 and top_p 1 turn sampling top-k / nucleus off even where the server's defaults set
    them; max_completion_tokens wins over max_tokens; a field left out keeps the server's default."""
    from dartree.server.protocol import parse_request
    from dartree.settings import GenerationSettings

    defaults = GenerationSettings(temperature=1.0, top_k=20, top_p=0.8, max_new_tokens=50)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_request(chat, defaults, chat=True)[1] == defaults
    for off in ({"top_k": -1}, {"top_k": 0}):
        assert parse_request({**chat, **off}, defaults, chat=True)[1].top_k is None
    settings = parse_request({**chat, "top_p": 1, "max_tokens": 9, "max_completion_tokens": 4}, defaults, chat=True)[1]
    assert settings.top_p is None and settings.top_k == 20 and settings.max_new_tokens == 4
