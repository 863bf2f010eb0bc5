"""``dartree bench``: run the evaluation, or rebuild its report from the records."""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import replace
from pathlib import Path

from ..bench import llama_cpp
from ..bench.datasets import DATASETS, load_samples, select
from ..bench.report import build_report
from ..bench.runner import PEERS, build_grid, run, run_replay
from ..bench.tree_timing import format_table, time_tree_builders
from ..costmodel import CostModel
from ..errors import DartreeError
from ..loading import parse_dtype
from ..pipeline import load as load_pipeline
from ..settings import GenerationSettings
from ..trees import METHODS, TreeSettings, available_methods, builder_class
from .args import add_generation_args, add_model_args, add_retired_flags, add_threads_arg, add_tree_args, tree_settings

DEFAULT_METHODS = ",".join(METHODS + PEERS)


def add_bench_tree_parser(sub) -> None:
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
    add_threads_arg(bt)
    bt.add_argument("--out", help="also write the table to this markdown file")
    add_tree_args(bt)
    bt.set_defaults(func=_run_bench_tree)


def _run_bench_tree(args) -> int:
    from tqdm import tqdm

    settings = tree_settings(args)
    settings = replace(settings, budget=settings.build_budget)  # bench-tree times one fixed budget
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
    table = format_table(rows, dict(depths=args.depths, tree_top_k=settings.tree_top_k, width=settings.width, budget=settings.budget,
                                    beta=settings.beta, gru=args.gru, rank=args.rank, rounds=args.rounds,
                                    logit_scale=args.logit_scale))
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0



def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="evaluate methods on the benchmark prompt sets and write a report",
        description="Run every method x temperature x tree setting on the same seeded prompts in one process, "
        "writing per-sample JSONL records to OUT/records.jsonl (a rerun resumes), then OUT/report.md and PNG plots. "
        "At T=0 every method's tokens are compared with ar's. `--report DIR` only rebuilds the report.",
    )
    p.add_argument("--report", metavar="DIR", help="rebuild DIR/report.md and plots from DIR/records.jsonl, run nothing")
    p.add_argument(
        "--replay",
        action="store_true",
        help="T=0 tau only, by exact replay: one greedy run per prompt, then every method's rounds on the drafter and "
        "tree builder without target forwards (many times cheaper; no measured speedups; budget 'auto' and "
        "--cost-model give speedups modeled on a cost model)",
    )
    p.add_argument(
        "--cost-model",
        metavar="JSON",
        help="with --replay: model each round's time on this cost model (`dartree calibrate --json > FILE`, from any "
        "machine or dtype) and report the modeled speedup over ar; budget 'auto' without it uses this machine's",
    )
    p.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    p.add_argument("--datasets", default="gsm8k,humaneval", help=f"comma list from {','.join(DATASETS)} or 'all'")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma list of methods and peers ({', '.join(PEERS)}; the llama.cpp peers need "
                        f"`{llama_cpp.BUILD_HINT.split('#')[0].strip()}` once, and are left out of the default list where it was not run) "
                        "(default: all)")
    p.add_argument("--temperatures", default="0", help="comma list, e.g. 0,1 (default 0)")
    add_tree_list_args(p)
    p.add_argument("--limit", type=int, default=20, help="prompts per dataset (seeded selection; default 20)")
    add_generation_args(p, ("max_new_tokens",))
    p.add_argument("--seed", type=int, default=GenerationSettings.seed,
                   help=f"seed of the prompt selection and of every request's sampler (default {GenerationSettings.seed})")
    p.add_argument("--data-dir", help="folder with the benchmark files (default ../shared/benchmarks)")
    add_model_args(p, dtype_and_device=False)
    p.add_argument("--dtype", default="float32",
                   help="float32 (default), bfloat16, auto, or several comma-separated (e.g. float32,bfloat16): the whole grid "
                        "runs in each, side by side in one process, each dtype against its own ar")
    add_threads_arg(p)
    p.add_argument(
        "--shard",
        metavar="I/N",
        help="run only every N-th prompt starting at the I-th (1-based), e.g. 1/2 and 2/2 in two processes with "
        "--threads 1 and the same --out: shards append to one records file under a lock, and any shard resumes",
    )
    p.set_defaults(func=run_bench)


def _floats(text, name):
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DartreeError(f"--{name} takes comma-separated numbers, got {text!r}") from None


# The bench crosses each tree setting over a comma list (``--budgets 16,32,64``, ``--widths``,
# ``--tree-top-ks``, ``--betas``, ``--max-budgets``), one flag per ``TreeSettings`` declaration; the
# budgets' default is the fixed-budget sweep, every other list's the setting's own default. The retired
# spellings of a setting (``--top-ks``, and ``--top-k``, the list's older spelling) name the new flag.
BENCH_LIST_DEFAULTS = {"budget": "16,32,64"}


def _list_flag(setting) -> str:
    return setting.metadata["flags"][0] + "s"


def add_tree_list_args(p) -> None:
    g = p.add_argument_group("tree settings (comma lists; the grid crosses them for the methods that read each)")
    for setting in TreeSettings.declarations():
        default = BENCH_LIST_DEFAULTS.get(setting.name, str(setting.default))
        g.add_argument(_list_flag(setting), dest=f"{setting.name}_list", default=default,
                       help=f"{setting.metadata['help']} (default {default})")
    add_retired_flags(p, TreeSettings, suffix="s", extra={"--top-k": "tree_top_k"})


def tree_lists(args) -> dict[str, list]:
    """Each tree setting's list of values from ``add_tree_list_args``' flags, parsed by its declaration."""
    out = {}
    for setting in TreeSettings.declarations():
        text = str(getattr(args, f"{setting.name}_list"))
        try:
            out[setting.name] = [setting.metadata["parse"](x.strip()) for x in text.split(",") if x.strip()]
        except ValueError:
            raise DartreeError(f"{_list_flag(setting)} takes comma-separated values, each {setting.metadata['expects']}; "
                               f"got {text!r}") from None
        if not out[setting.name]:
            raise DartreeError(f"{_list_flag(setting)} needs at least one value")
    return out


def parse_shard(text: str | None) -> tuple[int, int]:
    """'I/N' -> (I - 1, N); None -> the whole run (0, 1)."""
    if text is None:
        return 0, 1
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise DartreeError(f"--shard takes I/N with whole numbers, e.g. 1/2; got {text!r}") from None
    if not 1 <= index <= count:
        raise DartreeError(f"--shard {text}: I must be between 1 and N")
    return index - 1, count


def bench_methods(text: str, replay: bool = False, bundled: bool = True) -> list[str]:
    """The methods and peers of ``--methods``, checked. The llama.cpp peers need llama.cpp built
    (``scripts/build_llama_cpp.sh``): asked for by name where it is not, that is an error that says
    how to build it; in the default list they are left out with a note (replay runs no peer). They decode
    the bundled model's files, so with another target (``bundled`` False) they are refused the same way."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    for m in methods:
        builder_class(m, others=PEERS)
    absent = llama_cpp.missing() if bundled else (
        "the llama.cpp peers decode the bundled model's GGUF files, not this --target's: leave them out of --methods")
    if absent and any(m in llama_cpp.LLAMA_PEERS for m in methods) and not replay:
        if text != DEFAULT_METHODS:
            raise DartreeError(absent)
        methods = [m for m in methods if m not in llama_cpp.LLAMA_PEERS]
        print(f"leaving out the llama.cpp peers: {absent}", file=sys.stderr)
    return methods


def run_bench(args) -> int:
    if args.report:
        path = build_report(args.report)
        print(f"wrote {path}")
        return 0


    datasets = list(DATASETS) if args.datasets == "all" else [d.strip() for d in args.datasets.split(",")]
    for d in datasets:
        if d not in DATASETS:
            raise DartreeError(f"unknown dataset {d!r}; choose from {', '.join(DATASETS)} or 'all'")
    methods = bench_methods(args.methods, args.replay, bundled=args.target is None)
    if args.target is not None and args.drafter is None:  # no drafter: the methods that need one cannot run
        free = available_methods(False, False)
        needing = [m for m in methods if m not in PEERS and m not in free]
        if needing and args.methods != DEFAULT_METHODS:
            raise DartreeError(f"{', '.join(needing)} need a drafter (--drafter); without one: {', '.join(free)}")
        if needing:
            methods = [m for m in methods if m not in needing]
            print(f"leaving out the methods that need a drafter (no --drafter for this --target): {', '.join(needing)}",
                  file=sys.stderr)
    temps = _floats(args.temperatures, "temperatures")
    lists = tree_lists(args)
    budgets = lists.pop("budget")
    try:
        dtypes = list(dict.fromkeys(str(parse_dtype(d.strip())).removeprefix("torch.") for d in args.dtype.split(",") if d.strip()))
    except (DartreeError, ValueError, TypeError) as exc:
        raise DartreeError(f"--dtype: {exc}") from None
    if not dtypes:
        raise DartreeError("--dtype needs at least one dtype")
    grid = build_grid(methods, temps, budgets, dtypes=dtypes, **lists)
    for c in grid:  # the same checks as generate's, before the model loads
        if c.method not in PEERS:
            c.settings(args.max_new_tokens, args.seed).validate()
    shard_index, shard_count = parse_shard(args.shard)
    if args.cost_model and not args.replay:
        raise DartreeError("--cost-model models the time of replayed rounds; add --replay (decoded runs measure time)")
    if args.replay and temps != [0.0]:
        raise DartreeError("--replay measures temperature 0 only; drop --temperatures")
    if args.replay and len(dtypes) > 1:
        raise DartreeError("--replay takes one --dtype (replay measures acceptance, not time)")
    pipes = {d: load_pipeline(args.target, args.drafter, dtype=d, weights=args.weights) for d in dtypes}
    pipe = pipes[dtypes[0]]
    missing = [m for m in methods if m not in PEERS and m not in pipe.methods]
    if missing:
        raise DartreeError(f"this drafter cannot run {', '.join(missing)}; it supports {', '.join(pipe.methods)}")
    # Round-robin over datasets, so a run stopped early still covers every dataset evenly.
    per_dataset = [select(load_samples(d, args.data_dir), args.limit, args.seed) for d in datasets]
    samples = [s for group in itertools.zip_longest(*per_dataset) for s in group if s is not None]
    samples = samples[shard_index::shard_count]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The settings describe the whole run, which every shard shares.
    (out / "settings.json").write_text(json.dumps({k: v for k, v in vars(args).items() if k not in ("func", "shard")}, indent=2))
    print(f"{len(samples)} prompts x {len(grid)} configurations -> {out / 'records.jsonl'}", file=sys.stderr)
    if args.replay:
        cost = None
        if args.cost_model:
            try:
                cost = CostModel.from_json(Path(args.cost_model).read_text())
            except (OSError, ValueError, TypeError, KeyError) as exc:
                raise DartreeError(f"--cost-model {args.cost_model}: not a cost model written by `dartree calibrate --json` ({exc})") from None
        elif "auto" in budgets:
            cost = pipe.cost_model()  # this machine's, measured once and cached
        if cost is not None:
            ident = cost.identity
            print(f"modeled time: cost model of {ident.get('dtype')}, {ident.get('threads')} thread(s) on "
                  f"{ident.get('machine', '?')}; one-row step {cost.verify(1):.1f} ms", file=sys.stderr)
        run_replay(pipe, samples, grid, out / "records.jsonl", args.max_new_tokens, cost)
    else:
        run(pipes, samples, grid, out / "records.jsonl", args.max_new_tokens, args.seed)
    print(f"wrote {build_report(out)}")
    return 0
