"""`dartree serve` behind an API key and within its request limits, through HTTP against a live server
on 127.0.0.1 (tiny float64 models), with the real `openai` client where a client sends the key."""

import json
import socket
import time

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
import torch
from test_server import LiveServer

import dartree
from dartree.errors import DartreeError
from dartree.server import ServerLimits, create_app

KEYS = ("key-one", "key-two")
LIMITS = ServerLimits(max_body_bytes=4096, max_messages=3, max_prompt_chars=200, max_prompt_tokens=20, max_tokens=16,
                      max_stop=2, max_stop_chars=5)
DEFAULTS = dartree.GenerationSettings(max_new_tokens=8, tree=dartree.TreeSettings(budget=8))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tiny import make_tiny_drafter, make_tiny_target

    root = tmp_path_factory.mktemp("secure")
    target = make_tiny_target(root / "target", vocab_size=16, seed=3, logit_scale=4.0, max_positions=256)
    return target, make_tiny_drafter(root / "drafter", target, head="domino", block_size=6, seed=4)


def pipeline(models):
    """A pipeline of its own for each app: an app's engine thread owns its pipeline."""
    return dartree.load(*models, dtype=torch.float64)


@pytest.fixture(scope="module")
def server(models):
    app = create_app(pipeline(models), DEFAULTS, model_name="tiny", max_queue=8, max_batch=2, limits=LIMITS, api_keys=KEYS)
    with LiveServer(app) as live:
        yield live


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def chat(content="w1 w2", **fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **fields}


def post(server, body, path="/v1/chat/completions", key=KEYS[0]) -> httpx.Response:
    """``body``: a dict sent as JSON, text or bytes as they are, an iterator of bytes as a chunked body."""
    content = json.dumps(body) if isinstance(body, dict) else body
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json", **bearer(key)},
                      timeout=60)


def served_requests(server) -> float:
    text = httpx.get(server.url + "/metrics", headers=bearer(KEYS[0])).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("dartree:requests_total{"))


def assert_refused(response, code: str):
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == code and KEYS[0] not in error["message"]


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions"),
                                          ("POST", "/v1/completions"), ("GET", "/docs"), ("GET", "/openapi.json"),
                                          ("GET", "/no-such-path")])
def test_every_path_but_health_needs_the_key(server, method, path):
    before = served_requests(server)
    body = json.dumps(chat()) if method == "POST" else None
    assert_refused(httpx.request(method, server.url + path, content=body), "missing_api_key")
    assert_refused(httpx.request(method, server.url + path, content=body, headers=bearer("key-three")), "invalid_api_key")
    assert httpx.get(server.url + "/health").status_code == 200
    assert served_requests(server) == before  # a refused request never reached the engine


@pytest.mark.parametrize("authorization, code", [
    ("key-one", "missing_api_key"),  # no scheme
    ("Basic key-one", "missing_api_key"),
    ("Bearer", "missing_api_key"),
    ("Bearer key-on", "invalid_api_key"),  # a prefix of a key
    ("Bearer key-one2", "invalid_api_key"),  # a key and more
    ("Bearer KEY-ONE", "invalid_api_key"),
])
def test_a_wrong_or_malformed_authorization_is_a_401(server, authorization, code):
    assert_refused(httpx.get(server.url + "/v1/models", headers={"Authorization": authorization}), code)


def test_every_configured_key_is_accepted(server):
    for key in KEYS:
        assert httpx.get(server.url + "/v1/models", headers=bearer(key)).json()["data"][0]["id"] == "tiny"
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": "bearer key-two"}).status_code == 200


def test_the_openai_client_sends_its_api_key(server):
    api = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[1], max_retries=0, timeout=60)
    assert [m.id for m in api.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "w3 w1"}]
    answer = api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == answer.choices[0].message.content and answer.usage.completion_tokens == 6
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="key-three", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_public_metrics_leaves_the_rest_behind_the_key(models):
    app = create_app(pipeline(models), DEFAULTS, model_name="tiny", api_keys=KEYS, public_metrics=True)
    with LiveServer(app) as live:
        assert "dartree:requests_total" in httpx.get(live.url + "/metrics").text
        assert_refused(httpx.get(live.url + "/v1/models"), "missing_api_key")


def test_api_keys_are_checked_when_the_app_is_made(models):
    for bad in (["has space"], [""], ["naïve"], "one-string"):
        with pytest.raises(DartreeError, match="API key|list of keys"):
            create_app(None, api_keys=bad)  # refused before the pipeline is touched
    with pytest.raises(DartreeError, match="--max-messages must be an integer >= 1"):
        create_app(None, limits=ServerLimits(max_messages=0))
    with pytest.raises(DartreeError, match="--max-tokens-limit"):
        create_app(None, defaults=dartree.GenerationSettings(max_new_tokens=17), limits=LIMITS)


def test_every_key_is_compared_whichever_matches(monkeypatch):
    from dartree.server import app as server_app

    compared = []
    real = server_app.hmac.compare_digest
    monkeypatch.setattr(server_app.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    keys = (b"first", b"second", b"third")
    assert server_app._key_matches(b"first", keys) and compared == list(keys)
    assert not server_app._key_matches(b"fourth", keys)


def words(n: int) -> str:
    return " ".join(f"w{i % 16}" for i in range(n))


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "w1"}] * 4), "messages",
     "'messages' has 4 entries, over this server's limit of 3 (set by dartree serve --max-messages)"),
    ("/v1/chat/completions", chat("w1 " * 70), "messages",
     "the prompt is 214 characters, over this server's limit of 200 (set by dartree serve --max-prompt-chars)"),
    ("/v1/completions", {"prompt": "w1 " * 67, "max_tokens": 4}, "prompt",
     "the prompt is 201 characters, over this server's limit of 200 (set by dartree serve --max-prompt-chars)"),
    ("/v1/chat/completions", chat(words(21)), "messages",
     "the prompt is 21 tokens, over this server's limit of 20 (set by dartree serve --max-prompt-tokens)"),
    ("/v1/completions", {"prompt": words(21), "max_tokens": 4}, "prompt",
     "the prompt is 21 tokens, over this server's limit of 20 (set by dartree serve --max-prompt-tokens)"),
    ("/v1/chat/completions", chat(max_tokens=17), "max_tokens",
     "'max_tokens' is 17, over this server's limit of 16 (set by dartree serve --max-tokens-limit)"),
    ("/v1/completions", {"prompt": "w1", "max_completion_tokens": 17, "max_tokens": 4}, "max_completion_tokens",
     "'max_completion_tokens' is 17, over this server's limit of 16 (set by dartree serve --max-tokens-limit)"),
    ("/v1/chat/completions", chat(stop=["w1", "w2", "w3"]), "stop",
     "'stop' has 3 entries, over this server's limit of 2 (set by dartree serve --max-stop)"),
    ("/v1/chat/completions", chat(stop="w1 w2 w3"), "stop",
     "a 'stop' entry is 8 characters, over this server's limit of 5 (set by dartree serve --max-stop-chars)"),
])
def test_a_request_over_a_limit_is_a_400_naming_the_limit_and_its_flag(server, path, body, param, message):
    before = served_requests(server)
    response = post(server, body, path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error == {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    assert served_requests(server) == before


def test_a_request_at_every_limit_is_served(server):
    # 3 messages, 20 tokens through the chat template (a word a token), max_tokens 16, 2 stop strings of 5 characters
    messages = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2"}, {"role": "user", "content": words(18)}]
    assert post(server, chat(messages=messages, max_tokens=16, stop=["w1 w1", "w2 w2"])).status_code == 200
    # a prompt of 200 characters, one token
    assert post(server, {"prompt": "w1" + " " * 198, "max_tokens": 16}, "/v1/completions").status_code == 200
    assert post(server, chat(stop=[])).status_code == 200  # no stop strings at all


def test_an_oversized_body_is_a_413_with_or_without_a_length(server):
    base = json.dumps(chat())
    exactly = (base + " " * (LIMITS.max_body_bytes - len(base))).encode()  # JSON may end in spaces
    assert post(server, exactly).status_code == 200
    assert post(server, iter([exactly[:2000], exactly[2000:]])).status_code == 200  # chunked: no Content-Length
    over = exactly + b" "
    limit = "over this server's limit of 4096 (set by dartree serve --max-body-bytes)"
    for body, message in ((over, f"the request body is 4097 bytes, {limit}"),
                          (iter([over[:3000], over[3000:]]), f"the request body is at least 4097 bytes, {limit}")):
        response = post(server, body)
        assert response.status_code == 413, response.text
        assert response.json()["error"] == {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    assert httpx.get(server.url + "/health").status_code == 200


def raw_request(server, head: str, body_parts=(), wait_s: float = 10.0) -> bytes:
    """Send ``head`` and ``body_parts`` on one socket without finishing the body, and read what the
    server answers meanwhile."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as sock:
        sock.sendall(head.encode())
        for part in body_parts:
            sock.sendall(part)
        answer = b""
        deadline = time.time() + wait_s
        while b"\r\n\r\n" not in answer and time.time() < deadline:
            received = sock.recv(65536)
            if not received:  # closed
                break
            answer += received
        return answer


def test_the_body_limit_refuses_before_the_body_arrives(server):
    """A Content-Length over the limit is answered at once, with no byte of the body sent; a chunked body
    as soon as its chunks pass the limit, while the client is still sending."""
    started = time.time()
    answer = raw_request(server, f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                                 "Content-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413") and time.time() - started < 5
    chunk = b"%x\r\n%s\r\n" % (3000, b" " * 3000)
    answer = raw_request(server, f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n"
                                 "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n", [chunk, chunk])
    assert answer.startswith(b"HTTP/1.1 413")


def test_the_command_line_reads_keys_and_limits_and_warns_off_loopback(models, monkeypatch, capsys):
    from dartree.cli import main, serve

    apps = []
    monkeypatch.setattr(serve, "load_pipeline", lambda *args, **kwargs: pipeline(models))
    monkeypatch.setattr("uvicorn.run", lambda app, host, port, log_level: apps.append(app))
    common = ["serve", "--max-batch", "1", "--budget", "8", "--max-new-tokens", "4", "--max-messages", "2",
              "--threads", str(torch.get_num_threads())]  # the test process's own count: main sets it process-wide
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    assert main([*common, "--host", "0.0.0.0"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["dartree serve: warning: listening on 0.0.0.0, beyond this machine, with no API key: anyone who "
                        "can reach port 8000 can use the model (give --api-key or $DARTREE_API_KEY)"]
    monkeypatch.setenv(serve.API_KEY_ENV, " env-one , env-two,")
    assert main([*common, "--host", "0.0.0.0", "--api-key", "flag-key"]) == 0
    assert "warning" not in capsys.readouterr().err
    with LiveServer(apps[-1]) as live:
        for key in ("flag-key", "env-one", "env-two"):
            assert httpx.get(live.url + "/v1/models", headers=bearer(key)).status_code == 200
        assert_refused(httpx.get(live.url + "/v1/models"), "missing_api_key")
        body = chat(messages=[{"role": "user", "content": "w1"}] * 3)
        response = post(live, body, key="env-two")
        assert response.status_code == 400 and "(set by dartree serve --max-messages)" in response.json()["error"]["message"]
    monkeypatch.delenv(serve.API_KEY_ENV)
    assert main([*common, "--host", "::1"]) == 0 and main([*common, "--host", "localhost"]) == 0
    assert "warning" not in capsys.readouterr().err
    loads = len(apps)
    for bad, message in ((["--api-key", "two words"], "API key 1 of 1"), (["--max-stop", "0"], "--max-stop must be"),
                         (["--max-new-tokens", "5000"], "--max-tokens-limit")):
        assert main(["serve", *bad]) == 2
        assert message in capsys.readouterr().err
    assert len(apps) == loads  # each refused before the model loads


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
                                            ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("example.org", False)])
def test_loopback_hosts(host, loopback):
    from dartree.cli.serve import is_loopback

    assert is_loopback(host) is loopback
