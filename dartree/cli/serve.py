"""`dartree serve`: the OpenAI-compatible server's command line (the server itself is ``dartree.server``)."""

from __future__ import annotations

import sys

from ..costmodel import default_max_batch
from ..errors import DartreeError
from ..pipeline import load as load_pipeline
from ..server import DART_FIELDS, create_app
from .args import add_generation_args, add_model_args, add_threads_arg, add_tree_args, generation_settings


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
    add_generation_args(p, defaults_of="requests' default: ")
    add_threads_arg(p)
    add_model_args(p)
    add_tree_args(p)
    p.set_defaults(func=_run_serve)


def _run_serve(args) -> int:

    import uvicorn

    defaults = generation_settings(args)
    if not 0 < args.port < 65536:
        raise DartreeError(f"--port must be between 1 and 65535, got {args.port}")
    if args.max_queue < 1:
        raise DartreeError(f"--max-queue must be >= 1, got {args.max_queue}")
    pipe = load_pipeline(args.target, args.drafter, dtype=args.dtype, device=args.device, weights=args.weights)
    if args.max_batch is not None and args.max_batch < 1:
        raise DartreeError(f"--max-batch must be >= 1, got {args.max_batch}")
    max_batch = args.max_batch
    if max_batch is None:
        max_batch = default_max_batch(pipe.cost_model()) if pipe.target.max_slots is None else pipe.target.max_slots
    app = create_app(pipe, defaults, args.model_name, args.max_queue, max_batch)
    print(f"dartree serve: listening on http://{args.host}:{args.port}/v1 (model {args.model_name!r}, method "
          f"{defaults.method}, budget {defaults.tree.budget}, max batch {max_batch})", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
