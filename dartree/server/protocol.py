"""The OpenAI protocol's side of the server: request bodies to validated settings (every bad input
an HTTP 400 with an OpenAI-style error body), and text assembled from token ids with stop strings."""

import json
from dataclasses import replace

from ..errors import DartreeError
from ..settings import GenerationSettings
from ..trees import TreeSettings

# dartree's own request fields (the method and every tree setting, under their declared names) ->
# GenerationSettings keywords. ``top_k`` is sampling top-k (``GenerationSettings.top_k``), as in vLLM's
# OpenAI server; DARTree's K (candidates per depth) is ``tree_top_k`` (``TreeSettings.tree_top_k``).
DART_FIELDS = {**{s.metadata["request"]: s.name for s in GenerationSettings.declarations() if s.metadata["dartree_only"]},
               **{s.metadata["request"]: s.name for s in TreeSettings.declarations()}}


class RequestError(Exception):
    """A bad request: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


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


def _generation_fields(body) -> tuple[dict, dict]:
    """The generation settings a request body gives, by their declarations (``GenerationSettings``):
    (settings it sets, settings it turns off, e.g. vLLM's ``top_k: -1``)."""
    given, off = {}, {}
    for setting in GenerationSettings.declarations():
        meta = setting.metadata
        for name in (*meta["aliases"], meta["request"]):  # the first field present wins
            if meta["parse"] is str:
                value = body.get(name)
                if value is not None and not isinstance(value, str):  # the registry lookup needs a hashable name
                    raise RequestError(f"'{name}' must be a string", param=name)
            else:
                value = _number(body, name, meta["low"], meta["high"], meta["parse"] is int, meta["low_open"])
            if value is not None:
                break
        if value is None:
            continue
        if value in meta["off"]:
            off[setting.name] = None
        else:
            given[setting.name] = value
    return given, off


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
    given, off = _generation_fields(body)
    tree = {s.name: body[s.metadata["request"]] for s in TreeSettings.declarations()
            if body.get(s.metadata["request"]) is not None}  # checked by TreeSettings.validate below, as for every caller
    try:
        settings = replace(GenerationSettings.from_kwargs(defaults, **given, **tree), **off).validate()
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
