"""Soak test of `dartree serve`: concurrent clients for a bounded time against one server on this machine
(loopback only), then checks that no request was lost, duplicated or changed and that the server's
memory held still. Exit status 0: no violation; 1: a violation (listed in the JSON summary); 2: the
run could not start (a bad option, a server that does not come up or refuses a one-word prompt).

    # against a server it starts itself (the bundled model unless --server-args names another), with an API key:
    .venv/bin/python scripts/soak.py --start-server --server-args "--threads 2 --max-batch 4" \\
        --clients 8 --minutes 10 --requests 5000 --out soak.json
    # against a running server (its process id for the memory check; its key, if any, from $DARTREE_API_KEY):
    .venv/bin/python scripts/soak.py --base-url http://127.0.0.1:8000 --server-pid 1234 --minutes 5 --out soak.json

First each request of a fixed pool is served alone, one at a time: chat prompts at T = 0, completions at
T > 0 with a seed, and a chat prompt at the longest the server accepts (found by asking; one word more
must be a 400). Then every client runs each kind of request below once (the warm-up), and then picks
kinds at random (seeded) until --minutes or --requests runs out:

- greedy / sampled / at_limit: a request of the pool, streamed or not; its answer must equal the one
  served alone;
- over_limit: the longest accepted prompt and one word more (400);
- hang_up: a stream the client drops after a chunk or two (its text so far a prefix of the answer alone);
- give_up: a request the client stops waiting for after a fraction of a second (the server sees the
  hang-up within a quarter second and cancels it, unless it finished first);
- bad_body: malformed JSON, wrong types, out-of-range values (400);
- oversize: a body one byte over --max-body-bytes, with a Content-Length and chunked (413);
- no_key: with an API key, a request without one or with a wrong one (401).

Checked (every violation is listed in the summary):
- every request answered as its kind requires: no 500, no other status, no failed connection, no
  error event inside a stream, and a 429 (queue full) only where the server may refuse;
- the answers equal the same requests served alone, and every answer id is unique;
- none lost, none duplicated: over the load, the server's /metrics count of requests ended
  (dartree:requests_total: ok, cancelled, error) grew by at least the requests the clients saw
  accepted (completed or hung up on) and at most those plus the ones they gave up on; error by none;
  ok by at least the completed ones; dartree:generation_tokens_total by at least the completed answers'
  tokens and at most max_tokens more for each other request it finished; and, once the load is over,
  nothing running or waiting;
- the server's resident memory (VmRSS) after the load within 5% of what it was after the warm-up.

The longest prompt is as long as the server allows: on a CPU, --server-args "--max-prompt-tokens 1024"
keeps its prefill (and the search for it, a few such requests) short.
"""

import argparse
import json
import os
import random
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx2 as httpx  # the HTTP client the openai package uses; it streams and sends chunked bodies

from dartree.cli.serve import API_KEY_ENV, is_loopback
from dartree.hardware import resident_mb
from dartree.server import ServerLimits

ROOT = Path(__file__).resolve().parent.parent

MEMORY_GROWTH_LIMIT = 0.05
ENDED = tuple(f'dartree:requests_total{{status="{status}"}}' for status in ("ok", "cancelled", "error"))
TOKENS = "dartree:generation_tokens_total"
BUSY = {"running": "dartree:num_requests_running", "waiting": "dartree:num_requests_waiting"}
# how often a client picks each kind of request
KINDS = {"greedy": 4, "sampled": 3, "at_limit": 1, "over_limit": 1, "hang_up": 2, "give_up": 1, "bad_body": 1,
         "oversize": 1, "no_key": 1}
# words of the tiny test models' vocabulary (w0 ... w15; any other word is their w0) and plain English for a real model
PROMPTS = ["w3 w1 w4 w1 w5", "w2 w7 w7", "Count from one to ten.", "Name three colours and a fruit.", "What is 12 times 7?",
           "w9 w2 w6 w5 w3 w5 w8"]


class SetupError(Exception):
    """The soak could not start: no server, or one that cannot serve its requests."""


@dataclass(frozen=True)
class Ask:
    """A request of the pool: its endpoint and body (streaming left to the client)."""

    name: str
    path: str
    body: dict


class Budget:
    """The load's bound: --requests requests, or until the deadline, whichever comes first."""

    def __init__(self, requests: int, seconds: float):
        self.left, self.deadline, self.lock = requests, time.monotonic() + seconds, threading.Lock()

    def take(self) -> bool:
        with self.lock:
            if self.left <= 0 or time.monotonic() >= self.deadline:
                return False
            self.left -= 1
            return True


def words(n: int) -> str:
    return " ".join(f"w{i % 16}" for i in range(n))


def chat_body(model: str, content: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}


def request_pool(model: str, max_tokens: int) -> list[Ask]:
    greedy = [Ask(f"greedy-{i}", "/v1/chat/completions", chat_body(model, p, max_tokens)) for i, p in enumerate(PROMPTS)]
    sampled = [Ask(f"sampled-{i}", "/v1/completions", {"model": model, "prompt": p, "max_tokens": max_tokens,
                                                       "temperature": 0.8, "seed": 100 + i}) for i, p in enumerate(PROMPTS)]
    return greedy + sampled


def bad_bodies(model: str) -> list[tuple[str, bytes]]:
    chat, message = "/v1/chat/completions", [{"role": "user", "content": "w1"}]
    wrong = [{"messages": []}, {"messages": [{"role": "user"}]}, {"messages": message, "max_tokens": -1},
             {"messages": message, "temperature": "hot"}, {"messages": message, "stop": 3}]
    return [(chat, b"{not json"), (chat, b"[1, 2]"), (chat, b"\xff\xfe"), ("/v1/completions", json.dumps({"prompt": ""}).encode()),
            *((chat, json.dumps({"model": model, **body}).encode()) for body in wrong)]


# ---------------------------------------------------------------- one request and its record
def record(kind: str, outcome: str, ask: Ask | None = None, status: int | None = None, **fields) -> dict:
    """What a client saw. outcome: completed (a whole answer), hung_up (the client dropped the stream),
    gave_up (the client stopped waiting), refused (the status its kind expects), busy (429), failed,
    timed_out (no answer within --request-timeout: a violation, though the server may still serve it)."""
    return {"kind": kind, "outcome": outcome, "ask": ask.name if ask else None, "status": status, **fields}


def stream_events(response):
    """The data events of a server-sent stream, parsed, then None for its closing data: [DONE]."""
    for line in response.iter_lines():
        if line == "data: [DONE]":
            yield None
            return
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


def event_text(event: dict, chat: bool) -> str:
    return "".join((c["delta"].get("content") or "") if chat else c["text"] for c in event["choices"])


def read_stream(response, chat: bool) -> tuple[str, int | None, set[str], str | None]:
    """(text, completion tokens from the usage chunk, answer ids, what was wrong or None) of a whole stream."""
    text, tokens, ids = "", None, set()
    for event in stream_events(response):
        if event is None:
            return text, tokens, ids, None
        if "error" in event:
            return text, tokens, ids, f"an error event: {event['error'].get('message')}"
        ids.add(event["id"])
        text += event_text(event, chat)
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return text, tokens, ids, "the stream ended without data: [DONE]"


def complete(http, kind: str, ask: Ask, stream: bool, hang_up_after: int | None = None, wait_s: float | None = None) -> dict:
    """``ask`` sent and answered in full, or dropped after ``hang_up_after`` data lines of its stream, or
    abandoned after ``wait_s`` seconds."""
    chat = ask.path.endswith("/chat/completions")
    body = {**ask.body, "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    try:
        if not stream:
            response = http.post(ask.path, json=body, **({"timeout": wait_s} if wait_s else {}))
            if response.status_code != 200:
                return unexpected(kind, ask, response)
            answer = response.json()
            choice = answer["choices"][0]
            text = choice["message"]["content"] if chat else choice["text"]
            return record(kind, "completed", ask, 200, text=text, tokens=answer["usage"]["completion_tokens"],
                          ids=[answer["id"]])
        with http.stream("POST", ask.path, json=body) as response:
            if response.status_code != 200:
                response.read()
                return unexpected(kind, ask, response)
            if hang_up_after is not None:
                return hang_up(kind, ask, response, chat, hang_up_after)
            text, tokens, ids, wrong = read_stream(response, chat)
    except httpx.TimeoutException:
        if wait_s:
            return record(kind, "gave_up", ask)
        raise
    if wrong or len(ids) != 1 or tokens is None:
        return record(kind, "failed", ask, 200, problem=f"stream: {wrong or 'no usage chunk'}, answer ids {sorted(ids)}")
    return record(kind, "completed", ask, 200, text=text, tokens=tokens, ids=sorted(ids))


def hang_up(kind: str, ask: Ask, response, chat: bool, after: int) -> dict:
    """The client drops the stream after ``after`` data events (leaving ``http.stream``'s block closes the connection)."""
    text, ids = "", set()
    for count, event in enumerate(stream_events(response), 1):
        if event is None or "error" in event:
            return record(kind, "failed", ask, 200,
                          problem=f"the stream ended after {count - 1} events, before the hang-up: {event}")
        ids.add(event["id"])
        text += event_text(event, chat)
        if count == after:
            return record(kind, "hung_up", ask, 200, text=text, ids=sorted(ids))
    return record(kind, "failed", ask, 200, problem="the stream ended without data: [DONE], before the hang-up")


def unexpected(kind: str, ask: Ask, response) -> dict:
    if response.status_code == 429:  # the queue was full: a refusal the server may make to any generating request
        return record(kind, "busy", ask, 429)
    return record(kind, "failed", ask, response.status_code, problem=f"HTTP {response.status_code}: {response.text[:300]}")


def expect(http, kind: str, status: int, path: str, content, headers: dict | None = None) -> dict:
    """A request the server must refuse with ``status``."""
    response = http.post(path, content=content, headers={"content-type": "application/json", **(headers or {})})
    if response.status_code == status:
        return record(kind, "refused", None, status)
    return record(kind, "failed", None, response.status_code,
                  problem=f"expected HTTP {status}, got {response.status_code}: {response.text[:300]}")


# ---------------------------------------------------------------- the clients
class Soak:
    """The pool, the answers served alone and what the clients send; ``run_kind`` is one request of a kind."""

    def __init__(self, args, model: str, key: str | None):
        self.args, self.model, self.key = args, model, key
        self.pool = request_pool(model, args.max_tokens)
        self.alone: dict[str, str] = {}
        self.longest: Ask | None = None  # found by find_longest_prompt, with its number of words
        self.longest_words = 0
        self.kinds = [k for k in KINDS if k != "no_key" or key]

    def client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        return httpx.Client(base_url=self.args.base_url, headers=headers, timeout=self.args.request_timeout)

    def find_longest_prompt(self, http) -> None:
        """The chat prompt of the most words the server accepts with max_tokens (its context, or a limit of
        its own, is reached): doubled while served, then halved between served and refused."""
        def served(n: int) -> bool:
            response = http.post("/v1/chat/completions", json=chat_body(self.model, words(n), self.args.max_tokens))
            if response.status_code in (400, 413):
                return False
            response.raise_for_status()
            return True

        if not served(1):
            raise SetupError("the server refuses a one-word prompt with --max-tokens; lower --max-tokens")
        low, high = 1, 2
        while served(high):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if served(middle) else (low, middle)
        self.longest_words = low
        self.longest = Ask(f"at_limit-{low}", "/v1/chat/completions",
                           chat_body(self.model, words(low), self.args.max_tokens))
        self.pool.append(self.longest)

    def serve_alone(self, http) -> None:
        for ask in self.pool:
            answer = complete(http, "alone", ask, stream=False)
            if answer["outcome"] != "completed":
                raise SetupError(f"served alone, {ask.name} was not answered: {answer}")
            self.alone[ask.name] = answer["text"]

    def run_kind(self, http, kind: str, rng: random.Random) -> dict:
        stream = rng.random() < 0.5  # also: Content-Length or chunked, the key missing or wrong
        greedy = [a for a in self.pool if a.name.startswith("greedy")]
        if kind in ("greedy", "sampled"):
            return complete(http, kind, rng.choice([a for a in self.pool if a.name.startswith(kind)]), stream)
        if kind == "at_limit":
            return complete(http, kind, self.longest, stream)
        if kind == "over_limit":
            body = chat_body(self.model, words(self.longest_words + 1), self.args.max_tokens)
            return expect(http, kind, 400, "/v1/chat/completions", json.dumps(body))
        if kind == "hang_up":
            return complete(http, kind, rng.choice(greedy), stream=True, hang_up_after=rng.randint(1, 2))
        if kind == "give_up":
            # 1 ms to 1 s, log-uniform: before the job is queued, while it waits, while it decodes
            return complete(http, kind, rng.choice(greedy), stream=False, wait_s=10 ** rng.uniform(-3, 0))
        if kind == "bad_body":
            return expect(http, kind, 400, *rng.choice(bad_bodies(self.model)))
        if kind == "oversize":
            body = b" " * (self.args.max_body_bytes + 1)
            content = body if stream else iter([body[i:i + 65536] for i in range(0, len(body), 65536)])  # chunked
            return expect(http, kind, 413, "/v1/chat/completions", content)
        if kind == "no_key":
            with httpx.Client(base_url=self.args.base_url, timeout=self.args.request_timeout) as keyless:
                wrong = {"Authorization": f"Bearer {self.key}x"} if stream else {}
                return expect(keyless, kind, 401, "/v1/chat/completions", json.dumps(chat_body(self.model, "w1", 1)), wrong)
        raise ValueError(f"unknown kind {kind!r}")

    def run_clients(self, plan) -> list[dict]:
        """Every client (its own connection and seeded choices) asking until ``plan(rng)`` gives no kind."""
        def one_client(index: int) -> list[dict]:
            rng, records = random.Random(self.args.seed * 1000 + index), []
            with self.client() as http:
                for kind in plan(rng):
                    try:
                        records.append(self.run_kind(http, kind, rng))
                    except httpx.TimeoutException as exc:  # a violation, but the server may still have served it
                        records.append(record(kind, "timed_out", problem=f"{type(exc).__name__} after "
                                              f"{self.args.request_timeout:g} s (--request-timeout): {exc}"))
                    except (httpx.HTTPError, ValueError, KeyError) as exc:
                        records.append(record(kind, "failed", problem=f"{type(exc).__name__}: {exc}"))
            return records

        with ThreadPoolExecutor(self.args.clients) as pool:
            return [r for records in pool.map(one_client, range(self.args.clients)) for r in records]


# ---------------------------------------------------------------- the server's side
def read_metrics(http) -> dict[str, float]:
    response = http.get("/metrics")
    response.raise_for_status()
    values = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def settle(http, timeout_s: float) -> tuple[dict[str, float], list[str]]:
    """The metrics once the server has ended every request it accepted (requests the clients gave up on
    run to their end): nothing running or waiting, and the count of ended requests still for a second.
    A violation when that does not come within ``timeout_s``."""
    deadline, last, still = time.monotonic() + timeout_s, None, 0
    while True:
        metrics = read_metrics(http)
        ended = sum(metrics.get(name, 0) for name in ENDED)
        idle = all(metrics.get(name, 0) == 0 for name in BUSY.values())
        still = still + 1 if idle and ended == last else 0
        if still >= 2:
            return metrics, []
        if time.monotonic() > deadline:
            busy = ", ".join(f"{metrics.get(name, 0):g} {what}" for what, name in BUSY.items())
            return metrics, [f"the server had not ended its requests {timeout_s:.0f} s after the clients stopped ({busy})"]
        last = ended
        time.sleep(0.5)


def start_server(args, key: str) -> subprocess.Popen:
    """``dartree serve`` on a free loopback port (``args.base_url`` set to it), with ``key`` as its API key."""
    from dartree.bench.llama_cpp import free_port, wait_healthy

    port = free_port()
    args.base_url = f"http://127.0.0.1:{port}"
    log_path = args.out.with_suffix(".server.log")
    command = [sys.executable, "-m", "dartree.cli", "serve", *shlex.split(args.server_args),
               # last, so that they win over --server-args: loopback only, and the body limit the oversize requests pass
               "--host", "127.0.0.1", "--port", str(port), "--max-body-bytes", str(args.max_body_bytes)]
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, API_KEY_ENV: key})  # not in argv, where other users could read it
    if not wait_healthy(proc, args.base_url, int(args.start_timeout * 2)):
        stop_server(proc)
        raise SetupError(f"dartree serve did not come up within {args.start_timeout:.0f} s; its output is in {log_path}")
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- the checks
def check_records(records: list[dict], alone: dict[str, str]) -> list[str]:
    """Each request answered as its kind requires, each answer equal to (a hung-up one a prefix of) the
    same request served alone, and no answer id twice."""
    violations, ids = [], Counter()
    for r in records:
        ids.update(r.get("ids", []))
        want = alone.get(r["ask"])
        if r["outcome"] in ("failed", "timed_out"):
            violations.append(f"{r['kind']}{' ' + r['ask'] if r['ask'] else ''}: {r['problem']}")
        elif r["outcome"] == "completed" and r["text"] != want:
            violations.append(f"{r['kind']} {r['ask']}: the answer {r['text']!r} is not the one served alone, {want!r}")
        elif r["outcome"] == "hung_up" and not want.startswith(r["text"]):
            violations.append(f"{r['kind']} {r['ask']}: the text before the hang-up {r['text']!r} does not begin the "
                              f"answer served alone, {want!r}")
    twice = sorted(i for i, n in ids.items() if n > 1)
    if twice:
        violations.append(f"{len(twice)} answer ids given to more than one request, e.g. {twice[0]}")
    return violations


def check_accounting(records: list[dict], before: dict[str, float], after: dict[str, float], max_tokens: int) -> list[str]:
    """The server's counts over the load against what its clients saw (see the module's docstring)."""
    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    outcomes = Counter(r["outcome"] for r in records)
    completed, hung_up, gave_up = outcomes["completed"], outcomes["hung_up"], outcomes["gave_up"]
    gave_up += outcomes["timed_out"]  # like a request given up on: the server may have served it
    ok, cancelled, error = (grew(name) for name in ENDED)
    ended, tokens = ok + cancelled + error, grew(TOKENS)
    seen_tokens = sum(r["tokens"] for r in records if r["outcome"] == "completed")
    violations = []
    if error:
        violations.append(f"{error:g} requests ended in an error on the server")
    if ended < completed + hung_up:
        violations.append(f"lost: the server ended {ended:g} requests, fewer than the {completed + hung_up} its clients saw "
                          f"accepted ({completed} completed, {hung_up} hung up on)")
    if ended > completed + hung_up + gave_up:
        violations.append(f"duplicated: the server ended {ended:g} requests, more than the {completed + hung_up + gave_up} "
                          f"it can have accepted ({completed} completed, {hung_up} hung up on, {gave_up} given up on "
                          "or timed out)")
    if ok < completed:
        violations.append(f"the server counted {ok:g} requests served to the end, fewer than the {completed} completed")
    if not seen_tokens <= tokens <= seen_tokens + max(ok - completed, 0) * max_tokens:
        violations.append(f"the server counted {tokens:g} generated tokens; the {completed} completed answers had "
                          f"{seen_tokens}, and the {max(ok - completed, 0):g} other requests it served to the end at "
                          f"most {max_tokens} each")
    return violations


def check_memory(after_warm_up_mb: float, after_load_mb: float) -> list[str]:
    growth = after_load_mb / after_warm_up_mb - 1
    if growth >= MEMORY_GROWTH_LIMIT:
        return [f"the server's resident memory grew {100 * growth:.1f}% over the load ({after_warm_up_mb:.0f} -> "
                f"{after_load_mb:.0f} MB), {100 * MEMORY_GROWTH_LIMIT:.0f}% allowed"]
    return []


# ---------------------------------------------------------------- the run
def soak(args, pid: int, key: str | None) -> dict:
    started = time.monotonic()
    with httpx.Client(base_url=args.base_url, headers={"Authorization": f"Bearer {key}"} if key else {},
                      timeout=args.request_timeout) as http:
        models = http.get("/v1/models")
        if models.status_code == 401:
            raise SetupError(f"the server needs an API key: give --api-key or ${API_KEY_ENV}")
        models.raise_for_status()
        runner = Soak(args, models.json()["data"][0]["id"], key)
        runner.find_longest_prompt(http)
        runner.serve_alone(http)
        warm_up = runner.run_clients(lambda rng: rng.sample(runner.kinds, len(runner.kinds)))
        before, violations = settle(http, args.request_timeout)
        after_warm_up_mb = resident_mb(pid)
        budget = Budget(args.requests, args.minutes * 60)
        weights = [KINDS[kind] for kind in runner.kinds]

        def load_plan(rng: random.Random):
            while budget.take():
                yield rng.choices(runner.kinds, weights)[0]

        load_started = time.monotonic()
        load = runner.run_clients(load_plan)
        load_s = time.monotonic() - load_started
        after, unsettled = settle(http, args.request_timeout)
        after_load_mb = resident_mb(pid)
    violations += unsettled + check_records(warm_up + load, runner.alone)
    violations += check_accounting(load, before, after, args.max_tokens) + check_memory(after_warm_up_mb, after_load_mb)
    outcomes: dict[str, Counter] = {}
    for r in load:
        outcomes.setdefault(r["kind"], Counter())[r["outcome"]] += 1
    return {"ok": not violations, "violations": violations, "base_url": args.base_url, "clients": args.clients,
            "seed": args.seed, "max_tokens": args.max_tokens, "longest_prompt_words": runner.longest_words,
            "requests": {"alone": len(runner.alone), "warm_up": len(warm_up), "load": len(load)},
            "load_outcomes": {kind: dict(counts) for kind, counts in sorted(outcomes.items())},
            "server_counted_over_load": {name: after.get(name, 0) - before.get(name, 0) for name in (*ENDED, TOKENS)},
            "memory_mb": {"after_warm_up": round(after_warm_up_mb, 1), "after_load": round(after_load_mb, 1),
                          "growth": round(after_load_mb / after_warm_up_mb - 1, 4)},
            "load_s": round(load_s, 1), "wall_s": round(time.monotonic() - started, 1)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--start-server", action="store_true", help="start `dartree serve` on a free loopback port")
    where.add_argument("--base-url", help="a running server on this machine, e.g. http://127.0.0.1:8000")
    ap.add_argument("--server-args", default="", help="with --start-server: its flags, e.g. \"--threads 2 --max-batch 4\" "
                    "(--host, --port and --max-body-bytes are the soak's)")
    ap.add_argument("--server-pid", type=int, help="with --base-url: the server's process id, for the memory check")
    ap.add_argument("--api-key", help=f"the server's API key (default: the first of ${API_KEY_ENV}; with --start-server "
                    "a random one)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    ap.add_argument("--minutes", type=float, default=5.0, help="the load's most minutes (default 5)")
    ap.add_argument("--requests", type=int, default=2000,
                    help="the load's most requests, all clients together (default 2000)")
    ap.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every generating request (default 32)")
    ap.add_argument("--max-body-bytes", type=int, default=ServerLimits().max_body_bytes,
                    help="the server's --max-body-bytes, which the oversized bodies pass by one byte (default: the "
                    "server's default; with --start-server, passed to it)")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds a request may take (default 120)")
    ap.add_argument("--start-timeout", type=float, default=600.0,
                    help="seconds the started server may take to come up (default 600)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the clients' choices (default 0)")
    ap.add_argument("--out", type=Path, default=Path("soak.json"),
                    help="the JSON summary (default soak.json); with --start-server, the server's output goes "
                    "beside it, in .server.log")
    args = ap.parse_args(argv)
    for name in ("clients", "requests", "max_tokens", "max_body_bytes"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.minutes > 0 or not args.request_timeout > 0:
        ap.error("--minutes and --request-timeout must be > 0")
    if args.base_url is not None:
        if not is_loopback(urlsplit(args.base_url).hostname or ""):
            ap.error(f"--base-url must be on this machine (127.0.0.1, ::1 or localhost), got {args.base_url}")
        if args.server_pid is None or not Path(f"/proc/{args.server_pid}/status").exists():
            ap.error("--base-url needs --server-pid, the process id of that server (for the memory check)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    key = args.api_key or next((k.strip() for k in os.environ.get(API_KEY_ENV, "").split(",") if k.strip()), None)
    proc = None
    try:
        if args.start_server:
            key = args.api_key or secrets.token_urlsafe(24)
            proc = start_server(args, key)
        summary = soak(args, proc.pid if proc else args.server_pid, key)
    except (SetupError, httpx.HTTPError) as exc:
        print(f"soak: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if proc is not None:
            stop_server(proc)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("ok", "requests", "memory_mb", "load_s")}))
    for violation in summary["violations"]:
        print(f"violation: {violation}", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
