"""The OpenAI protocol's side of the server: request bodies to validated settings (every bad input
an HTTP 400 with an OpenAI-style error body, within the server's ``ServerLimits``), and text assembled
from token ids with stop strings."""

import json
from dataclasses import dataclass, field, fields, replace

from ..errors import DartreeError
from ..settings import GenerationSettings
from ..trees import TreeSettings

# dartree's own request fields (the method and every tree setting, under their declared names) ->
# GenerationSettings keywords. ``top_k`` is sampling top-k (``GenerationSettings.top_k``), as in vLLM's
# OpenAI server; DARTree's K (candidates per depth) is ``tree_top_k`` (``TreeSettings.tree_top_k``).
DART_FIELDS = {**{s.metadata["request"]: s.name for s in GenerationSettings.declarations() if s.metadata["dartree_only"]},
               **{s.metadata["request"]: s.name for s in TreeSettings.declarations()}}

# the request fields of max_new_tokens, the first one a request gives taking precedence (as ``_generation_fields`` reads them)
_MAX_NEW_TOKENS = GenerationSettings.__dataclass_fields__["max_new_tokens"].metadata
_MAX_TOKENS_FIELDS = (*_MAX_NEW_TOKENS["aliases"], _MAX_NEW_TOKENS["request"])


class RequestError(Exception):
    """A bad request: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def _limit(default: int, flag: str, help: str):
    return field(default=default, metadata={"flag": flag, "help": help})


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of ``dartree serve``, each limit raised by its command-line flag
    (``metadata``: the flag and its help, from which ``dartree serve --help`` is made). The defaults
    live here only. A body over its limit is an HTTP 413, any other limit exceeded an HTTP 400; either
    message names the limit and its flag."""

    max_body_bytes: int = _limit(1 << 20, "--max-body-bytes", "most bytes of a request body")
    max_messages: int = _limit(256, "--max-messages", "most messages in one chat request")
    max_prompt_chars: int = _limit(100_000, "--max-prompt-chars", "most characters of a prompt (all its messages' roles "
                                   "and contents together), checked before tokenising")
    max_prompt_tokens: int = _limit(8192, "--max-prompt-tokens", "most tokens of a prompt, chat template included (it "
                                    "must also fit the target's context beside max_tokens)")
    max_tokens: int = _limit(4096, "--max-tokens-limit", "the largest max_tokens a request may ask for")
    max_stop: int = _limit(4, "--max-stop", "most entries of a request's stop list")
    max_stop_chars: int = _limit(256, "--max-stop-chars", "most characters of one stop string")

    def validate(self) -> "ServerLimits":
        for limit in fields(self):
            value = getattr(self, limit.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DartreeError(f"{limit.metadata['flag']} must be an integer >= 1, got {value!r}")
        return self

    def exceeded(self, name: str, what: str, param: str | None = None, status: int = 400) -> RequestError:
        """The error of a request over limit ``name``: ``what`` it asked, then the limit and its flag."""
        flag = self.__dataclass_fields__[name].metadata["flag"]
        return RequestError(f"{what}, over this server's limit of {getattr(self, name)} (set by dartree serve {flag})",
                            status, param)


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


def parse_request(body, defaults: GenerationSettings, chat: bool, limits: ServerLimits = ServerLimits()):
    """(messages or prompt, settings, stop strings, stream, include_usage) of a request body, within
    ``limits`` (the prompt's tokens are checked once tokenised, by the caller)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    source = _prompt_source(body, chat, limits)
    n = _number(body, "n", integer=True)
    if n is not None and n != 1:
        raise RequestError(f"'n' must be 1: one completion per request (got {n})", param="n")
    stop = _stop_strings(body, limits)
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
    if settings.max_new_tokens > limits.max_tokens:
        asked = next(name for name in _MAX_TOKENS_FIELDS if body.get(name) is not None)  # the defaults are checked at start
        raise limits.exceeded("max_tokens", f"'{asked}' is {settings.max_new_tokens}", param=asked)
    return source, settings, stop, stream, bool(options.get("include_usage", False))


# Where each engine's users put structured output: OpenAI's response_format, vLLM's guided_* fields and
# structured_outputs object, llama.cpp's json_schema and grammar; each maps to structured.OutputFormat.parse
_GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "json_schema": "json_schema", "grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def structured_format(body: dict):
    """The structured output a request asks for, as ``structured.OutputFormat.parse`` takes it (None:
    none); more than one way of asking, or a field of the wrong type, is a ``RequestError``."""
    asked = []
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise RequestError("'response_format' must be an object like {\"type\": \"json_object\"}", param="response_format")
        if response_format.get("type") not in (None, "text"):
            asked.append(("response_format", response_format))
    for name, kind in _GUIDED_FIELDS.items():
        if body.get(name) is not None:
            asked.append((name, {kind: body[name]}))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise RequestError("'structured_outputs' must be an object like {\"regex\": \"...\"}", param="structured_outputs")
        asked += [("structured_outputs", {kind: outputs[name]}) for name, kind in _STRUCTURED_OUTPUTS.items()
                  if outputs.get(name) is not None]
    if len(asked) > 1:
        raise RequestError(f"give one structured output format, got {', '.join(name for name, _ in asked)}",
                           param=asked[1][0])
    return asked[0][1] if asked else None


def _prompt_source(body: dict, chat: bool, limits: ServerLimits):
    """The messages (chat) or the prompt text of a request body, checked against the limits that need
    no tokenizer, so an oversized prompt is refused before any tokenising."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {role, content} objects", param="messages")
        if len(messages) > limits.max_messages:
            raise limits.exceeded("max_messages", f"'messages' has {len(messages)} entries", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError("every message must be an object with a string 'role' and a string 'content'", param="messages")
        chars, param = sum(len(m["role"]) + len(m["content"]) for m in messages), "messages"
        source = messages
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError("'prompt' must be a non-empty string", param="prompt")
        chars, param = len(prompt), "prompt"
        source = prompt
    if chars > limits.max_prompt_chars:
        raise limits.exceeded("max_prompt_chars", f"the prompt is {chars} characters", param=param)
    return source


def _stop_strings(body: dict, limits: ServerLimits) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise RequestError("'stop' must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > limits.max_stop:
        raise limits.exceeded("max_stop", f"'stop' has {len(stop)} entries", param="stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > limits.max_stop_chars:
        raise limits.exceeded("max_stop_chars", f"a 'stop' entry is {longest} characters", param="stop")
    return stop


class TextAssembler:
    """Token ids in, text out: never splits a multi-byte character, cuts at the first stop string
    exactly as OpenAI does (the stop string itself is not returned), and holds back a tail that could
    still become a stop string.

    The text grows by decoding a window of the last tokens, not the whole answer each round (SmolLM2's
    tokenizer: 245 us for 1,000 tokens, 440 for 2,000, on an AMD EPYC Zen 3): the window starts at the
    tokens added the round before (the decoded text's last whole characters), so that a tokenizer which
    drops a leading space or merges across a boundary decodes the new tokens in context, as vLLM does."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.longest = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:read]
        self.prefix = self.read = 0  # ids[prefix:read]: the context the next window starts with
        self.searched = 0  # the text before this holds no stop string
        self.sent = 0  # characters already handed out
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _grow(self, final: bool = False) -> tuple[str, bool]:
        """The text with the new tokens decoded, and whether it ends on a whole character (always when ``final``);
        only then is it kept (the next window starts after these tokens)."""
        if self.read == len(self.ids):
            return self.text, True
        window, known = self._decode(self.ids[self.prefix:]), self._decode(self.ids[self.prefix:self.read])
        text = self.text + window[len(known):]
        if window.endswith("\ufffd") and not final:  # an incomplete UTF-8 sequence: wait for the next tokens
            return text, False
        if len(text) > len(self.text):  # tokens that wrote nothing (special ones) are no context for the next window
            self.prefix = self.read
        self.text, self.read = text, len(self.ids)
        return text, True

    def _first_stop(self, text: str) -> int | None:
        """Where the first stop string starts in ``text`` (None: nowhere), searching only past what ``text``
        shares with the kept text searched before."""
        start = max(0, self.searched - self.longest + 1)  # a stop string may end in the new text
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def add(self, ids: list[int]) -> str:
        self.ids += ids
        text, whole = self._grow()
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        if not whole:
            return ""
        self.searched = len(text)
        # hold back only a tail that is the start of some stop string
        safe = len(text)
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                safe = len(text) - k
                break
        return self._emit(text[:safe])

    def finish(self) -> str:
        if self.stopped:
            return ""
        text, _ = self._grow(final=True)
        cut = self._first_stop(text)
        self.stopped = cut is not None
        return self._emit(text if cut is None else text[:cut])

    def _emit(self, upto: str) -> str:
        out = upto[self.sent:]
        self.sent = max(self.sent, len(upto))
        return out
