"""``dartree train``: data generation, drafter + Domino head, Markov head. Every step resumes."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .. import lean
from ..default_model import default_target_dir
from ..errors import DartreeError
from ..hardware import inexact_work_dtype
from ..loading import load_target, load_tokenizer, resolve_device
from ..pipeline import Pipeline
from ..train.data import NON_COMMERCIAL_SOURCES, generate_data, reference_token_counts
from ..train.drafter import BALANCE, TrainConfig, Trainer, export
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
                      help="original: GSM8K/Alpaca/Dolly/MBPP (what the shipped drafter saw); expanded: the 20 permissively "
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
    data.add_argument("--batch-size", type=int, default=48, help="prompts per shard (and per batch with --generator batch)")
    data.add_argument("--max-new-tokens", type=int, default=256)
    data.add_argument("--sample-fraction", type=float, default=0.25, help="share of shards sampled at T=1 (rest greedy)")
    data.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after this long (resume later)")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--start-shard", type=int, default=0,
                      help="write missing shards from this one on (wrapping around): a second process started further "
                           "on shares the work, each skipping shards the other has written or claimed (a .claim file beside the "
                           "shard while it is written; a dead process's claim is taken over) (with bf16 products, two "
                           "one-thread processes measured 1.45x one two-thread process on a 2-core Xeon: docs/default-model.md)")
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
        p.add_argument("--data", default="runs/data",
                       help="shard folder written by `dartree train data`, or several separated by commas (default runs/data)")
        p.add_argument("--prompts", default="../shared/prompts",
                       help="training prompts folder; its human-written text ranks the draft-vocabulary tokens the responses leave "
                            "undecided, and its original files label the shards written before sources were kept")
        p.add_argument("--balance", choices=BALANCE, default=TrainConfig.balance,
                       help="category: each step draws a category uniformly, then one of its sequences; sqrt: a category "
                            "with probability proportional to the square root of its size; none: any sequence "
                            f"(sequences from {', '.join(NON_COMMERCIAL_SOURCES)}, licensed non-commercially, are never trained on)")
        p.add_argument("--heldout-per-category", type=int, default=TrainConfig.heldout_per_category,
                       help="the first sequences of each category held out and evaluated per category")
        p.add_argument("--out", default=f"runs/{name}")
        p.add_argument("--steps", type=int, default=TrainConfig.steps)
        p.add_argument("--seqs-per-step", type=int, default=TrainConfig.seqs_per_step)
        p.add_argument("--anchors", type=int, default=TrainConfig.anchors, help="anchors per sequence and step (all from one target forward)")
        p.add_argument("--draft-vocab", type=int, default=TrainConfig.draft_vocab,
                       help="reduced draft vocabulary V_d: the most frequent target-written tokens (0: the target's whole vocabulary)")
        p.add_argument("--base-weight", type=float, default=TrainConfig.base_weight, help="weight of the base-logit loss after the curriculum")
        p.add_argument("--hard-weight", type=float, default=TrainConfig.hard_weight,
                       help="share of cross-entropy on the target's own tokens beside the distillation term (soft "
                       "cross-entropy to the target's distribution, i.e. KL up to a constant): 0 pure KL, 1 pure CE "
                       f"(default {TrainConfig.hard_weight})")
        p.add_argument("--tapped", default=",".join(map(str, TrainConfig().tapped)), help="target layers the drafter reads")
        p.add_argument("--layers", type=int, default=TrainConfig.layers,
                       help="drafter layers (default: 1 for a new drafter; a resumed one keeps its own, or with "
                            "--resume-from grows to this many: new layers start as the identity, so training continues "
                            "from what the drafter already computes)")
        p.add_argument("--gru", type=int, default=TrainConfig.gru)
        p.add_argument("--rank", type=int, default=TrainConfig.rank)
        p.add_argument("--markov-rank", type=int, default=TrainConfig.markov_rank)
        p.add_argument("--lr", type=float, default=TrainConfig.lr)
        p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
        p.add_argument("--replay-eval", action=argparse.BooleanOptionalAction, default=TrainConfig.replay_eval,
                       help="evaluations replay the decoder on held-out prompts for tau (default); --no-replay-eval "
                            "keeps the held-out loss and simulated figures only (replay the exported drafter later)")
        p.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after this long; rerun to resume")
        p.add_argument("--device", default="auto", help="auto (default: a GPU when there is one, else the CPU), cpu, cuda or cuda:N")
        p.add_argument("--export", help="after training, write a bf16 copy of the drafter here")
        if name == "markov":
            p.add_argument("--export-backbone", help="with --export: a weights file (relative to the export folder) "
                           "that already holds the frozen backbone, e.g. ../smollm2-drafter-domino/model.safetensors; "
                           "only the head is written and config.json points there")
        add_threads_arg(p)
        p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                       help="the frozen target's dtype for the teacher-forced forward (auto: bfloat16 where native, else float32)")
        p.add_argument("--compute-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                       help="the drafter's forward and backward products: bfloat16 autocast (weights, optimiser and losses "
                            "stay float32) or float32; auto: bfloat16 where native (measured 2-2.5x faster products on AVX512-BF16)")
        p.add_argument("--rescan-every", type=int, default=TrainConfig.rescan_every,
                       help="steps between looks for new shards in --data, so a `dartree train data` job running beside "
                            "training feeds it as it writes (0: never)")
        p.add_argument("--feature-cache-gb", type=float, default=TrainConfig.feature_cache_gb,
                       help="memory for the target's features of training sequences, so later epochs skip its forward (0: off)")
        if name == "drafter":
            p.add_argument("--resume-from", help="continue training these drafter weights (e.g. dartree/assets/smollm2-drafter-domino) "
                           "at the step in its training.json, when --out has no checkpoint yet")
            p.add_argument("--rerank-vocab", action="store_true",
                           help="with --resume-from: re-rank the draft vocabulary on this run's data at size --draft-vocab "
                                "(kept tokens keep their trained rows, new ones start from the target's output rows)")
        if name == "markov":
            p.add_argument("--init-drafter", default="runs/drafter/checkpoint", help="trained drafter whose backbone is kept")
        p.set_defaults(func=_run_train, stage=name)


def _run_train(args) -> int:
    torch.manual_seed(0)
    if args.layers is not None and args.layers < 1:
        raise DartreeError(f"--layers must be at least 1, got {args.layers}")
    if not 0.0 <= args.hard_weight <= 1.0:
        raise DartreeError(f"--hard-weight must be between 0 and 1, got {args.hard_weight}")
    device = resolve_device(args.device)
    # The frozen target only computes features and teacher distributions: bf16 where it is native
    # (measured ~1.8x faster on an AVX-512-BF16 CPU). The drafter keeps fp32 weights, optimiser and
    # losses; its products run under bf16 autocast where bf16 is native (--compute-dtype).
    dtype = inexact_work_dtype(args.dtype, device)
    target = load_target(Path(args.target) if args.target else default_target_dir(), dtype, device)
    cfg = TrainConfig(data=args.data, out=args.out, steps=args.steps, seqs_per_step=args.seqs_per_step, anchors=args.anchors,
                      draft_vocab=args.draft_vocab, base_weight=args.base_weight, hard_weight=args.hard_weight, tapped=[int(x) for x in args.tapped.split(",")],
                      layers=args.layers, gru=args.gru, rank=args.rank, markov_rank=args.markov_rank, lr=args.lr,
                      eval_every=args.eval_every, replay_eval=args.replay_eval, save_every=args.eval_every, max_minutes=args.max_minutes,
                      device=str(device), autocast=inexact_work_dtype(args.compute_dtype, device) == torch.bfloat16,
                      feature_cache_gb=args.feature_cache_gb, rescan_every=args.rescan_every, balance=args.balance,
                      heldout_per_category=args.heldout_per_category)
    if args.stage == "markov":
        cfg.init_drafter = args.init_drafter
    else:
        cfg.resume_from = args.resume_from
        cfg.rerank_vocab = args.rerank_vocab
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
