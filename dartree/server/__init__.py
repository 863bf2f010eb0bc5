"""``dartree serve``: an OpenAI-compatible HTTP server on the batched engine.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``stream: true`` as server-sent events in the OpenAI chunk format, ending with ``data: [DONE]``),
``GET /health`` and ``GET /metrics`` (Prometheus text, names after vLLM's under a ``dartree:`` prefix).

Three parts: ``protocol`` (a request body to validated settings, text assembled from tokens with
stop strings, the error bodies), ``worker`` (the engine thread: jobs join the batched
``engine.Engine`` between rounds, up to ``--max-batch`` at once; a full queue answers HTTP 429; a
client that disconnects frees its slot at the next round; a request that fails after admission gets
its own 500 and the others go on) and ``app`` (the FastAPI routes, behind an API key when given one).
What one request may ask (body bytes, messages, prompt characters and tokens, max_tokens, stop strings)
is bounded by ``ServerLimits``.
"""

from .app import checked_config, create_app
from .protocol import DART_FIELDS, RequestError, ServerLimits, TextAssembler, parse_request
from .worker import EngineWorker, Job

__all__ = ["checked_config", "create_app", "DART_FIELDS", "EngineWorker", "Job", "RequestError", "ServerLimits",
           "TextAssembler", "parse_request"]
