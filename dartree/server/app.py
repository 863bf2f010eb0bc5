"""The FastAPI routes of ``dartree serve`` over one ``EngineWorker``."""

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass, replace

from .. import __version__
from ..errors import DartreeError
from ..settings import GenerationSettings
from .protocol import RequestError, ServerLimits, TextAssembler, parse_request, structured_format
from .worker import EngineWorker, Job

# how often a request that is not streamed checks that its client is still there (a stream learns it
# when a write fails); a hang-up is seen within this time and the engine drops the request a round later
DISCONNECT_POLL_S = 0.25


def create_app(pipe, defaults: GenerationSettings | None = None, model_name: str = "dartree", max_queue: int = 16,
               max_batch: int = 1, limits: ServerLimits | None = None, api_keys: tuple[str, ...] = (),
               public_metrics: bool = False):
    """The app serving ``pipe``. ``limits``: what one request may ask (``ServerLimits``' defaults when
    None). ``api_keys``: when any, every path but /health (and /metrics with ``public_metrics``) needs
    ``Authorization: Bearer <one of them>``, else HTTP 401."""
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse
    from prometheus_client import generate_latest

    pipelines_method = defaults is None  # none handed in: the pipeline's own default method (ngram without a drafter)
    defaults, limits, keys = checked_config(defaults, limits, api_keys)
    if pipelines_method:
        defaults = replace(defaults, method=pipe.default_method)
    if defaults.method not in pipe.methods:
        raise DartreeError(f"the requests' default method {defaults.method!r} cannot run on this pipeline (it supports "
                           f"{', '.join(pipe.methods)}); pick one of those (--method)")
    worker = EngineWorker(pipe, max_queue=max_queue, max_batch=max_batch)
    app = FastAPI(title="dartree", version=__version__)
    if keys:
        app.add_middleware(_RequireApiKey, keys=keys, public=frozenset({"/health", *(["/metrics"] if public_metrics else [])}))
    app.state.worker = worker
    served = _Served(pipe, pipe.tokenizer, worker, defaults, model_name, limits)

    @app.exception_handler(Exception)
    async def internal(_request, exc):  # the next request still works
        return _error(RequestError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "dartree"}]}

    @app.get("/metrics")
    async def metrics():
        worker.queue_length.set(worker.jobs.qsize())
        return PlainTextResponse(generate_latest(worker.registry).decode(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _completion(served, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _completion(served, request, chat=False)

    return app


@dataclass(frozen=True)
class _Served:
    """What every route of one app serves from: the pipeline, its tokenizer, the engine worker, the
    requests' default settings, the model id /v1/models reports and the limits of one request."""

    pipe: object
    tokenizer: object
    worker: EngineWorker
    defaults: GenerationSettings
    model_name: str
    limits: ServerLimits


def checked_config(defaults: GenerationSettings | None, limits: ServerLimits | None, api_keys) \
        -> tuple[GenerationSettings, ServerLimits, tuple[bytes, ...]]:
    """``create_app``'s settings validated (None: the defaults), the API keys as the bytes an
    Authorization header carries; a ``DartreeError`` for a bad one. The command line calls it too,
    before the model loads."""
    defaults = (defaults or GenerationSettings()).validate()
    limits = (limits or ServerLimits()).validate()
    if defaults.max_new_tokens > limits.max_tokens:
        raise DartreeError(f"the requests' default max_new_tokens ({defaults.max_new_tokens}) is over the "
                           f"max_tokens limit ({limits.max_tokens}, --max-tokens-limit); lower one or raise the other")
    return defaults, limits, _checked_api_keys(api_keys)


def _checked_api_keys(api_keys) -> tuple[bytes, ...]:
    """A key is visible ASCII: a header cannot carry other characters reliably, and spaces around a
    key would be stripped in transit."""
    if isinstance(api_keys, str):
        raise DartreeError("api_keys must be a list of keys, not one string")
    for position, key in enumerate(api_keys, 1):
        # the key itself is never echoed: it is a secret, and the message may end up in a log
        if not isinstance(key, str) or not key or not all("!" <= c <= "~" for c in key):
            raise DartreeError(f"API key {position} of {len(api_keys)} is not a non-empty string of visible ASCII "
                               "characters (no spaces)")
    return tuple(key.encode("ascii") for key in api_keys)


def _key_matches(given: bytes, keys: tuple[bytes, ...]) -> bool:
    """Whether ``given`` is one of ``keys``, in time that does not depend on where it differs from
    any of them: every key is compared, in constant time, whichever matched."""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key)
    return matched


class _RequireApiKey:
    """ASGI middleware: a request for any path outside ``public`` needs ``Authorization: Bearer <key>``
    with one of ``keys``, or it is answered HTTP 401 before any route runs. A middleware rather than a
    check in each route, so that the paths FastAPI adds itself (/docs, /openapi.json) and unknown
    paths are behind the key too; a plain ASGI one, which passes a stream and its disconnect through
    untouched."""

    def __init__(self, app, keys: tuple[bytes, ...], public: frozenset[str]):
        self.app, self.keys, self.public = app, keys, public

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.public:
            refusal = self._refusal(next((v for k, v in scope["headers"] if k == b"authorization"), b""))
            if refusal is not None:
                response = _error(refusal)
                response.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: the scheme a 401 asks for
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, authorization: bytes) -> RequestError | None:
        scheme, _, key = authorization.partition(b" ")
        key = key.strip()
        if scheme.lower() != b"bearer" or not key:
            return RequestError("this server needs an API key: send the header 'Authorization: Bearer <key>'", 401,
                                kind="authentication_error", code="missing_api_key")
        if not _key_matches(key, self.keys):
            return RequestError("the API key is not valid", 401, kind="authentication_error", code="invalid_api_key")
        return None


def _error(exc: RequestError):
    from fastapi.responses import JSONResponse

    return JSONResponse(exc.body(), status_code=exc.status)


async def _read_body(request, limits: ServerLimits) -> bytes:
    """The request body, refused with HTTP 413 past ``limits.max_body_bytes``: by its Content-Length
    before any of it is read, else as it arrives (a chunked body declares no length), so an oversized
    body is never held whole. uvicorn reads and drops what is left of a refused body, so the client,
    still sending, gets the 413 rather than a reset connection."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")  # digits only: uvicorn refuses any other
    if declared is not None and int(declared) > limit:
        raise limits.exceeded("max_body_bytes", f"the request body is {declared} bytes", status=413)
    received = bytearray()
    async for chunk in request.stream():
        received += chunk
        if len(received) > limit:
            raise limits.exceeded("max_body_bytes", f"the request body is at least {len(received)} bytes", status=413)
    return bytes(received)


def _submit(served: _Served, raw: bytes, chat: bool):
    """A request body checked and handed to the engine: (job, stream, include_usage); a bad one is a
    ``RequestError`` (a 400, answered now rather than later from the engine)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON: {exc}") from None
    source, settings, stop, stream, include_usage = parse_request(body, served.defaults, chat, served.limits)
    if served.tokenizer is None:
        raise RequestError("this model has no tokenizer, so it cannot serve text requests", status=500, kind="server_error")
    pipe = served.pipe
    try:
        ids = pipe.encode(messages=source) if chat else pipe.encode(input_ids=served.tokenizer(source)["input_ids"] or [0])
        if ids.numel() > served.limits.max_prompt_tokens:
            raise served.limits.exceeded("max_prompt_tokens", f"the prompt is {ids.numel()} tokens",
                                         param="messages" if chat else "prompt")
        pipe.check_request(ids, settings)
        constraint = pipe.constraint(structured_format(body))  # compiled (and checked) before any decoding
    except DartreeError as exc:
        raise RequestError(str(exc)) from None
    job = Job(ids.tolist(), settings, stop, constraint=constraint)
    served.worker.submit(job)
    return job, stream, include_usage


async def _completion(served: _Served, request, chat: bool):
    from fastapi.responses import Response, StreamingResponse

    try:
        job, stream, include_usage = _submit(served, await _read_body(request, served.limits), chat)
    except RequestError as exc:
        return _error(exc)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    kind = "chat.completion" if chat else "text_completion"
    prompt_tokens = len(job.input_ids)
    if stream:
        return StreamingResponse(_stream(served, job, rid, created, kind, chat, prompt_tokens, include_usage),
                                 media_type="text/event-stream")
    collecting = asyncio.ensure_future(_collect(served, job))
    while not (await asyncio.wait({collecting}, timeout=DISCONNECT_POLL_S))[0]:
        if await request.is_disconnected():
            # nobody will read the answer: free the slot at the engine's next round, as a stream does
            job.cancelled.set()
            await collecting
            return Response(status_code=499)
    text, result, finish = collecting.result()
    if result is None:
        return _error(RequestError(f"internal error: {finish}", status=500, kind="server_error"))
    choice = {"index": 0, "finish_reason": finish, "logprobs": None}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return {"id": rid, "object": kind, "created": created, "model": served.model_name, "choices": [choice],
            "usage": _usage(prompt_tokens, result)}


def _usage(prompt_tokens, result):
    return {"prompt_tokens": prompt_tokens, "completion_tokens": result.stats.new_tokens,
            "total_tokens": prompt_tokens + result.stats.new_tokens,
            "mean_acceptance_length": result.stats.mean_acceptance}


def _finish_reason(served: _Served, result, assembler, max_new_tokens: int) -> str:
    """OpenAI's: "length" when max_tokens cut the text, "stop" at a stop token or stop string."""
    if assembler.stopped:
        return "stop"
    ids = result.token_ids
    ended = bool(ids) and ids[-1] in served.pipe.default_stop_ids()
    return "length" if len(ids) >= max_new_tokens and not ended else "stop"


async def _next_event(job):
    return await asyncio.to_thread(job.events.get)


async def _collect(served: _Served, job):
    """The whole text of a job that is not streamed: (text, result, finish reason); result None: an
    internal error, whose message is the third."""
    assembler = TextAssembler(served.tokenizer, job.stop)
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
            return text, value, _finish_reason(served, value, assembler, job.settings.max_new_tokens)
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


def _chunk(served: _Served, rid, created, kind, chat, include_usage, delta_text=None, finish=None, role=False) -> str:
    """One server-sent event of a streamed completion, in the OpenAI chunk format."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": delta_text} if delta_text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
    payload = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": served.model_name,
               "choices": [choice]}
    if include_usage:
        payload["usage"] = None
    return f"data: {json.dumps(payload)}\n\n"


async def _stream(served: _Served, job, rid, created, kind, chat, prompt_tokens, include_usage):
    assembler = TextAssembler(served.tokenizer, job.stop)

    def chunk(delta_text=None, finish=None, role=False):
        return _chunk(served, rid, created, kind, chat, include_usage, delta_text, finish, role)

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
                result, finish = value, _finish_reason(served, value, assembler, job.settings.max_new_tokens)
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
            payload = {"id": rid, "object": kind + ".chunk" if chat else kind, "created": created, "model": served.model_name,
                       "choices": [], "usage": _usage(prompt_tokens, result)}
            yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # a client gone mid-stream frees the engine at its next round


class _Partial:
    """Usage of a generation a stop string or a disconnect ended early."""

    def __init__(self, new_tokens: int):
        self.stats = type("S", (), {"new_tokens": new_tokens, "mean_acceptance": 0.0})()
