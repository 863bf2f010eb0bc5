"""The benchmark harness on a tiny model: grid, resume, T=0 comparison with ar, peers, report."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import dartree
from dartree.bench.datasets import DATASETS, load_samples, select
from dartree.bench.report import build_report, summarise
from dartree.bench.runner import RunConfig, build_grid, read_records, run, run_replay
from dartree.errors import DartreeError
from dartree.trees import TreeSettings
from dartree.cli import main


def test_every_dataset_loads_with_the_published_format():
    for name in DATASETS:
        samples = load_samples(name)
        assert len(samples) >= 30, name
        assert all(s.turns and all(t.strip() for t in s.turns) for s in samples[:50])
    assert "put your final answer within \\boxed{}" in load_samples("gsm8k")[0].turns[0]
    assert load_samples("humaneval")[0].turns[0].startswith("Write a solution to the following problem")
    assert all(len(s.turns) == 2 for s in load_samples("mt-bench"))
    assert all(11 <= int(s.sample_id) <= 510 for s in load_samples("mbpp"))


def test_selection_is_seeded_and_limited():
    samples = load_samples("gsm8k")
    a, b = select(samples, 5, seed=0), select(samples, 5, seed=0)
    assert [s.sample_id for s in a] == [s.sample_id for s in b] and len(a) == 5
    assert [s.sample_id for s in select(samples, 5, seed=1)] != [s.sample_id for s in a]


def test_grid_puts_ar_first_and_settings_where_used():
    grid = build_grid(["dartree", "dflash", "ddtree", "hf-generate"], [0.0, 1.0], [8, 16, "auto"], width=[4, 12])
    assert grid[0].method == "ar"
    assert {g.key for g in grid if g.method == "dartree" and g.temperature == 0} == {
        "dartree|T=0|B=8|W=4|K=64|beta=-0.2|ngram=on", "dartree|T=0|B=8|W=12|K=64|beta=-0.2|ngram=on",
        "dartree|T=0|B=16|W=4|K=64|beta=-0.2|ngram=on", "dartree|T=0|B=16|W=12|K=64|beta=-0.2|ngram=on",
        "dartree|T=0|B=auto|W=4|K=64|beta=-0.2|max=64|ngram=on", "dartree|T=0|B=auto|W=12|K=64|beta=-0.2|max=64|ngram=on"}
    # the settings a configuration carries are those its method reads, max_budget only with budget auto
    assert {g.key for g in grid if g.method == "ddtree" and g.temperature == 0} == {"ddtree|T=0|B=8", "ddtree|T=0|B=16", "ddtree|T=0|B=auto|max=64"}
    auto = next(g for g in grid if g.key == "dartree|T=0|B=auto|W=12|K=64|beta=-0.2|max=64|ngram=on")
    assert auto.tree_settings() == TreeSettings(budget="auto", width=12) and RunConfig.from_record(
        {**dataclasses.asdict(auto), "key": auto.key}) == auto
    # a record written before the ngram switch existed ran with it off
    older = {k: v for k, v in dataclasses.asdict(auto).items() if k != "ngram"}
    assert RunConfig.from_record(older).ngram is False and RunConfig.from_record(older).key.endswith("max=64")
    assert build_grid(["dartree"], [0.0], [32], max_budget=[128]) == build_grid(["dartree"], [0.0], [32])  # not read at B=32
    with pytest.raises(DartreeError, match="unknown tree setting"):
        build_grid(["dartree"], [0.0], [4], widths=[4])
    assert [g.key for g in grid if g.method == "dflash"] == ["dflash|T=0", "dflash|T=1"]
    assert [g.temperature for g in grid if g.method == "hf-generate"] == [0.0]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from tiny import make_tiny_drafter, make_tiny_target

    root = tmp_path_factory.mktemp("bench")
    t = make_tiny_target(root / "t", vocab_size=8, seed=1)
    return t, make_tiny_drafter(root / "d", t, head="domino", block_size=4)


@pytest.fixture(scope="module")
def tiny_pipe(tiny_dirs):
    return dartree.load(*tiny_dirs, dtype=torch.float64)


def test_run_resumes_compares_with_ar_and_reports(tiny_pipe, tmp_path):
    samples = select(load_samples("mt-bench"), 2) + select(load_samples("gsm8k"), 2)
    grid = build_grid(["dflash", "dartree", "heap", "hf-generate", "hf-prompt-lookup"], [0.0, 1.0], [4])
    out = tmp_path / "records.jsonl"
    run(tiny_pipe, samples[:2], grid, out, max_new_tokens=6)
    first = read_records(out)
    run(tiny_pipe, samples, grid, out, max_new_tokens=6)  # resumes: only the new samples run
    records = read_records(out)
    assert len(first) == 2 * len(grid) and len(records) == 4 * len(grid)
    assert records[: len(first)] == first
    t0 = [r for r in records if r["temperature"] == 0 and r["method"] != "ar"]
    ours = [r for r in t0 if not r["method"].startswith("hf-")]
    assert ours and all(r["matches_ar"] for r in ours)
    # a peer's tokens are compared too, but as a measurement (never counted as a mismatch of ours)
    assert all(r["same_as_ar"] and "matches_ar" not in r for r in t0 if r["method"].startswith("hf-"))
    assert all(len(r["turns"]) == 2 for r in records if r["dataset"] == "mt-bench")
    summaries = {(s.dataset, s.key): s for s in summarise(records)}
    s = summaries[("gsm8k", "dartree|T=0|B=4|W=12|K=64|beta=-0.2|ngram=on")]
    assert s.samples == 2 and s.tau_macro >= 1 and s.speedup_vs_ar is not None and s.speedup_vs_hf is not None
    assert summaries[("gsm8k", "ar|T=0")].speedup_vs_ar == pytest.approx(1.0)
    report = build_report(tmp_path)
    text = report.read_text()
    assert "Temperature 0" in text and "Temperature 1" in text and "dartree" in text
    assert (tmp_path / "tau_by_method.png").is_file() and (tmp_path / "latency_breakdown.png").is_file()


def test_hf_peers_run_on_the_target_as_hugging_face_loads_it(tiny_pipe):
    """The Hugging Face peers stand for what a user would run without dartree: the same weights
    loaded by from_pretrained, with plain Linears (not dartree's CpuLinear), loaded once."""
    from dartree.bench.runner import plain_hf_model

    plain = plain_hf_model(tiny_pipe)
    assert plain is not tiny_pipe.target_model and plain_hf_model(tiny_pipe) is plain
    assert plain.dtype == tiny_pipe.target_model.dtype
    linears = [m for m in plain.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)
    for (name, want), (_, got) in zip(tiny_pipe.target_model.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(want, got), name


def test_replay_records_equal_decoded_acceptance_lengths(tiny_pipe, tmp_path, monkeypatch):
    samples = select(load_samples("mt-bench"), 1) + select(load_samples("gsm8k"), 3)
    grid = build_grid(["dflash", "ddtree", "dartree", "heap", "domino", "hf-generate"], [0.0], [3, 8])
    run(tiny_pipe, samples, grid, tmp_path / "decoded" / "records.jsonl", max_new_tokens=12)
    run_replay(tiny_pipe, samples[:2], grid, tmp_path / "replay" / "records.jsonl", max_new_tokens=12)
    replayed = run_replay(tiny_pipe, samples, grid, tmp_path / "replay" / "records.jsonl", max_new_tokens=12)  # resumes
    decoded = {(r["dataset"], r["sample_id"], r["key"]): r for r in read_records(tmp_path / "decoded" / "records.jsonl")}
    assert len(replayed) == 4 * 8  # dflash, domino, 2 budgets x (ddtree, dartree, heap); no ar, no peers
    assert len({(r["dataset"], r["sample_id"], r["key"]) for r in replayed}) == len(replayed)
    for r in replayed:
        d = decoded[(r["dataset"], r["sample_id"], r["key"])]
        assert r["replay"] and [t["acceptance_lengths"] for t in r["turns"]] == [t["acceptance_lengths"] for t in d["turns"]]
        assert [t["token_ids"] for t in r["turns"]] == [t["token_ids"] for t in d["turns"]]
        assert r["target"] == d["target"] == tiny_pipe.target.name  # every record names the target it measured
    assert {r["target"] for r in decoded.values() if r["method"] == "hf-generate"} == {"hf-generate"}
    text = build_report(tmp_path / "replay").read_text()
    assert "exact replay" in text and "speedup" not in text.split("###")[0]  # no wall-clock in replay
    assert "| dartree B=8 W=12 K=64 beta=-0.2 ngram=on |" in text  # labels never split a markdown cell
    assert (tmp_path / "replay" / "tau_vs_budget.png").is_file()
    assert not (tmp_path / "replay" / "speedup_vs_budget.png").exists()

    def no_target_decoding(*args, **kwargs):
        raise AssertionError("greedy tokens should come from greedy.jsonl")

    monkeypatch.setattr("dartree.replay.greedy_continuation", no_target_decoding)
    more = run_replay(tiny_pipe, samples, build_grid(["dartree"], [0.0], [5]), tmp_path / "replay" / "records.jsonl", 12)
    assert len(more) == len(replayed) + 4
    assert main(["bench", "--replay", "--temperatures", "0,1"]) == 2


def test_mismatch_is_reported_loudly(tiny_pipe, tmp_path, capsys, monkeypatch):
    samples = select(load_samples("gsm8k"), 1)
    out = tmp_path / "records.jsonl"
    run(tiny_pipe, samples, build_grid(["ar"], [0.0], [4]), out, max_new_tokens=5)
    recs = read_records(out)
    recs[0]["turns"][0]["token_ids"] = [7, 7, 7, 7, 7]  # pretend ar wrote something else
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    run(tiny_pipe, samples, build_grid(["dflash"], [0.0], [4]), out, max_new_tokens=5)
    assert "MISMATCH" in capsys.readouterr().err
    assert read_records(out)[-1]["matches_ar"] is False


def test_cli_report_and_errors(tiny_pipe, tmp_path, capsys):
    samples = select(load_samples("gsm8k"), 1)
    run(tiny_pipe, samples, build_grid(["dflash"], [0.0], [4]), tmp_path / "records.jsonl", max_new_tokens=4)
    assert main(["bench", "--report", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").is_file()
    assert main(["bench", "--datasets", "nope"]) == 2
    assert "unknown dataset 'nope'" in capsys.readouterr().err
    assert main(["bench", "--betas", "0.3"]) == 2


def test_records_written_before_tree_top_k_was_named_so_read_and_report_the_same(tiny_pipe, tmp_path, capsys):
    """Bench records from before DARTree's K became ``tree_top_k`` carry it as ``top_k`` (the committed
    records under docs/results): they read as the same configurations and rebuild the same report;
    the bench's retired list flags name the new one."""
    samples = select(load_samples("gsm8k"), 1)
    grid = build_grid(["dartree"], [0.0], [4], tree_top_k=[8])
    cfg = grid[-1]
    assert cfg.tree_top_k == 8 and cfg.key == "dartree|T=0|B=4|W=12|K=8|beta=-0.2|ngram=on"
    run(tiny_pipe, samples, grid, tmp_path / "new" / "records.jsonl", max_new_tokens=4)
    records = read_records(tmp_path / "new" / "records.jsonl")
    assert all("tree_top_k" in r and "top_k" not in r for r in records)
    old = [{("top_k" if k == "tree_top_k" else k): v for k, v in r.items()} for r in records]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    assert [RunConfig.from_record(r) for r in old] == [RunConfig.from_record(r) for r in records]
    assert RunConfig.from_record(old[-1]) == cfg
    assert main(["bench", "--report", str(tmp_path / "old")]) == 0
    assert (tmp_path / "old" / "report.md").read_text() == build_report(tmp_path / "new").read_text()
    capsys.readouterr()
    for flag in ("--top-ks", "--top-k"):
        assert main(["bench", "--methods", "dartree", flag, "8"]) == 2
        assert f"{flag} was renamed --tree-top-ks" in capsys.readouterr().err


def test_two_concurrent_shards_write_the_same_records_as_one_run(tiny_dirs, tmp_path):
    target, drafter = tiny_dirs
    common = ["bench", "--target", str(target), "--drafter", str(drafter), "--dtype", "float64", "--datasets",
              "gsm8k,mt-bench", "--limit", "3", "--methods", "dflash,dartree", "--budgets", "4", "--max-new-tokens", "5",
              "--threads", "1"]
    assert main(common + ["--out", str(tmp_path / "whole")]) == 0
    shards = [subprocess.Popen([sys.executable, "-m", "dartree.cli", *common, "--out", str(tmp_path / "sharded"),
                                "--shard", f"{i}/2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
              for i in (1, 2)]
    for p in shards:
        assert p.wait(timeout=300) == 0, p.stderr.read().decode()[-2000:]
    whole = read_records(tmp_path / "whole" / "records.jsonl")
    lines = (tmp_path / "sharded" / "records.jsonl").read_text().splitlines()
    sharded = [json.loads(line) for line in lines]  # every line whole: the shards never interleaved
    assert len(whole) == 6 * 3 and len(sharded) == len(whole)
    def tokens(records):
        return {(r["dataset"], r["sample_id"], r["key"]): r["output_sha1"] for r in records}

    assert tokens(sharded) == tokens(whole)
    assert all(r["matches_ar"] for r in sharded if r["method"] != "ar")
    assert main(common + ["--out", str(tmp_path / "sharded"), "--shard", "2/2"]) == 0  # a finished shard resumes to nothing
    assert len(read_records(tmp_path / "sharded" / "records.jsonl")) == len(whole)


def test_replay_with_a_cost_model_reports_modeled_speedups(tiny_dirs, tmp_path, capsys):
    """`--replay --budgets auto,4 --cost-model FILE`: budget 'auto' runs its policy on the replayed trees,
    every configuration gets a modeled speedup over ar, labelled as a prediction."""
    from conftest import synthetic_cost

    target, drafter = tiny_dirs
    cost_file = tmp_path / "cost.json"
    cost = synthetic_cost(10.0, 0.2, draft_ms=1.0, tree_ms=0.5)
    cost.identity.update(dtype="bfloat16", threads=1)
    cost_file.write_text(cost.to_json())
    common = ["bench", "--target", str(target), "--drafter", str(drafter), "--dtype", "float64", "--datasets", "gsm8k",
              "--limit", "2", "--methods", "dflash,dartree", "--max-new-tokens", "12", "--threads", "1", "--replay"]
    out = tmp_path / "modeled"
    assert main(common + ["--budgets", "auto,4", "--cost-model", str(cost_file), "--out", str(out)]) == 0
    records = read_records(out / "records.jsonl")
    assert {r["key"] for r in records} == {"dflash|T=0|float64", "dartree|T=0|B=4|W=12|K=64|beta=-0.2|ngram=on|float64",
                                           "dartree|T=0|B=auto|W=12|K=64|beta=-0.2|max=64|ngram=on|float64"}
    for r in records:
        assert r["modeled_step_ms"] == 10.0 and r["cost_model"]["dtype"] == "bfloat16"
        for t in r["turns"]:  # at least a plain step's time per committed token's round, at most every round drafted at B=64
            assert 10.0 * len(t["acceptance_lengths"]) <= t["modeled_ms"] <= cost.round_ms(64) * len(t["acceptance_lengths"])
    summaries = {s.key: s for s in summarise(records)}
    fixed = summaries["dartree|T=0|B=4|W=12|K=64|beta=-0.2|ngram=on|float64"]
    new = sum(t["new_tokens"] for r in records if r["key"] == fixed.key for t in r["turns"])
    ms = sum(t["modeled_ms"] for r in records if r["key"] == fixed.key for t in r["turns"])
    assert fixed.modeled_speedup == pytest.approx(new * 10.0 / ms)
    text = (out / "report.md").read_text()
    assert "modeled on the cost model (a prediction, not a measurement)" in text and "bfloat16, 1 thread(s)" in text
    assert "B=auto" in text
    # without a cost model, replay stays tau-only; a cost model without replay is refused
    assert main(common + ["--budgets", "4", "--out", str(tmp_path / "plain")]) == 0
    assert all("modeled_ms" not in t for r in read_records(tmp_path / "plain" / "records.jsonl") for t in r["turns"])
    assert main(common[:-1] + ["--cost-model", str(cost_file)]) == 2
    assert "--cost-model" in capsys.readouterr().err
    assert main(common + ["--cost-model", str(tmp_path / "nope.json"), "--out", str(tmp_path / "x")]) == 2


@pytest.mark.parametrize("bad", ["0/2", "3/2", "1", "a/b"])
def test_shard_is_validated(bad, capsys):
    assert main(["bench", "--shard", bad]) == 2
    assert "--shard" in capsys.readouterr().err


def test_report_of_a_stopped_run_compares_only_prompts_every_configuration_finished(tiny_pipe, tmp_path):
    samples = select(load_samples("gsm8k"), 3)
    grid = build_grid(["dflash", "dartree"], [0.0], [4])
    stopped, finished = tmp_path / "stopped", tmp_path / "finished"
    run(tiny_pipe, samples[:2], grid, stopped / "records.jsonl", max_new_tokens=6)
    (finished / "records.jsonl").parent.mkdir()
    (finished / "records.jsonl").write_text((stopped / "records.jsonl").read_text())
    run(tiny_pipe, samples[2:], grid[:2], stopped / "records.jsonl", max_new_tokens=6)  # stopped after ar, dflash
    text = build_report(stopped).read_text()
    assert "unfinished: 1 prompt(s)" in text and "the 2 prompts every configuration finished" in text
    tables = lambda t: t[t.index("## "):]  # noqa: E731
    assert tables(text) == tables(build_report(finished).read_text())


def test_a_run_can_cross_dtypes_each_against_its_own_ar(tiny_dirs, tmp_path):
    """--dtype float32,bfloat16: the grid runs once per dtype; float32 keys are the keys of runs
    before dtypes were crossed (old records resume); each 16-bit run is compared with ar of its own
    dtype and with float32 ar, and the report shows both speedups."""
    grid = build_grid(["dartree", "hf-generate"], [0.0], [4], dtypes=["float32", "bfloat16"])
    assert [g.key for g in grid] == ["ar|T=0", "dartree|T=0|B=4|W=12|K=64|beta=-0.2|ngram=on", "hf-generate|T=0",
                                     "ar|T=0|bfloat16", "dartree|T=0|B=4|W=12|K=64|beta=-0.2|ngram=on|bfloat16", "hf-generate|T=0|bfloat16"]
    assert build_grid(["dartree"], [0.0], [4]) == [g for g in grid if g.dtype == "float32" and g.method != "hf-generate"]
    pipes = {d: dartree.load(*tiny_dirs, dtype=d) for d in ("float32", "bfloat16")}
    samples = select(load_samples("gsm8k"), 2)
    out = tmp_path / "records.jsonl"
    records = run(pipes, samples, grid, out, max_new_tokens=6)
    assert len(records) == 2 * len(grid)
    for r in records:
        assert r["dtype"] in ("float32", "bfloat16")
        if r["dtype"] == "bfloat16":
            assert "matches_ar_float32" in r
            if r["method"] != "ar" and r["method"] != "hf-generate":
                assert "matches_ar" in r
        else:
            assert "matches_ar_float32" not in r
    summaries = {(s.dataset, s.key): s for s in summarise(read_records(out))}
    for (dataset, key), s in summaries.items():
        ar32 = summaries[(dataset, "ar|T=0")]
        if s.config.dtype == "bfloat16":
            assert s.speedup_vs_ar_float32 == pytest.approx(s.tokens_per_second / ar32.tokens_per_second)
            same = summaries[(dataset, "ar|T=0|bfloat16")]
            assert s.speedup_vs_ar == pytest.approx(s.tokens_per_second / same.tokens_per_second)
        else:
            assert s.speedup_vs_ar_float32 is None
    text = build_report(tmp_path).read_text()
    assert "vs fp32 ar" in text and "bfloat16" in text


FAKE_LLAMA_SERVER = """#!{python}
# Stands in for llama-server: answers /health and /completion like it, logs each request's prompt.
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
log = open({log!r}, "a")
log.write(json.dumps({{"argv": args}}) + "\\n"); log.flush()
class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        self._send({{"status": "ok"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        log.write(json.dumps({{"prompt": body["prompt"], "n_predict": body["n_predict"], "temperature": body["temperature"]}}) + "\\n"); log.flush()
        tokens = [3, 1, 4][: body["n_predict"]]
        self._send({{"tokens": tokens, "content": "", "stop_type": "limit",
                    "timings": {{"predicted_n": len(tokens), "predicted_ms": 2.0, "prompt_ms": 1.0}}}})
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_the_llama_cpp_peer_gets_our_prompt_ids_and_reports_beside_ar(tiny_pipe, tmp_path, monkeypatch):
    """`dartree bench` drives llama-server as a peer: it is started once per run on the right GGUF,
    gets every turn's prompt as our chat template's token ids (greedy), its tokens and its own decode
    time are recorded, compared with ar's as a measurement, reported beside ar (x llama.cpp F32,
    totals), and the server is stopped at the end. A stand-in server plays llama-server here."""
    from dartree.bench import llama_cpp

    cache = tmp_path / "cache"
    (cache / "llama.cpp" / "bin").mkdir(parents=True)
    monkeypatch.setenv("DARTREE_CACHE", str(cache))
    assert "scripts/build_llama_cpp.sh" in llama_cpp.missing()  # absent: the one line that builds it
    log = tmp_path / "server.log"
    fake = cache / "llama.cpp" / "bin" / "llama-server"
    fake.write_text(FAKE_LLAMA_SERVER.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    (cache / "llama.cpp" / llama_cpp.F32_FILE).write_bytes(b"GGUF")
    assert llama_cpp.missing() is None

    samples = select(load_samples("mt-bench"), 1) + select(load_samples("gsm8k"), 2)
    grid = build_grid(["dartree", "llama.cpp-f32"], [0.0], [4])
    records = run(tiny_pipe, samples, grid, tmp_path / "run" / "records.jsonl", max_new_tokens=5)
    peer = [r for r in records if r["method"] == "llama.cpp-f32"]
    assert len(peer) == 3 and all(t["token_ids"] == [3, 1, 4] and t["decode_seconds"] == pytest.approx(0.002)
                                  for r in peer for t in r["turns"])
    assert all(r["same_as_ar"] is False and "matches_ar" not in r for r in peer)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    starts = [x["argv"] for x in lines if "argv" in x]
    assert len(starts) == 1 and starts[0][starts[0].index("-m") + 1].endswith(llama_cpp.F32_FILE)
    asked = [x for x in lines if "prompt" in x][1:]  # after the warm-up request
    messages = []
    expected = []
    for sample in samples:
        messages = []
        for turn in sample.turns:
            messages.append({"role": "user", "content": turn})
            expected.append(tiny_pipe.encode(messages=list(messages)).tolist())
            messages.append({"role": "assistant", "content": tiny_pipe.tokenizer.decode([3, 1, 4], skip_special_tokens=True)})
    assert [x["prompt"] for x in asked] == expected and all(x["n_predict"] == 5 and x["temperature"] == 0 for x in asked)
    summaries = {(s.dataset, s.key): s for s in summarise(records)}
    ar, llama = summaries[("gsm8k", "ar|T=0")], summaries[("gsm8k", "llama.cpp-f32|T=0")]
    assert ar.speedup_vs_llama == pytest.approx(ar.tokens_per_second / llama.tokens_per_second)
    text = build_report(tmp_path / "run").read_text()
    assert "x llama.cpp F32" in text and "same tokens as ar" in text
    # the server is gone
    assert subprocess.run(["pgrep", "-f", str(fake)], capture_output=True).returncode == 1


def test_bench_leaves_out_the_llama_cpp_peers_where_llama_cpp_is_not_built(tmp_path, monkeypatch, capsys):
    from dartree.cli.bench import DEFAULT_METHODS, bench_methods
    from dartree.errors import DartreeError

    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "empty"))
    with pytest.raises(DartreeError, match="build_llama_cpp.sh"):
        bench_methods("ar,llama.cpp-q4_1")  # asked for by name: an error that says how to build it
    assert main(["bench", "--methods", "ar,llama.cpp-f32", "--out", str(tmp_path / "x"), "--limit", "1"]) != 0
    assert "build_llama_cpp.sh" in capsys.readouterr().err
    default = bench_methods(DEFAULT_METHODS)  # the default list runs without them, and says so
    assert "llama.cpp-f32" in DEFAULT_METHODS and "llama.cpp-f32" not in default and "ar" in default
    assert "leaving out the llama.cpp peers" in capsys.readouterr().err
    assert bench_methods("ar,llama.cpp-f32", replay=True) == ["ar", "llama.cpp-f32"]  # replay runs no peer


def test_the_llama_cpp_peers_are_refused_beside_a_target_that_is_not_the_bundled_model(capsys):
    """They decode the bundled model's files: beside another --target they would time another model."""
    from dartree.cli.bench import DEFAULT_METHODS, bench_methods
    from dartree.errors import DartreeError

    with pytest.raises(DartreeError, match="bundled model's GGUF files"):
        bench_methods("ar,llama.cpp-q4_1", bundled=False)
    default = bench_methods(DEFAULT_METHODS, bundled=False)
    assert "ar" in default and not any(m.startswith("llama.cpp") for m in default)
    assert "bundled model's GGUF files" in capsys.readouterr().err
