"""`dartree serve` against a live server on 127.0.0.1 with the real `openai` client (tiny float64 models)."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx  # the HTTP client the openai package itself uses
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dartree
from dartree.server import TextAssembler, create_app

VOCAB = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn in a thread on a free port, started and stopped by the test module."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tiny import make_tiny_drafter, make_tiny_target

    root = tmp_path_factory.mktemp("serve")
    target = make_tiny_target(root / "target", vocab_size=VOCAB, seed=3, logit_scale=4.0, max_positions=256)
    drafter = make_tiny_drafter(root / "drafter", target, head="domino", block_size=6, seed=4)
    pipe = dartree.load(target, drafter, dtype=torch.float64)
    reference = dartree.load(target, drafter, dtype=torch.float64)  # the engine thread owns `pipe`
    defaults = dartree.GenerationSettings(max_new_tokens=24, tree=dartree.TreeSettings(budget=8))
    with LiveServer(create_app(pipe, defaults, model_name="tiny", max_queue=32, max_batch=4)) as server:
        yield server, reference


def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def ar_text(reference, messages=None, prompt=None, n=24):
    if messages is not None:
        res = reference.generate(messages=messages, method="ar", max_new_tokens=n, stop_token_ids=[])
    else:
        res = reference.generate(input_ids=reference.tokenizer(prompt)["input_ids"], method="ar", max_new_tokens=n,
                                 stop_token_ids=[])
    return res.text, res.token_ids


def test_models_and_health(served):
    server, _ = served
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client(server).models.list().data] == ["tiny"]


@pytest.mark.parametrize("method", ["dartree", "ddtree", "ar"])
def test_chat_streaming_and_not_equal_greedy_decoding(served, method):
    server, reference = served
    messages = [{"role": "user", "content": "w3 w1 w4 w1"}]
    want, ids = ar_text(reference, messages)
    api = client(server)
    full = api.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=24,
                                       extra_body={"method": method})
    assert full.choices[0].message.content == want
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == len(ids) and full.usage.prompt_tokens > 0
    pieces = []
    stream = api.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=24, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"method": method})
    finish, usage = None, None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces) == want and finish == "length"
    assert usage is not None and usage.completion_tokens == len(ids)
    assert usage.model_extra["mean_acceptance_length"] >= 1.0


def test_completions_endpoint_streams_the_same_text(served):
    server, reference = served
    want, _ = ar_text(reference, prompt="w2 w7 w7")
    api = client(server)
    assert api.completions.create(model="tiny", prompt="w2 w7 w7", temperature=0, max_tokens=24).choices[0].text == want
    streamed = "".join(c.choices[0].text for c in api.completions.create(model="tiny", prompt="w2 w7 w7", temperature=0,
                                                                          max_tokens=24, stream=True) if c.choices)
    assert streamed == want


def test_stop_strings_cut_exactly_as_openai_does(served):
    server, reference = served
    messages = [{"role": "user", "content": "w5 w5 w1"}]
    want, _ = ar_text(reference, messages)
    words = want.split()
    stop = " ".join(words[3:5])  # a stop string spanning tokens, inside the text
    cut = want[: want.find(stop)]
    api = client(server)
    res = api.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=24, stop=[stop])
    assert res.choices[0].message.content == cut and res.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=24, stop=stop, stream=True) if c.choices)
    assert streamed == cut


def test_sixteen_concurrent_clients_get_their_own_answers(served):
    server, reference = served
    prompts = [f"w{i % VOCAB} w{(3 * i) % VOCAB} w{(5 * i + 1) % VOCAB}" for i in range(16)]
    wants = [ar_text(reference, [{"role": "user", "content": p}], n=12)[0] for p in prompts]

    def ask(i):
        stream = i % 2 == 0
        api = client(server)
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": prompts[i]}], temperature=0, max_tokens=12)
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(stream=True, **kwargs) if c.choices)
        return api.chat.completions.create(**kwargs).choices[0].message.content

    rounds, requests_in_rounds = _metric(server, "dartree:batch_size_count"), _metric(server, "dartree:batch_size_sum")
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    assert got == wants
    rounds = _metric(server, "dartree:batch_size_count") - rounds
    requests_in_rounds = _metric(server, "dartree:batch_size_sum") - requests_in_rounds
    assert requests_in_rounds / rounds > 1.5  # the requests were decoded together (at most 4 a round)


def test_sampled_answers_under_concurrency_equal_each_request_alone(served):
    """T > 0: each request's own seed gives its text whatever shares its rounds; ``top_k`` is
    sampling top-k (as in vLLM and in ``generate``) and ``tree_top_k`` DARTree's K."""
    server, reference = served
    cases = [dict(seed=s, top_k=k, tree_top_k=tk) for s, k, tk in [(0, -1, 2), (1, 3, 4), (2, 2, 2), (3, -1, 3), (4, 5, 2), (5, 1, 4)]]
    messages = [{"role": "user", "content": "w3 w1"}]

    def alone(case):
        return reference.generate(messages=messages, method="dartree", max_new_tokens=10, temperature=1.0, seed=case["seed"],
                                  top_k=case["top_k"] if case["top_k"] > 0 else None, tree_top_k=case["tree_top_k"],
                                  budget=8, stop_token_ids=[]).text

    def ask(case):
        body = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 1.0, "method": "dartree", **case}
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(ask, cases))
    assert got == [alone(c) for c in cases]
    assert len(set(got)) > 1
    greedy_like = ask(dict(seed=9, top_k=1, tree_top_k=2))  # sampling top-1 is greedy decoding
    assert greedy_like == ar_text(reference, messages, n=10)[0]


def test_a_disconnect_mid_stream_frees_the_engine(served):
    server, reference = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 200, "stream": True,
            "temperature": 0, "method": "ar"}
    before = _metric(server, 'dartree:requests_total{status="cancelled"}')
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content": "w' in line:
                    break  # one token arrived: hang up
    started = time.time()
    want, _ = ar_text(reference, [{"role": "user", "content": "w9"}], n=6)
    res = client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w9"}], temperature=0,
                                                 max_tokens=6)
    assert res.choices[0].message.content == want
    assert time.time() - started < 20
    deadline = time.time() + 10
    while _metric(server, 'dartree:requests_total{status="cancelled"}') < before + 1 and time.time() < deadline:
        time.sleep(0.1)
    assert _metric(server, 'dartree:requests_total{status="cancelled"}') == before + 1


def test_a_client_gone_before_its_whole_answer_frees_the_engine(served, monkeypatch):
    """Not streamed: the server polls for the hang-up and cancels the request as it does a stream's."""
    import dartree.server.app as app_module

    monkeypatch.setattr(app_module, "DISCONNECT_POLL_S", 0.005)
    server, reference = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 240, "temperature": 0,
            "method": "ar"}
    before = _metric(server, 'dartree:requests_total{status="cancelled"}')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.02)
    deadline = time.time() + 10
    while _metric(server, 'dartree:requests_total{status="cancelled"}') < before + 1 and time.time() < deadline:
        time.sleep(0.05)
    assert _metric(server, 'dartree:requests_total{status="cancelled"}') == before + 1
    want, _ = ar_text(reference, [{"role": "user", "content": "w9"}], n=6)  # and the next request is served as alone
    res = client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w9"}], temperature=0,
                                                 max_tokens=6)
    assert res.choices[0].message.content == want


@pytest.mark.parametrize("body, message", [
    ("{not json", "not valid JSON"),
    (json.dumps([1, 2]), "must be a JSON object"),
    (json.dumps({"messages": []}), "'messages' must be a non-empty list"),
    (json.dumps({"messages": [{"role": "user"}]}), "string 'role' and a string 'content'"),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}], "n": 2}), "'n' must be 1"),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}], "beta": 0.5}), "beta must be <= 0"),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}], "method": "nope"}), "unknown method 'nope'"),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}], "max_tokens": -3}), "'max_tokens' must be >= 1"),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}], "max_tokens": "many"}), "'max_tokens' must be an integer"),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}], "temperature": "hot"}), "'temperature' must be a number"),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}], "stream": "yes"}), "'stream' must be true or false"),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}], "top_p": 0}), "'top_p' must be > 0"),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}], "top_k": -2}), "'top_k' must be >= -1"),
    (json.dumps({"messages": [{"role": "user", "content": "w1"}], "method": 3}), "'method' must be a string"),
    (json.dumps({"messages": [{"role": "user", "content": "w1 " * 300}]}), "context"),
])
def test_bad_input_is_a_400_with_a_message(served, body, message):
    server, _ = served
    response = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200  # still serving


def test_metrics_count_what_was_served(served):
    server, _ = served
    before_requests = _metric(server, 'dartree:requests_total{status="ok"}')
    before_tokens = _metric(server, "dartree:generation_tokens_total")
    client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w4"}], temperature=0,
                                           max_tokens=10)
    assert _metric(server, 'dartree:requests_total{status="ok"}') == before_requests + 1
    assert _metric(server, "dartree:generation_tokens_total") == before_tokens + 10
    text = httpx.get(server.url + "/metrics").text
    for name in ("dartree:spec_decode_num_drafts_total", "dartree:spec_decode_num_accepted_tokens_total",
                 "dartree:mean_acceptance_length", "dartree:num_requests_waiting", "dartree:time_per_output_token_seconds",
                 "dartree:num_requests_running", "dartree:batch_size_bucket"):
        assert name in text
    # the budget weighs the forwards it measured: the served rounds moved the verify stage's scale off 1
    assert 0.0 < _metric(server, 'dartree:cost_model_scale{stage="verify"}') != 1.0


def _metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_server_of_a_target_without_a_drafter_answers_with_the_drafter_free_method(tmp_path):
    """``create_app`` of a pipeline without a drafter (a model the user brings): requests that name no method run the
    one that needs none and answer as ``ar``."""
    from tiny import make_tiny_target

    target = make_tiny_target(tmp_path / "target", vocab_size=VOCAB, seed=5, logit_scale=4.0, max_positions=256)
    pipe = dartree.load(target, dtype=torch.float64)
    reference = dartree.load(target, dtype=torch.float64)
    assert pipe.default_method == "ngram"
    with LiveServer(create_app(pipe, model_name="tiny")) as server:
        messages = [{"role": "user", "content": "w3 w4 w3 w4"}]
        answer = client(server).chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
        assert answer.choices[0].message.content == ar_text(reference, messages=messages, n=16)[0]
        named = httpx.post(server.url + "/v1/chat/completions",
                           json={"model": "tiny", "messages": messages, "max_tokens": 4, "method": "dartree"})
        assert named.status_code == 400 and "needs a drafter" in named.text
    with pytest.raises(dartree.DartreeError, match="cannot run on this pipeline"):  # defaults it cannot serve
        create_app(pipe, dartree.GenerationSettings(method="dartree"))


def test_text_assembler_never_splits_a_character_and_holds_back_a_possible_stop():
    class Bytes:  # a byte-level tokenizer: token i is byte i
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    euro = list("€".encode())  # three bytes
    a = TextAssembler(Bytes(), stop=["END"])
    assert a.add([ord("x")] + euro[:1]) == ""  # an incomplete character waits (the whole tail is held)
    assert a.add(euro[1:]) == "x€"
    assert a.add([ord("E"), ord("N")]) == ""  # could become the stop string
    assert a.add([ord("!")]) == "EN!"
    assert a.add(list(b"abcEND tail")) == "abc" and a.stopped


class WholeAnswerAssembler:
    """The assembler as it was, decoding the whole answer every round: the reference the incremental one must match."""

    def __init__(self, tokenizer, stop):
        self.tokenizer, self.stop, self.ids, self.sent, self.stopped = tokenizer, stop, [], 0, False

    def add(self, ids):
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [text.find(s) for s in self.stop if s in text]
        if hits:
            self.stopped = True
            return self._emit(text[: min(hits)])
        if text.endswith("\ufffd"):
            return ""
        hold, safe = max((len(s) - 1 for s in self.stop), default=0), len(text)
        for k in range(min(hold, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                safe = len(text) - k
                break
        return self._emit(text[:safe])

    def finish(self):
        return "" if self.stopped else self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _emit(self, upto):
        out = upto[self.sent:]
        self.sent = max(self.sent, len(upto))
        return out


class ByteLevel:  # GPT-2-style: a token is a few bytes (parts of multi-byte characters too)
    PIECES = [b"a", b"b", b" ", b"END", b"\n", b"\xe2", b"\x82", b"\xac", b"\xe2\x82", b"\xac!", b"\xf0\x9f", b"\x98\x80", b"ab"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.PIECES[i] for i in ids).decode("utf-8", errors="replace")


class SentencePieceLike:  # a word piece marks its leading space, and the text's first space is dropped
    PIECES = ["\u2581the", "\u2581cat", "s", "\u2581END", "!", "\u2581", "E", "ND", "\u2581a"]

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.PIECES[i] for i in ids).replace("\u2581", " ")
        return text[1:] if text.startswith(" ") else text


class WordLevel:  # words joined by spaces, token 0 a special token that decoding skips
    PIECES = ["<s>", "w1", "w2", "END", "w3!"]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i == 0))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([ByteLevel, SentencePieceLike, WordLevel]), st.data())
def test_the_incremental_assembler_writes_what_decoding_the_whole_answer_wrote(tokenizer_class, data):
    """Rounds of 1..6 tokens, stop strings or none: the text handed out round by round, the stop and the end are
    the reference's, which decoded the whole answer every round."""
    tokenizer = tokenizer_class()
    ids = data.draw(st.lists(st.integers(0, len(tokenizer.PIECES) - 1), min_size=0, max_size=40))
    stop = data.draw(st.sampled_from([[], ["END"], ["!", "ab"], ["cat"], ["\u20ac!"], ["b a"]]))
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=len(ids), max_size=len(ids)))
    new, old, at = TextAssembler(tokenizer, stop), WholeAnswerAssembler(tokenizer, stop), 0
    got, want = [], []
    for size in sizes:
        if at >= len(ids) or old.stopped:
            break
        got.append(new.add(ids[at:at + size]))
        want.append(old.add(ids[at:at + size]))
        at += size
    got.append(new.finish())
    want.append(old.finish())
    assert "".join(got) == "".join(want) and new.stopped == old.stopped
    assert got[:-1] == want[:-1]  # round by round, until the end


@pytest.mark.parametrize("rounds", [[[0, 3, 5]], [[0], [3, 5]], [[0, 3], [5]], [[0, 5], [6, 3]]])
def test_a_stop_string_in_a_round_that_ends_inside_a_character_stops_that_round(rounds):
    """"a", "END", then the first byte of "€": the stop is found in the round that brings it, as when the whole
    answer was decoded, although the text then ends inside a character."""
    new, old = TextAssembler(ByteLevel(), ["END"]), WholeAnswerAssembler(ByteLevel(), ["END"])
    for ids in rounds:
        assert new.add(ids) == old.add(ids)
        assert new.stopped == old.stopped
    assert new.finish() == old.finish()


def test_a_full_queue_is_a_429_and_an_internal_error_a_500_then_service_goes_on(served, tmp_path):
    server, reference = served
    pipe = reference  # a second server on the reference pipeline, with a queue of one
    release, calls = threading.Event(), {"n": 0}
    real_request = type(pipe).request

    def gated(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            release.wait(60)  # hold the engine thread on the first request
        if calls["n"] == 2:  # the queued request (the rejected one never reaches the engine)
            raise RuntimeError("simulated failure")
        return real_request(self, *args, **kwargs)

    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}], "max_tokens": 4, "temperature": 0}
    try:
        pipe.request = gated.__get__(pipe)
        with LiveServer(create_app(pipe, model_name="tiny", max_queue=1)) as second, ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, second.url + "/v1/chat/completions", json=body, timeout=60)
            time.sleep(0.5)  # the engine holds the first request
            waiting = pool.submit(httpx.post, second.url + "/v1/chat/completions", json=body, timeout=60)
            time.sleep(0.5)  # the second waits in the queue, which is now full
            busy = httpx.post(second.url + "/v1/chat/completions", json=body, timeout=60)
            assert busy.status_code == 429 and "busy" in busy.json()["error"]["message"]
            release.set()
            assert first.result().status_code == 200, first.result().text
            failed = waiting.result()
            assert failed.status_code == 500 and "simulated failure" in failed.json()["error"]["message"]
            again = httpx.post(second.url + "/v1/chat/completions", json=body, timeout=60)
            assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]
    finally:
        del pipe.request
