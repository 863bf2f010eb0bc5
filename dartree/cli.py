"""Command line: ``dartree generate``, ``dartree bench-tree``, ``dartree train``, ``dartree bench``."""

from __future__ import annotations

import argparse
import json
import sys

from .errors import DartreeError
from .trees import METHODS


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target model directory (any Hugging Face causal LM); default: bundled SmolLM2-135M-Instruct")
    p.add_argument("--drafter", help="drafter directory in the DFlash on-disk format; default: the drafter shipped with dartree")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or float64")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, or auto (a GPU when there is one)")


def _add_tree_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tree settings")
    g.add_argument("--budget", "-B", type=int, default=64, help="tree nodes verified per round, root excluded (default 64; 16-32 suit a CPU)")
    g.add_argument("--width", "-W", type=int, default=12, help="dartree: branches kept per depth (default 12)")
    g.add_argument("--top-k", "-K", type=int, default=64, help="dartree/heap: candidate tokens per depth (default 64)")
    g.add_argument("--beta", type=float, default=-0.2, help="dartree/heap: depth bonus of the final top-B, must be <= 0 (default -0.2)")


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
    gen.add_argument("--method", "-m", default="dartree", choices=METHODS, help="decoding method (default dartree)")
    gen.add_argument("--max-new-tokens", "-n", type=int, default=256, help="most tokens to generate (default 256)")
    gen.add_argument("--temperature", "-t", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    gen.add_argument("--top-p", type=float, default=None, help="nucleus sampling on the target (temperature > 0)")
    gen.add_argument("--sampling-top-k", type=int, default=None, help="top-k sampling on the target (temperature > 0)")
    gen.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
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

    pipe = dartree.load(args.target, args.drafter, dtype=args.dtype, device=args.device)
    kwargs = dict(
        method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
        budget=args.budget, width=args.width, top_k=args.top_k, beta=args.beta,
        sampling_top_k=args.sampling_top_k, top_p=args.top_p,
    )
    streaming = not args.json and pipe.tokenizer is not None
    if streaming:  # print the text as each round is verified
        from transformers import TextStreamer

        kwargs["streamer"] = TextStreamer(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True)
    if args.raw:
        if pipe.tokenizer is None:
            raise DartreeError("this target has no tokenizer")
        ids = pipe.tokenizer(args.prompt)["input_ids"]
        if not args.prompt.strip():
            raise DartreeError("the prompt is empty; give some text")
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

    from .bench_tree import format_table, time_tree_builders
    from .trees import TreeSettings

    TreeSettings(budget=args.budget, width=args.width, top_k=args.top_k, beta=args.beta).validate()
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
            rows.append(time_tree_builders(hidden, vocab, head, depths=args.depths, budget=args.budget, width=args.width,
                                           top_k=args.top_k, beta=args.beta, gru=args.gru, rank=args.rank,
                                           rounds=args.rounds, logit_scale=args.logit_scale))
    table = format_table(rows, dict(depths=args.depths, top_k=args.top_k, width=args.width, budget=args.budget,
                                    beta=args.beta, gru=args.gru, rank=args.rank, rounds=args.rounds,
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
