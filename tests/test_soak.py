"""scripts/soak.py: a short soak of `dartree serve` (its own process, on tiny float64 models) that passes every
check, and the checks themselves catching a lost, a duplicated and a changed answer and a memory leak."""

import json
import subprocess
import sys

import pytest
from test_scripts import SCRIPTS, load_script


@pytest.fixture(scope="module")
def soak():
    return load_script("soak")


def test_a_short_soak_of_a_live_server_passes_every_check(tmp_path, soak):
    from tiny import make_tiny_drafter, make_tiny_target

    target = make_tiny_target(tmp_path / "target", vocab_size=16, seed=3, logit_scale=4.0, max_positions=256)
    drafter = make_tiny_drafter(tmp_path / "drafter", target, head="domino", block_size=6, seed=4)
    out = tmp_path / "soak.json"
    server_args = (f"--target {target} --drafter {drafter} --dtype float64 --max-batch 4 --budget 8 --threads 1 "
                   "--max-new-tokens 16")
    run = subprocess.run([sys.executable, str(SCRIPTS / "soak.py"), "--start-server", "--server-args", server_args,
                          "--clients", "3", "--minutes", "0.5", "--requests", "300", "--max-tokens", "12",
                          "--max-body-bytes", "65536", "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr + out.with_suffix(".server.log").read_text()
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["violations"] == []
    assert summary["requests"]["load"] == 300 or summary["load_s"] >= 30
    outcomes = summary["load_outcomes"]
    assert set(outcomes) == set(soak.KINDS)  # every kind of request was sent under load, the API key's refusals too
    assert all(outcomes[kind].get("completed") for kind in ("greedy", "sampled", "at_limit"))
    assert outcomes["hang_up"].get("hung_up")
    assert summary["longest_prompt_words"] > 200  # the tiny target's context is 256 positions
    counted = summary["server_counted_over_load"]
    assert counted[soak.ENDED[0]] > 0 and counted[soak.ENDED[1]] > 0 and counted[soak.TOKENS] > 0
    assert summary["memory_mb"]["after_load"] > 0


def answer(outcome: str, text: str = "", tokens: int = 0, ids=(), ask: str = "greedy-0") -> dict:
    return {"kind": "greedy", "outcome": outcome, "ask": ask, "status": 200, "text": text, "tokens": tokens, "ids": list(ids)}


def test_the_accounting_catches_a_lost_a_duplicated_and_a_failed_request(soak):
    ok, cancelled, error = soak.ENDED
    records = [answer("completed", "w1 w2", 2, ["a"]), answer("hung_up", "w1", ids=["b"]), answer("gave_up")]

    def violations(**grew):
        after = {ok: 10, cancelled: 5, error: 0, soak.TOKENS: 100}
        before = dict(after)
        for name, n in grew.items():
            after[{"ok": ok, "cancelled": cancelled, "error": error, "tokens": soak.TOKENS}[name]] += n
        return soak.check_accounting(records, before, after, max_tokens=8)

    assert violations(ok=1, cancelled=1, tokens=2) == []
    assert violations(ok=2, tokens=2 + 8) == []  # the hung-up request ended before its cancellation was seen
    assert violations(ok=3, tokens=2 + 16) == []  # the given-up one was served to the end
    assert "lost" in violations(ok=1, tokens=2)[0]
    assert "duplicated" in violations(ok=3, cancelled=1, tokens=2)[0]
    assert "error on the server" in violations(ok=1, error=1, tokens=2)[0]
    assert "fewer than the 1 completed" in violations(cancelled=2)[0]
    assert "generated tokens" in violations(ok=1, cancelled=1, tokens=1)[0]
    assert "generated tokens" in violations(ok=2, tokens=2 + 9)[0]


def test_the_answer_checks_catch_a_changed_answer_and_a_reused_id(soak):
    alone = {"greedy-0": "w1 w2 w3"}
    good = [answer("completed", "w1 w2 w3", ids=["a"]), answer("hung_up", "w1 w2", ids=["b"])]
    assert soak.check_records(good, alone) == []
    assert "not the one served alone" in soak.check_records([answer("completed", "w1 w3", ids=["a"])], alone)[0]
    assert "does not begin" in soak.check_records([answer("hung_up", "w2", ids=["a"])], alone)[0]
    assert "more than one request" in soak.check_records([*good, answer("completed", "w1 w2 w3", ids=["a"])], alone)[0]
    failed = {"kind": "bad_body", "outcome": "failed", "ask": None, "status": 500, "problem": "HTTP 500: boom"}
    assert soak.check_records([failed], alone) == ["bad_body: HTTP 500: boom"]


def test_the_memory_check_allows_less_than_five_percent(soak):
    assert soak.check_memory(1000.0, 1049.0) == []
    assert "grew 5.0%" in soak.check_memory(1000.0, 1050.0)[0]


def test_the_soak_refuses_a_server_off_this_machine(soak, capsys):
    with pytest.raises(SystemExit):
        soak.parse_args(["--base-url", "http://10.1.2.3:8000", "--server-pid", "1"])
    assert "must be on this machine" in capsys.readouterr().err
