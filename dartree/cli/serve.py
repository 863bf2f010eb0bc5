"""`dartree serve`: the OpenAI-compatible server's command line (the server itself is ``dartree.server``)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from dataclasses import fields

from ..costmodel import default_max_batch
from ..errors import DartreeError
from ..pipeline import load as load_pipeline
from ..server import DART_FIELDS, ServerLimits, checked_config, create_app
from .args import add_generation_args, add_model_args, add_threads_arg, add_tree_args, generation_settings, with_pipeline_method

API_KEY_ENV = "DARTREE_API_KEY"


def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the model over the OpenAI HTTP API (chat/completions, completions, streaming, /metrics)",
        description="An OpenAI-compatible server on the speculative engine: GET /v1/models, POST /v1/chat/completions "
        "and /v1/completions (stream: true for server-sent events), GET /health, GET /metrics (Prometheus). Requests "
        "are decoded together, up to --max-batch at once, each round one target forward over all of them (requests "
        "join and leave between rounds); the rest wait in a bounded queue (HTTP 429 when full). dartree's own "
        f"settings ({', '.join(DART_FIELDS)}) may be given as extra fields of a request body.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--model-name", default="dartree", help="the model id reported by /v1/models (default dartree)")
    p.add_argument("--max-queue", type=int, default=16, help="requests that may wait before HTTP 429 (default 16)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="requests decoded together in one round (default: from this machine's cost model, the most "
                   "requests whose one-row forward costs at most twice a single request's, up to 16; 1 on the Hugging "
                   "Face forward, which holds one request)")
    p.add_argument("--api-key", dest="api_keys", action="append", default=[], metavar="KEY",
                   help="a key every request but GET /health (and GET /metrics with --public-metrics) must send as "
                   "the header 'Authorization: Bearer KEY' (HTTP 401 otherwise); give it again for more keys. Also "
                   f"read from ${API_KEY_ENV} (keys separated by commas), which other users of the machine cannot "
                   "read from the process list as they can a flag (default: no key, every request served)")
    p.add_argument("--public-metrics", action="store_true",
                   help="with an API key, serve GET /metrics without one (for a Prometheus scraper)")
    p.add_argument("--suffix-cache", type=float, default=0.0, metavar="MB",
                   help="keep the most recent answers (about MB megabytes, least recently used out) for the n-gram "
                   "proposer of every later request (methods ngram and dartree with --ngram on): more accepted where "
                   "answers repeat across requests, the same output; it shares statistics between requests, since "
                   "what one request proposes then depends on what earlier ones answered (default 0: off)")
    add_limit_args(p)
    add_generation_args(p, defaults_of="requests' default: ")
    add_threads_arg(p)
    add_model_args(p)
    add_tree_args(p)
    p.set_defaults(func=_run_serve)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """The limits of one request, as ``ServerLimits`` declares them (its defaults are the flags')."""
    g = p.add_argument_group("request limits", "what one request may ask; a request over a limit gets an error "
                             "that names the limit and its flag (HTTP 413 for the body, 400 for the rest)")
    for limit in fields(ServerLimits):
        g.add_argument(limit.metadata["flag"], dest=limit.name, type=int, default=limit.default, metavar="N",
                       help=f"{limit.metadata['help']} (default {limit.default})")


def api_keys(args) -> list[str]:
    """The keys of --api-key and of $DARTREE_API_KEY (comma-separated; empty entries, as of a trailing comma, skipped)."""
    from_env = [key.strip() for key in os.environ.get(API_KEY_ENV, "").split(",")]
    return [*args.api_keys, *(key for key in from_env if key)]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (localhost, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def _run_serve(args) -> int:

    import uvicorn

    defaults = generation_settings(args)
    limits = ServerLimits(**{limit.name: getattr(args, limit.name) for limit in fields(ServerLimits)})
    keys = api_keys(args)
    checked_config(defaults, limits, keys)  # before the model loads (seconds)
    if not 0 < args.port < 65536:
        raise DartreeError(f"--port must be between 1 and 65535, got {args.port}")
    if args.max_queue < 1:
        raise DartreeError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not args.suffix_cache >= 0:
        raise DartreeError(f"--suffix-cache must be a size in MB >= 0 (0: off), got {args.suffix_cache}")
    pipe = load_pipeline(args.target, args.drafter, dtype=args.dtype, device=args.device, weights=args.weights)
    pipe.use_suffix_cache(args.suffix_cache)
    defaults = with_pipeline_method(defaults, args, pipe)
    if args.max_batch is not None and args.max_batch < 1:
        raise DartreeError(f"--max-batch must be >= 1, got {args.max_batch}")
    max_batch = args.max_batch
    if max_batch is None:
        max_batch = default_max_batch(pipe.cost_model()) if pipe.target.max_slots is None else pipe.target.max_slots
    app = create_app(pipe, defaults, args.model_name, args.max_queue, max_batch, limits, tuple(keys), args.public_metrics)
    print(f"dartree serve: listening on http://{args.host}:{args.port}/v1 (model {args.model_name!r}, method "
          f"{defaults.method}, budget {defaults.tree.budget}, max batch {max_batch}, "
          f"{f'{len(keys)} API key(s)' if keys else 'no API key'}"
          f"{f', suffix cache {args.suffix_cache:g} MB' if args.suffix_cache else ''})", file=sys.stderr)
    if not keys and not is_loopback(args.host):
        print(f"dartree serve: warning: listening on {args.host}, beyond this machine, with no API key: anyone who "
              f"can reach port {args.port} can use the model (give --api-key or ${API_KEY_ENV})", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
