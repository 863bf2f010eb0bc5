"""``dartree train``: data generation, drafter + Domino head, Markov head. Every step resumes."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from ..targets import lean
from ..default_model import default_target_dir
from ..errors import DartreeError
from ..hardware import inexact_work_dtype
from ..loading import load_target, load_tokenizer, resolve_device
from ..pipeline import Pipeline
from ..train.data import generate_data, reference_token_counts
from ..train.drafter import TrainConfig, Trainer, export
from .args import add_threads_arg


def add_train_parser(sub) -> None:
    train = sub.add_parser(
        "train",
        help="train a drafter and its correction heads by self-distillation",
        description="Self-distillation on the target's own responses. Steps: `data` (the target writes responses, "
        "stored as token-id shards), `drafter` (block drafter + Domino head with the "
        "base-anchored curriculum), `markov` (Markov head on the frozen drafter). Each step resumes from its "
        "checkpoint when run again.",
    )
    steps = train.add_subparsers(dest="step", metavar="STEP")

    data = steps.add_parser("data", help="generate target-written responses into shards")
    data.add_argument("--target", help="target directory (default: bundled SmolLM2-135M-Instruct)")
    data.add_argument("--prompts", default="../shared/prompts", help="training prompts folder (default ../shared/prompts)")
    data.add_argument("--out", default="runs/data", help="shard folder (default runs/data)")
    data.add_argument("--prompt-set", default="original", choices=("original", "expanded"),
                      help="original: GSM8K/Alpaca/Dolly/MBPP; expanded: the 20 permissively "
                           "licensed JSONL files of every category, less a held-out split of each (default original)")
    data.add_argument("--num-prompts", type=int, default=None,
                      help="generate for the first N prompts of the fixed shuffle (default: all of them); a larger N later extends the data")
    data.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                      help="the precision of the target's products while generating; auto (default): bfloat16 where the "
                           "CPU has native bf16 matrix instructions (avx512_bf16 / amx_bf16) or on a GPU, else float32. On the "
                           "engine, bfloat16 means bf16 weight products with float32 attention, norms and K/V (the lean "
                           "forward's 'bfloat16' products); with --generator batch, the whole model in that dtype")
    data.add_argument("--generator", default="auto", choices=("auto", "engine", "batch"),
                      help="engine: the batched engine on the lean forward (requests join as others end; with float32 "
                           "every answer is the one the target writes alone); batch: one left-padded Hugging Face batch per "
                           "shard (for GPUs or models the lean forward lacks); auto (default): engine on a "
                           "CPU where the lean forward runs the target, else batch")
    data.add_argument("--slots", type=int, default=64, help="requests per engine round (--generator engine; default 64)")
    data.add_argument("--batch-size", type=int, default=48, help="prompts per shard (and per batch with --generator batch; default 48)")
    data.add_argument("--max-new-tokens", type=int, default=256, help="most tokens of a response (default 256)")
    data.add_argument("--sample-fraction", type=float, default=0.25, help="share of shards sampled at T=1, the rest greedy (default 0.25)")
    data.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after this long; run again to resume (default: no limit)")
    data.add_argument("--seed", type=int, default=0, help="seed of the prompts' shuffle, which shards are sampled and their sampling (default 0)")
    data.add_argument("--start-shard", type=int, default=0,
                      help="write missing shards from this one on (wrapping around): a second process started further "
                           "on shares the work, each skipping shards the other has written or claimed (a .claim file beside the "
                           "shard while it is written; a dead process's claim is taken over) (default 0)")
    data.add_argument("--device", default="auto", help="auto (default: a GPU when there is one, else the CPU), cpu, cuda or cuda:N")
    add_threads_arg(data)
    data.set_defaults(func=_run_data)

    add_drafter_args(steps)


def _run_data(args) -> int:

    target = Path(args.target) if args.target else default_target_dir()
    device = resolve_device(args.device)
    if args.slots < 1:
        raise DartreeError(f"--slots must be >= 1, got {args.slots}")
    work_dtype = inexact_work_dtype(args.dtype, device)
    use_engine = args.generator == "engine" or (args.generator == "auto" and device.type == "cpu")
    # the engine keeps the model in float32 (the lean forward's dtype) and multiplies in work_dtype
    model = load_target(target, torch.float32 if use_engine else work_dtype, device)
    tokenizer = load_tokenizer(target)
    if use_engine:
        reason = lean.unsupported_reason(model)
        if reason is not None and args.generator == "engine":
            raise DartreeError(f"--generator engine needs the lean forward: {reason}")
        use_engine = reason is None
        if not use_engine and work_dtype != model.dtype:  # auto: the batch generator at its own dtype
            model = load_target(target, work_dtype, device)
    products = "bfloat16" if work_dtype == torch.bfloat16 else "exact"
    generator = Pipeline(model, None, tokenizer, lean=True, lean_products=products) if use_engine else model
    generate_data(generator, tokenizer, args.prompts, args.out, args.num_prompts, args.batch_size,
                  args.max_new_tokens, args.sample_fraction, args.seed, args.max_minutes,
                  args.start_shard, args.prompt_set, slots=args.slots)
    return 0


def add_drafter_args(steps) -> None:
    for name, helptext in (("drafter", "train the block drafter with its Domino head (curriculum)"),
                           ("markov", "train a Markov head on a trained, frozen drafter")):
        p = steps.add_parser(name, help=helptext)
        p.add_argument("--target", help="target directory (default: bundled SmolLM2-135M-Instruct)")
        p.add_argument("--prompts", default="../shared/prompts",
                       help="training prompts folder; its human-written text ranks the draft-vocabulary tokens the responses leave "
                            "undecided, and its original files label the shards written before sources were kept "
                            "(default ../shared/prompts)")
        add_train_config_args(p, name)
        p.add_argument("--device", default="auto", help="auto (default: a GPU when there is one, else the CPU), cpu, cuda or cuda:N")
        p.add_argument("--export", help="after training, write a bf16 copy of the drafter here")
        if name == "markov":
            p.add_argument("--export-backbone", help="with --export: a weights file (relative to the export folder) "
                           "that already holds the frozen backbone, e.g. ../smollm2-drafter-domino/model.safetensors; "
                           "only the head is written and config.json points there")
        add_threads_arg(p)
        p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                       help="the frozen target's dtype for the teacher-forced forward (auto, the default: bfloat16 where "
                            "native, else float32)")
        p.add_argument("--compute-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                       help="the drafter's forward and backward products: bfloat16 autocast (weights, optimiser and losses "
                            "stay float32) or float32; auto (default): bfloat16 where native")
        p.set_defaults(func=_run_train, stage=name)


class _Switch(argparse.BooleanOptionalAction):
    """--flag / --no-flag with the help as given (argparse before 3.14 appends its own default)."""

    def __init__(self, *args, help=None, **kwargs):
        super().__init__(*args, help=help, **kwargs)
        self.help = help


def add_train_config_args(p: argparse.ArgumentParser, stage: str) -> None:
    """The ``TrainConfig`` settings ``stage``'s command line has (those declared with flags), as
    ``TrainConfig`` declares them: flags, help, parsing, choices and the default (the step's own, where
    it declares one). Each argument's dest is the field's name."""
    g = p.add_argument_group("training settings")
    for setting in TrainConfig.declarations():
        meta = setting.metadata
        if not meta["flags"] or stage not in meta["stages"]:
            continue
        default = meta["stage_defaults"].get(stage, _declared_default(setting))
        if meta["parse"] is bool:  # --flag / --no-flag
            shown = meta["flags"][0] if default else "--no-" + meta["flags"][0].removeprefix("--")
            g.add_argument(*meta["flags"], dest=setting.name, action=_Switch, default=default, help=_help(meta, shown))
            continue
        shown = meta["shown"] or (",".join(map(str, default)) if isinstance(default, (list, tuple)) else default)
        g.add_argument(*meta["flags"], dest=setting.name, type=_reader(setting), default=default, choices=meta["choices"],
                       help=_help(meta, shown))


def _help(meta: dict, shown) -> str:
    return f"{meta['help']} (default {shown})".replace("%", "%%")  # argparse formats help with %


def _declared_default(setting):
    return setting.default_factory() if setting.default is dataclasses.MISSING else setting.default


def _reader(setting):
    """The declaration's parser as an argparse type: a value it cannot read is a usage error."""
    parse = setting.metadata["parse"]
    expects = {int: "an integer", float: "a number", str: "text"}.get(parse, "comma-separated integers")

    def read(text: str):
        try:
            return parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expects}, got {text!r}") from None
    read.__name__ = setting.name
    return read


def train_config(args) -> TrainConfig:
    """The TrainConfig of the parsed arguments: every declared setting the command line has, within its
    declared range; the others keep their defaults (``_run_train`` sets those it derives from arguments
    of its own: --device, --compute-dtype, and checkpoints every --eval-every steps)."""
    given = {}
    for setting in TrainConfig.declarations():
        if not hasattr(args, setting.name) or not setting.metadata["flags"]:
            continue
        value, meta = getattr(args, setting.name), setting.metadata
        low, high = meta["low"], meta["high"]
        if value is not None and ((low is not None and value < low) or (high is not None and value > high)):
            bounds = f"at least {low}" if high is None else f"between {low} and {high}"
            raise DartreeError(f"{meta['flags'][0]} must be {bounds}, got {value}")
        given[setting.name] = value
    return TrainConfig(**given)


def _run_train(args) -> int:
    torch.manual_seed(0)
    cfg = train_config(args)  # the declared ranges, checked before anything loads
    device = resolve_device(args.device)
    # The frozen target only computes tapped states and teacher distributions: bf16 where it is native.
    # The drafter keeps fp32 weights, optimiser and losses; its products run under bf16 autocast
    # where bf16 is native (--compute-dtype).
    dtype = inexact_work_dtype(args.dtype, device)
    target = load_target(Path(args.target) if args.target else default_target_dir(), dtype, device)
    cfg = dataclasses.replace(cfg, save_every=cfg.eval_every, device=str(device),
                              autocast=inexact_work_dtype(args.compute_dtype, device) == torch.bfloat16)
    if cfg.rerank_vocab and not cfg.resume_from:
        raise DartreeError("--rerank-vocab re-ranks a resumed drafter's vocabulary; pass --resume-from too "
                           "(a new drafter's vocabulary is always ranked on its data)")
    prior = None
    tokenizer = load_tokenizer(Path(args.target) if args.target else default_target_dir())
    if (args.stage == "drafter" and cfg.draft_vocab and Path(args.prompts).is_dir() and tokenizer is not None
            and not (Path(cfg.out) / "checkpoint").is_dir() and (not cfg.resume_from or cfg.rerank_vocab)):
        prior = reference_token_counts(args.prompts, tokenizer, target.config.vocab_size)
    trainer = Trainer(target, cfg, args.stage, vocab_prior=prior, tokenizer=tokenizer, prompts_dir=args.prompts)
    print("training sequences by category: " + ", ".join(f"{c} {n}" for c, n in trainer.category_counts().items()))
    ckpt = trainer.run()
    if args.export:
        export(ckpt, args.export, shared_backbone=getattr(args, "export_backbone", None))
        print(f"exported {ckpt} -> {args.export}")
    return 0
