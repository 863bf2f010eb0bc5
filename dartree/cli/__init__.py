"""Command line: ``dartree generate``, ``dartree bench-tree``, ``dartree train``, ``dartree bench``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..calibration import load_or_measure
from ..engine import ROUND_STAGES
from ..errors import DartreeError
from ..hardware import set_threads
from ..pipeline import load as load_pipeline
from .args import OneLineErrorParser, add_generation_args, add_model_args, add_threads_arg, add_tree_args, generation_settings, with_pipeline_method
from .bench import add_bench_parser, add_bench_tree_parser
from .serve import add_serve_parser
from .train import add_train_parser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="dartree",
        description="Lossless speculative decoding with block-diffusion drafters and autoregressive draft trees.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate text with one decoding method",
        description="Generate a continuation. Every method returns exactly what the target alone would write "
        "(token for token at temperature 0, the same distribution above 0); they differ in speed.",
    )
    gen.add_argument("prompt", help="the user message (wrapped in the chat template when the tokenizer has one)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template; feed the prompt text as is")
    add_generation_args(gen)
    gen.add_argument("--json", action="store_true", help="print a machine-readable JSON result")
    structured = gen.add_argument_group("structured output", "the answer matches it (every method stays exact: "
                                        "the target's distribution is the one the format allows); give at most one")
    structured.add_argument("--json-schema", metavar="FILE", help="a JSON schema file the answer must validate against")
    structured.add_argument("--regex", help="a regular expression the whole answer must match")
    structured.add_argument("--grammar", metavar="FILE", help="a Lark or GBNF (llama.cpp) grammar file the answer must match")
    add_threads_arg(gen)
    add_model_args(gen)
    add_tree_args(gen)
    gen.set_defaults(func=_run_generate)

    cal = sub.add_parser(
        "calibrate",
        help="measure this machine's cost model (target forwards by rows, drafter call, tree build) and show it",
        description="Time a target forward over 1, 2, 3, 4, 6, ... 128 rows at a given context, one drafter call and "
        "one dartree tree build, print them as a table (with the tau a round needs to break even) and draw them. "
        "The result is cached per target, drafter, device, dtype, threads and CPU; budget='auto' uses it.",
    )
    add_model_args(cal)
    add_threads_arg(cal)
    cal.add_argument("--context", type=int, default=256, help="context length the forwards are appended to (default 256)")
    cal.add_argument("--remeasure", action="store_true", help="measure again even when a cached cost model exists")
    cal.add_argument("--plot", default="cost_model.png", help="where to draw the cost curve (default cost_model.png)")
    cal.add_argument("--json", action="store_true", help="print the cost model as JSON")
    cal.set_defaults(func=_run_calibrate)

    add_bench_tree_parser(sub)
    add_train_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    return parser


def _structured_format(args) -> dict | None:
    """--json-schema / --regex / --grammar as a ``response_format`` (the files read and checked to exist)."""
    given = [name for name in ("json_schema", "regex", "grammar") if getattr(args, name) is not None]
    if len(given) > 1:
        raise DartreeError(f"give one of --json-schema, --regex, --grammar, not {' and '.join('--' + g.replace('_', '-') for g in given)}")
    if not given:
        return None
    if given[0] == "regex":
        return {"regex": args.regex}
    path = Path(getattr(args, given[0]))
    if not path.is_file():
        raise DartreeError(f"--{given[0].replace('_', '-')}: no file {path}")
    text = path.read_text()
    if given[0] == "grammar":
        return {"grammar": text}
    try:
        return {"json_schema": json.loads(text)}
    except json.JSONDecodeError as exc:
        raise DartreeError(f"--json-schema: {path} is not valid JSON ({exc})") from None


def _run_generate(args) -> int:
    # Every setting is checked before the model loads (which takes seconds).
    settings = generation_settings(args)
    if not args.prompt.strip():
        raise DartreeError("the prompt is empty; give some text")
    response_format = _structured_format(args)
    pipe = load_pipeline(args.target, args.drafter, dtype=args.dtype, device=args.device, weights=args.weights)
    settings = with_pipeline_method(settings, args, pipe)
    kwargs = dict(settings=settings, response_format=response_format)
    streaming = not args.json and pipe.tokenizer is not None
    if streaming:  # print the text as each round is verified
        from transformers import TextStreamer

        kwargs["streamer"] = TextStreamer(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True)
    if args.raw:
        if pipe.tokenizer is None:
            raise DartreeError("this target has no tokenizer")
        ids = pipe.tokenizer(args.prompt)["input_ids"]
        result = pipe.generate(input_ids=ids, **kwargs)
    else:
        result = pipe.generate(args.prompt, **kwargs)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        s = result.stats
        if not streaming:
            print(result.token_ids)
        print(
            f"\n[{s.method} on {pipe.target.name}] {s.new_tokens} tokens in {s.rounds} rounds, mean acceptance {s.mean_acceptance:.2f}, "
            f"{s.tokens_per_second:.1f} tokens/s ("
            + ", ".join(f"{stage} {s.stage_ms.get(stage, 0.0):.0f} ms" for stage in ROUND_STAGES) + ")",
            file=sys.stderr,
        )
        undrafted = [n for n, d in zip(s.tree_sizes, s.drafted) if not d]
        if settings.tree.auto and settings.method != "ar" and undrafted:
            # Otherwise a mean acceptance near 1 reads as a broken drafter.
            free = sum(1 for n in undrafted if n)
            print(f"[budget auto] {len(undrafted)} of {s.rounds} rounds made no proposer call ({free} of them verified what "
                  f"came free: the text's repeats, a grammar's forced tokens; {len(undrafted) - free} were plain steps): on "
                  "this machine's cost model (`dartree calibrate`) the call was expected to cost more than it brings; "
                  "--budget 16 forces a tree every round", file=sys.stderr)
    return 0


def _run_calibrate(args) -> int:
    if args.context < 1:
        raise DartreeError(f"--context must be >= 1, got {args.context}")
    pipe = load_pipeline(args.target, args.drafter, dtype=args.dtype, device=args.device, cost_model=None,
                         weights=args.weights)
    cost = load_or_measure(pipe.target, pipe.proposer, pipe.head, args.context, remeasure=args.remeasure)
    print(cost.to_json() if args.json else cost.table())
    if args.plot:
        print(f"\ncost curve drawn in {cost.plot(args.plot)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weights load in a second; their progress bar is noise
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except DartreeError as exc:  # a retired flag, which names its new spelling (``args.add_retired_flags``)
        print(f"{getattr(exc, 'prog', 'dartree')}: error: {exc}", file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if hasattr(args, "threads"):  # the one place a command's thread count is set (``add_threads_arg``)
            set_threads(args.threads)
        return args.func(args)
    except DartreeError as exc:
        print(f"dartree {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
