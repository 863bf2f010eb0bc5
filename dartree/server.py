"""``dartree serve``: an OpenAI-compatible HTTP server on the speculative engine.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``stream: true`` as server-sent events in the OpenAI chunk format, ending with ``data: [DONE]``),
``GET /health`` and ``GET /metrics`` (Prometheus text, names after vLLM's under a ``dartree:`` prefix).

One engine thread serves requests in arrival order from a bounded queue (batching across requests is
a later step): a full queue answers HTTP 429; a client that disconnects cancels its generation at the
next round and the next request starts at once. Every bad input is an HTTP 400 with an OpenAI-style
error body; an internal error is a 500 with a message, and the server keeps serving.
"""


import asyncio
import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from . import __version__
from .engine import FINISH_CANCELLED, FINISH_ERROR
from .errors import DartreeError
from .hardware import hand_over_threads
from .pipeline import GenerationResult
from .settings import GenerationSettings
from .trees import TreeSettings

# dartree's own settings as extra body fields -> their GenerationSettings names. ``top_k`` itself is
# sampling top-k, as in vLLM's OpenAI server; DARTree's K (candidates per depth) is ``tree_top_k``.
# dartree's own request fields -> GenerationSettings keywords: the method and every tree setting under its declared name
DART_FIELDS = {"method": "method", **{s.metadata["request"]: s.name for s in TreeSettings.declarations()}}


class RequestError(Exception):
    """A bad request: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


@dataclass
class Job:
    input_ids: list[int]
    settings: GenerationSettings
    stop: list[str]
    events: "queue.Queue[tuple[str, object]]" = field(default_factory=queue.Queue)  # ("tokens", list) | ("done", result) | ("error", msg)
    cancelled: threading.Event = field(default_factory=threading.Event)


class Engine:
    """The engine thread: jobs join the batched engine (``engine.Engine``) between rounds, up to
    ``max_batch`` at once, each round ONE target forward over all of them; the rest wait in a bounded
    queue (HTTP 429 beyond it). A job whose client went away (or whose stop string matched) is
    cancelled at the next round and its slot freed; a job that fails gets its own error and the
    others go on."""

    def __init__(self, pipe, max_queue: int = 16, max_batch: int = 1):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.pipe = pipe
        self.batch = pipe.engine(max_batch)
        self.max_batch = self.batch.max_batch
        self.jobs: "queue.Queue[Job]" = queue.Queue(maxsize=max_queue)
        self.registry = CollectorRegistry()
        p = "dartree:"
        self.requests = Counter(p + "requests", "requests served to the end", ["status"], registry=self.registry)
        self.generated = Counter(p + "generation_tokens", "tokens generated", registry=self.registry)
        self.drafts = Counter(p + "spec_decode_num_drafts", "request rounds (a request's share of one target forward)", registry=self.registry)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "tree nodes verified", registry=self.registry)
        self.accepted = Counter(p + "spec_decode_num_accepted_tokens", "draft tokens accepted", registry=self.registry)
        self.accepted_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos", "accepted draft tokens by depth",
                                    ["position"], registry=self.registry)
        self.mean_acceptance = Gauge(p + "mean_acceptance_length", "committed tokens per round (tau), all requests",
                                     registry=self.registry)
        self.queue_length = Gauge(p + "num_requests_waiting", "requests waiting in the queue", registry=self.registry)
        self.running = Gauge(p + "num_requests_running", "requests in the running batch", registry=self.registry)
        self.batch_size = Histogram(p + "batch_size", "requests per round (one target forward)", registry=self.registry,
                                    buckets=tuple(2 ** i for i in range(7)))
        self.tpot = Histogram(p + "time_per_output_token_seconds", "decode time per output token", registry=self.registry,
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0))
        self._rounds = 0
        self._committed = 0
        hand_over_threads()  # this thread loaded and measured the model; the engine thread computes from now on
        self.thread = threading.Thread(target=self._work, name="dartree-engine", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise RequestError(f"the server is busy: {self.jobs.maxsize} requests are already waiting; retry later",
                               status=429, kind="rate_limit_error") from None
        self.queue_length.set(self.jobs.qsize())

    def _admit(self, job: Job) -> None:
        """A job becomes a request of the batched engine (it waits there for a free slot)."""
        if job.cancelled.is_set():
            job.events.put(("cancelled", None))
            self.requests.labels("cancelled").inc()
            return
        try:
            request = self.pipe.request(torch.tensor(job.input_ids), job.settings,
                                        on_tokens=lambda new, job=job: job.events.put(("tokens", list(new))),
                                        cancelled=job.cancelled.is_set, alone=False)
        except Exception as exc:  # noqa: BLE001 - reported to the client as a 500
            job.events.put(("error", f"{type(exc).__name__}: {exc}"))
            self.requests.labels("error").inc()
            return
        request.job = job
        self.batch.submit(request)

    def _work(self) -> None:
        while True:
            # Idle: wait for a job. Busy: take the jobs that arrived, up to the free room, without waiting.
            if not self.batch.busy:
                self._admit(self.jobs.get())
            while len(self.batch.waiting) + len(self.batch.active) < self.max_batch:
                try:
                    self._admit(self.jobs.get_nowait())
                except queue.Empty:
                    break
            self.queue_length.set(self.jobs.qsize() + len(self.batch.waiting))
            try:
                finished = self.batch.step()
            except Exception as exc:  # noqa: BLE001 - the forward itself failed: every request in it gets the error
                finished = self.batch.abort(exc)
            self.running.set(len(self.batch.active))
            if self.batch.batch_sizes:
                self.batch_size.observe(self.batch.batch_sizes[-1])
            for r in finished:
                self._finish(r)

    def _finish(self, request) -> None:
        job = request.job
        reason = request.stats.finish_reason
        if reason == FINISH_CANCELLED:
            job.events.put(("cancelled", None))
            self.requests.labels("cancelled").inc()
        elif reason == FINISH_ERROR:
            job.events.put(("error", f"{type(request.error).__name__}: {request.error}"))
            self.requests.labels("error").inc()
        else:
            tokenizer = self.pipe.tokenizer
            text = tokenizer.decode(request.output, skip_special_tokens=True) if tokenizer is not None else None
            self._account(request.stats)
            job.events.put(("done", GenerationResult(token_ids=request.output, text=text, stats=request.stats)))
            self.requests.labels("ok").inc()

    def _account(self, stats) -> None:
        self.generated.inc(stats.new_tokens)
        self.drafts.inc(stats.rounds)
        self.draft_tokens.inc(sum(stats.tree_sizes))
        self.accepted.inc(sum(a - 1 for a in stats.acceptance_lengths))
        for a in stats.acceptance_lengths:
            for pos in range(a - 1):
                self.accepted_pos.labels(str(pos)).inc()
        self._rounds += stats.rounds
        self._committed += sum(stats.acceptance_lengths)
        if self._rounds:
            self.mean_acceptance.set(self._committed / self._rounds)
        if stats.new_tokens and stats.decode_seconds > 0:
            self.tpot.observe(stats.decode_seconds / stats.new_tokens)


# ---------------------------------------------------------------- request parsing


def _number(body, name, low=None, high=None, integer=False, low_open=False):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok:
        raise RequestError(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(value)}", param=name)
    if low is not None and (value <= low if low_open else value < low):
        raise RequestError(f"'{name}' must be {'>' if low_open else '>='} {low}, got {value}", param=name)
    if high is not None and value > high:
        raise RequestError(f"'{name}' must be <= {high}, got {value}", param=name)
    return value


def parse_request(body, defaults: GenerationSettings, chat: bool):
    """(messages or prompt, settings, stop strings, stream, include_usage) of a request body."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError("every message must be an object with a string 'role' and a string 'content'", param="messages")
        source = messages
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string", param="prompt")
        source = prompt
    n = _number(body, "n", integer=True)
    if n is not None and n != 1:
        raise RequestError(f"'n' must be 1: one completion per request (got {n})", param="n")
    max_tokens = _number(body, "max_completion_tokens", low=1, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", low=1, integer=True)
    temperature = _number(body, "temperature", low=0, high=2)
    top_p = _number(body, "top_p", low=0, high=1, low_open=True)
    seed = _number(body, "seed", integer=True)
    sampling_top_k = _number(body, "top_k", low=-1, integer=True)
    if sampling_top_k is not None and sampling_top_k <= 0:  # vLLM: -1 (or 0) turns top-k off
        sampling_top_k = None
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 4):
        raise RequestError("'stop' must be a string or a list of at most 4 non-empty strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("'stream_options' must be an object like {\"include_usage\": true}", param="stream_options")
    extra = {field: body[name] for name, field in DART_FIELDS.items() if body.get(name) is not None}
    if "method" in extra and not isinstance(extra["method"], str):  # the registry lookup needs a hashable name
        raise RequestError("'method' must be a string", param="method")
    # the tree settings are checked by TreeSettings.validate below, as for every caller
    try:
        settings = GenerationSettings.from_kwargs(
            defaults, max_new_tokens=max_tokens, temperature=temperature, top_p=top_p if top_p != 1 else None,
            sampling_top_k=sampling_top_k, seed=seed, **extra).validate()
    except DartreeError as exc:
        raise RequestError(str(exc)) from None
    return source, settings, stop, stream, bool(options.get("include_usage", False))


class TextAssembler:
    """Token ids in, text out: never splits a multi-byte character, cuts at the first stop string
    exactly as OpenAI does (the stop string itself is not returned), and holds back a tail that could
    still become a stop string."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.stopped = False

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [text.find(s) for s in self.stop if s in text]
        if hits:
            self.stopped = True
            return self._emit(text[: min(hits)])
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next tokens
            return ""
        hold = max((len(s) - 1 for s in self.stop), default=0)
        # hold back only a tail that is the start of some stop string
        safe = len(text)
        for k in range(min(hold, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                safe = len(text) - k
                break
        return self._emit(text[:safe])

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _emit(self, upto: str) -> str:
        out = upto[self.sent:]
        self.sent = max(self.sent, len(upto))
        return out


# ---------------------------------------------------------------- the app


def create_app(pipe, defaults: GenerationSettings | None = None, model_name: str = "dartree", max_queue: int = 16,
               max_batch: int = 1):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import generate_latest

    defaults = (defaults or GenerationSettings()).validate()
    engine = Engine(pipe, max_queue=max_queue, max_batch=max_batch)
    app = FastAPI(title="dartree", version=__version__)
    app.state.engine = engine
    tokenizer = pipe.tokenizer

    def error(exc: RequestError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal(_request, exc):  # the next request still works
        return error(RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dartree"}]}

    @app.get("/metrics")
    async def metrics():
        engine.queue_length.set(engine.jobs.qsize())
        return PlainTextResponse(generate_latest(engine.registry).decode(), media_type="text/plain; version=0.0.4")

    async def completion(request: Request, chat: bool):
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(f"the request body is not valid JSON: {exc}") from None
            source, settings, stop, stream, include_usage = parse_request(body, defaults, chat)
            if tokenizer is None:
                raise RequestError("this model has no tokenizer, so it cannot serve text requests", status=500, kind="server_error")
            try:
                ids = pipe.encode(messages=source) if chat else pipe.encode(input_ids=tokenizer(source)["input_ids"] or [0])
                pipe.check_request(ids, settings)  # answered now as a 400, not later from the engine
            except DartreeError as exc:
                raise RequestError(str(exc)) from None
            job = Job(ids.tolist(), settings, stop)
            engine.submit(job)
        except RequestError as exc:
            return error(exc)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        prompt_tokens = len(job.input_ids)
        if stream:
            return StreamingResponse(_stream(job, rid, created, kind, chat, prompt_tokens, include_usage),
                                     media_type="text/event-stream")
        text, result, finish = await _collect(job)
        if result is None:
            return error(RequestError(f"internal error: {finish}", status=500, kind="server_error"))
        choice = {"index": 0, "finish_reason": finish, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice],
                "usage": _usage(prompt_tokens, result)}

    def _usage(prompt_tokens, result):
        return {"prompt_tokens": prompt_tokens, "completion_tokens": result.stats.new_tokens,
                "total_tokens": prompt_tokens + result.stats.new_tokens,
                "mean_acceptance_length": result.stats.mean_acceptance}

    def _finish_reason(result, assembler, max_new_tokens: int) -> str:
        """OpenAI's: "length" when max_tokens cut the text, "stop" at a stop token or stop string."""
        if assembler.stopped:
            return "stop"
        ids = result.token_ids
        ended = bool(ids) and ids[-1] in pipe.default_stop_ids()
        return "length" if len(ids) >= max_new_tokens and not ended else "stop"

    async def _next_event(job):
        return await asyncio.to_thread(job.events.get)

    async def _collect(job):
        assembler = TextAssembler(tokenizer, job.stop)
        text = ""
        while True:
            kind, value = await _next_event(job)
            if kind == "tokens":
                text += assembler.add(value)
                if assembler.stopped:
                    job.cancelled.set()
                    break
            elif kind == "done":
                text += assembler.finish()
                return text, value, _finish_reason(value, assembler, job.settings.max_new_tokens)
            else:
                return "", None, value
        # stopped by a stop string: wait for the engine to notice, then report
        while True:
            kind, value = await _next_event(job)
            if kind in ("done", "cancelled", "error"):
                stats_src = value if kind == "done" else None
                break
        result = stats_src if stats_src is not None else _Partial(len(assembler.ids))
        return text, result, "stop"

    async def _stream(job, rid, created, kind, chat, prompt_tokens, include_usage):
        assembler = TextAssembler(tokenizer, job.stop)

        def chunk(delta_text=None, finish=None, role=False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": delta_text} if delta_text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
            payload = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": model_name,
                       "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        try:
            if chat:
                yield chunk(role=True)
            result, finish = None, "stop"
            while True:
                event, value = await _next_event(job)
                if event == "tokens":
                    piece = assembler.add(value)
                    if piece:
                        yield chunk(piece)
                    if assembler.stopped:
                        job.cancelled.set()
                elif event == "done":
                    piece = assembler.finish()
                    if piece:
                        yield chunk(piece)
                    result, finish = value, _finish_reason(value, assembler, job.settings.max_new_tokens)
                    break
                elif event == "cancelled":
                    result = _Partial(len(assembler.ids))
                    break
                else:
                    yield f"data: {json.dumps(RequestError(f'internal error: {value}', 500, kind='server_error').body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
            yield chunk(finish=finish)
            if include_usage:
                payload = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": model_name,
                           "choices": [], "usage": _usage(prompt_tokens, result)}
                yield f"data: {json.dumps(payload)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()  # a client gone mid-stream frees the engine at its next round

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    return app


class _Partial:
    """Usage of a generation a stop string or a disconnect ended early."""

    def __init__(self, new_tokens: int):
        self.stats = type("S", (), {"new_tokens": new_tokens, "mean_acceptance": 0.0})()


__all__ = ["create_app", "Engine", "TextAssembler", "parse_request", "RequestError"]
