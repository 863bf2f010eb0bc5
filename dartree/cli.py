"""Command line: ``dartree generate``, ``dartree bench-tree``, ``dartree train``, ``dartree bench``."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import DartreeError
from .settings import DEFAULT_METHOD, GenerationSettings
from .trees import METHODS, TreeSettings


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model directory (any Hugging Face causal LM); default: bundled SmolLM2-135M-Instruct")
    p.add_argument("--drafter", help="drafter directory in the DFlash on-disk format; default: the drafter shipped with dartree")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or float64")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, or auto (a GPU when there is one)")


def _add_tree_args(p: argparse.ArgumentParser) -> None:
    """--budget/--width/--top-k/--beta, with the defaults and help of ``TreeSettings`` and the methods
    that read each one taken from the registry."""
    from .trees import BUILDERS

    g = p.add_argument_group("tree settings")
    defaults = TreeSettings()
    flags = {"budget": ("--budget", "-B"), "width": ("--width", "-W"), "top_k": ("--top-k", "-K"), "beta": ("--beta",)}
    for name, names in flags.items():
        readers = ", ".join(m for m, b in BUILDERS.items() if name in b.reads)
        default = getattr(defaults, name)
        g.add_argument(*names, dest=name, type=type(default), default=default,
                       help=f"{TreeSettings.HELP[name]} ({readers}; default {default})")


def tree_settings(args) -> TreeSettings:
    """The validated TreeSettings of parsed --budget/--width/--top-k/--beta."""
    return TreeSettings(budget=args.budget, width=args.width, top_k=args.top_k, beta=args.beta).validate()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    defaults = GenerationSettings()
    gen.add_argument("--method", "-m", default=DEFAULT_METHOD, choices=METHODS, metavar="METHOD",
                     help=f"decoding method, one of {', '.join(METHODS)} (default {DEFAULT_METHOD})")
    gen.add_argument("--max-new-tokens", "-n", type=int, default=defaults.max_new_tokens,
                     help=f"most tokens to generate (default {defaults.max_new_tokens})")
    gen.add_argument("--temperature", "-t", type=float, default=defaults.temperature, help="0 = greedy (default); > 0 samples")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling on the target (temperature > 0)")
    gen.add_argument("--sampling-top-k", type=int, default=None, help="top-k sampling on the target (temperature > 0)")
    gen.add_argument("--seed", type=int, default=defaults.seed, help=f"random seed (default {defaults.seed})")
    gen.add_argument("--json", action="store_true", help="print a machine-readable JSON result")
    _add_model_args(gen)
    _add_tree_args(gen)

    bt = sub.add_parser(
        "bench-tree",
        help="time tree construction: sequential heap vs depth-batched dartree",
        description="Time the heap baseline against dartree on the same random draft outputs, side by side, "
        "and print a markdown table of per-round build times and their ratio.",
    )
    bt.add_argument("--sizes", default="256x32000,576x49152,1024x151936,2560x151936",
                    help="comma-separated HIDDENxVOCAB pairs (default: small to Qwen3-4B)")
    bt.add_argument("--heads", default="domino,markov", help="correction heads to time (default domino,markov)")
    bt.add_argument("--depths", "-D", type=int, default=16)
    bt.add_argument("--gru", type=int, default=1024, help="Domino GRU width (published: 1024)")
    bt.add_argument("--rank", type=int, default=256, help="low-rank width of the correction (published: 256)")
    bt.add_argument("--rounds", type=int, default=20, help="timed rounds per cell (median reported)")
    bt.add_argument("--logit-scale", type=float, default=3.0, help="std of the random base logits (larger = more peaked drafts)")
    bt.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    bt.add_argument("--out", help="also write the table to this markdown file")
    _add_tree_args(bt)

    from .train.cli import add_train_parser

    add_train_parser(sub)
    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def _run_generate(args) -> int:
    import dartree

    # Every setting is checked before the model loads (which takes seconds).
    settings = GenerationSettings(
        method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        sampling_top_k=args.sampling_top_k, top_p=args.top_p, tree=tree_settings(args),
    ).validate()
    if not args.prompt.strip():
        raise DartreeError("the prompt is empty; give some text")
    pipe = dartree.load(args.target, args.drafter, dtype=args.dtype, device=args.device)
    kwargs = dict(settings=settings)
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
            f"\n[{s.method}] {s.new_tokens} tokens in {s.rounds} rounds, mean acceptance {s.mean_acceptance:.2f}, "
            f"{s.tokens_per_second:.1f} tokens/s (draft {s.stage_ms['draft']:.0f} ms, tree {s.stage_ms['tree']:.0f} ms, "
            f"verify {s.stage_ms['verify']:.0f} ms, commit {s.stage_ms['commit']:.0f} ms)",
            file=sys.stderr,
        )
    return 0


def _run_bench_tree(args) -> int:
    import torch
    from tqdm import tqdm

    from .bench.tree_timing import format_table, time_tree_builders

    settings = tree_settings(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        sizes = [tuple(int(x) for x in item.lower().split("x")) for item in args.sizes.split(",")]
        assert all(len(s) == 2 and s[0] > 0 and s[1] > 0 for s in sizes)
    except (ValueError, AssertionError):
        raise DartreeError(f"--sizes must look like 576x49152,2560x151936, got {args.sizes!r}") from None
    heads = [h.strip() for h in args.heads.split(",")]
    for h in heads:
        if h not in ("domino", "markov"):
            raise DartreeError(f"--heads takes domino and/or markov, got {h!r}")
    rows = []
    for head in heads:
        for hidden, vocab in tqdm(sizes, desc=f"bench-tree ({head})", file=sys.stderr):
            rows.append(time_tree_builders(hidden, vocab, head, settings, depths=args.depths, gru=args.gru, rank=args.rank,
                                           rounds=args.rounds, logit_scale=args.logit_scale))
    table = format_table(rows, dict(depths=args.depths, top_k=settings.top_k, width=settings.width, budget=settings.budget,
                                    beta=settings.beta, gru=args.gru, rank=args.rank, rounds=args.rounds,
                                    logit_scale=args.logit_scale))
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command == "bench-tree":
            return _run_bench_tree(args)
        return args.func(args)
    except DartreeError as exc:
        print(f"dartree {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
