"""Drafter + correction-head training on target-written shards.

Shards hold token ids only. For each training sequence the frozen target runs once, teacher-forced,
and that one forward gives the drafter's context (the tapped states) and the distillation target
(the target's next-token distribution) for every anchor of the sequence.

One step packs the anchors of a sequence into one drafter forward: block j is [x_a, MASK, ..., MASK]
at positions a..a+b-1; its queries see the fused target context at positions < a and their own
block, never another block. With shifted labels, slot k predicts token a+k+1.

The drafter has its own output layer over a reduced draft vocabulary (the V_d most frequent tokens of
target-written text, started from the target's rows); teacher distributions are the target's logits
restricted to those ids. Loss per supervised slot, weighted by exp(-k/gamma): distillation (soft
cross-entropy) plus a little hard-label cross-entropy (labels outside the draft vocabulary carry no
hard term). Both the corrected logits and the base logits are trained at every depth for the whole
run: L = (1 - lam) L(corrected) + lam L(base), lam falling from 1 to ``base_weight`` over the first
``curriculum`` share of the steps; the base logits are what ``dflash`` and every tree's top-K
candidates come from. The Markov step trains only the Markov head on the frozen backbone.
Checkpoints (weights in the export, optimiser and RNG in trainer.pt) let a run resume.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ..drafter import DrafterConfig, DrafterLayer, DrafterModel, PackedBlocks
from ..errors import DartreeError
from ..loading import load_drafter, save_drafter
from ..greedy import GreedyAnswers
from ..pipeline import Pipeline
from ..products import cpu_products
from ..replay import replay
from ..trees import DARTreeBuilder, TreeBuilder, TreeSettings
from .data import (NON_COMMERCIAL_SOURCES, Sequence, TrainingPrompt, expanded_prompts, label_original_sources, load_shards,
                   sequence_category, shard_files, tapped_target_states)


STAGES = ("drafter", "markov")  # the training steps after `data`: block drafter + Domino head, then a Markov head
BALANCE = ("category", "sqrt", "none")


def parse_layers(text: str) -> list[int]:
    """Target layer indices as written on a command line: comma-separated integers."""
    return [int(x) for x in text.split(",") if x.strip()]


def _option(default=MISSING, help: str = "", flags: tuple[str, ...] = (), parse=None, *, factory=MISSING,
            stages: tuple[str, ...] = STAGES, stage_defaults: dict | None = None, shown: str | None = None,
            low=None, high=None, choices: tuple[str, ...] | None = None):
    """One training setting's declaration, as ``settings._setting`` declares a generation setting: its
    default (or ``factory``), what it does (the help), its command-line flags (none: set from Python, or
    by ``dartree train`` from arguments of its own, such as --device), how to read it from text (a bool
    is a --flag / --no-flag switch), the steps whose command line has it and a step's own default, the
    default as the help writes it (``shown``), and the range and choices the command line accepts.
    ``dartree train``'s arguments derive from these (``cli/train.py``)."""
    return field(default=default, default_factory=factory, metadata={
        "help": help, "flags": flags, "parse": parse, "stages": stages, "stage_defaults": stage_defaults or {},
        "shown": shown, "low": low, "high": high, "choices": choices})


@dataclass
class TrainConfig:
    """A training run's settings, each declared once (``_option``): defaults, help and flags."""

    data: str = _option("runs/data", "shard folder written by `dartree train data`, or several separated by commas, "
                        "read in that order", ("--data",), str)
    out: str = _option("runs/drafter", "run folder: checkpoint, trainer state (trainer.pt) and metrics.jsonl",
                       ("--out",), str, stage_defaults={"markov": "runs/markov"})
    steps: int = _option(2000, "optimiser steps of the whole run; a resumed run continues up to this step", ("--steps",), int)
    seqs_per_step: int = _option(1, "training sequences per step", ("--seqs-per-step",), int)
    anchors: int = _option(64, "anchors per sequence and step, all from one target forward", ("--anchors",), int)
    draft_vocab: int = _option(8192, "reduced draft vocabulary V_d: the most frequent target-written tokens; 0: the "
                               "target's whole vocabulary", ("--draft-vocab",), int)
    block_size: int = _option(16, "drafter block: the anchor's token, then block_size - 1 masked slots")
    layers: int | None = _option(None, "drafter layers; a resumed drafter keeps its own, or with --resume-from grows to "
                                 "this many (new layers start as the identity, so training continues from what the "
                                 "drafter already computes)", ("--layers",), int, shown="1 for a new drafter", low=1)
    gru: int = _option(256, "hidden size of the Domino head's GRU", ("--gru",), int)
    rank: int = _option(64, "rank of the Domino head's token embedding", ("--rank",), int)
    markov_rank: int = _option(64, "rank of the Markov head", ("--markov-rank",), int)
    lr: float = _option(1e-3, "peak learning rate, reached by a linear warm-up, then decayed on a cosine", ("--lr",), float)
    warmup: float = _option(0.04, "share of the steps that warm the learning rate up")
    gamma: float = _option(7.0, "a block slot k's loss weight is exp(-k / gamma)")
    hard_weight: float = _option(0.1, "share of cross-entropy on the target's own tokens beside the distillation term "
                                 "(soft cross-entropy to the target's distribution, i.e. KL up to a constant): 0 pure "
                                 "KL, 1 pure CE", ("--hard-weight",), float, low=0, high=1)
    curriculum: float = _option(0.1, "share of the steps over which the base logits' weight lam falls from 1 to base_weight")
    base_weight: float = _option(0.3, "weight of the base-logit loss after the curriculum (lam never falls below it, so "
                                 "the base logits stay trained at every depth)", ("--base-weight",), float)
    eval_tree_budget: int = _option(16, "the dartree budget whose tau replay measures on held-out prompts")
    eval_new_tokens: int = _option(64, "tokens of the target's greedy answer replayed per held-out prompt")
    heldout_seqs: int = _option(12, "sequences held out for evaluation, drawn among the first 256")
    heldout_per_category: int = _option(4, "the first sequences of each category held out and evaluated per category",
                                        ("--heldout-per-category",), int)
    balance: str = _option("category", "category: each step draws a category uniformly, then one of its sequences; "
                           "sqrt: a category with probability proportional to the square root of its size; none: any "
                           f"sequence (sequences from {', '.join(NON_COMMERCIAL_SOURCES)}, licensed non-commercially, "
                           "are never trained on)", ("--balance",), str, choices=BALANCE)
    exclude_sources: tuple[str, ...] = _option(NON_COMMERCIAL_SOURCES, "prompt files whose sequences are never trained on")
    eval_every: int = _option(100, "steps between held-out evaluations; from the command line, between checkpoints too",
                              ("--eval-every",), int)
    replay_eval: bool = _option(True, "evaluations replay the decoder on held-out prompts for tau; --no-replay-eval "
                                "keeps the held-out loss and simulated figures only, to replay the exported drafter "
                                "later (e.g. on a CPU after a GPU run)", ("--replay-eval",), bool)
    save_every: int = _option(100, "steps between checkpoints")
    max_minutes: float | None = _option(None, "stop cleanly after this long; run again to resume", ("--max-minutes",),
                                        float, shown="no limit")
    seed: int = _option(0, "seed of the held-out split, the drafter's initialisation and the steps' draws")
    device: str = _option("cpu", "where the target and the drafter train; shards stay in CPU memory")
    init_from_target: bool = _option(False, "start the drafter's layers from copies of the target's top layers")
    init_drafter: str = _option("runs/drafter/checkpoint", "trained drafter whose backbone is kept",
                                ("--init-drafter",), str, stages=("markov",))
    resume_from: str | None = _option(None, "continue training these drafter weights (e.g. "
                                      "dartree/assets/smollm2-drafter-domino) at the step in its training.json, when "
                                      "--out has no checkpoint yet", ("--resume-from",), str, stages=("drafter",),
                                      shown="none, a new drafter")
    tapped: list[int] = _option(help="target layers the drafter reads", flags=("--tapped",), parse=parse_layers,
                                factory=lambda: [1, 7, 14, 21, 27])
    autocast: bool = _option(False, "bf16 autocast for the drafter's forward and backward (weights, optimiser and losses "
                             "stay fp32)")
    feature_cache_gb: float = _option(4.0, "memory for the target's features of training sequences, so later epochs "
                                      "skip its forward; 0: off", ("--feature-cache-gb",), float)
    rerank_vocab: bool = _option(False, "with --resume-from: re-rank the draft vocabulary on this run's data at size "
                                 "--draft-vocab (kept tokens keep their trained rows, new ones start from the target's "
                                 "output rows)", ("--rerank-vocab",), bool, stages=("drafter",))
    rescan_every: int = _option(200, "steps between looks for new shards in --data, so a `dartree train data` job "
                                "running beside training feeds it as it writes; 0: never", ("--rescan-every",), int)

    @classmethod
    def declarations(cls):
        """The settings' dataclass fields, each with its ``metadata`` (help, flags, parse, stages, ...)."""
        return fields(cls)


def draft_vocabulary(seqs: list[Sequence], size: int, vocab_size: int, prior: torch.Tensor | None = None) -> torch.Tensor:
    """The ``size`` most frequent target ids of the responses (target-written text), sorted by id.

    Ties, among them the tokens no response used, go to the more frequent token of ``prior`` (e.g.
    ``reference_token_counts``; default: the prompts of ``seqs``), then to the smaller id, so a
    vocabulary larger than what the responses cover is still filled with likely tokens."""
    response = torch.zeros(vocab_size, dtype=torch.long)
    prompt = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        response += torch.bincount(s.tokens[s.prompt_len:].long(), minlength=vocab_size)
        if prior is None:
            prompt += torch.bincount(s.tokens[: s.prompt_len].long(), minlength=vocab_size)
    if prior is not None:
        prompt = prior.long()
    score = response * (prompt.max() + 1) + prompt
    order = torch.sort(score, descending=True, stable=True).indices  # equal scores: the smaller id
    return order[: min(size, vocab_size)].sort().values


def vocabulary_coverage(seqs: list[Sequence], vocab_size: int, sizes=(4096, 8192, 16384, 32768)) -> dict[int, float]:
    """Share of response tokens inside the top-V_d vocabulary of the same sequences, per V_d."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s.tokens[s.prompt_len:].long(), minlength=vocab_size)
    ranked = counts.sort(descending=True).values.cumsum(0).double() / counts.sum()
    return {v: float(ranked[min(v, vocab_size) - 1]) for v in sizes}


def new_drafter(target, cfg: TrainConfig, head: str | None, vocab: torch.Tensor | None = None) -> DrafterModel:
    """A drafter shaped like the target's layers, randomly initialised (optionally from copies of the
    target's top layers); with ``vocab`` (sorted target ids) its own output layer starts from the
    target's rows of those ids."""
    t = target.config
    dcfg = DrafterConfig(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=cfg.layers or 1,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        vocab_size=t.vocab_size,
        block_size=cfg.block_size,
        num_target_layers=t.num_hidden_layers,
        mask_token_id=t.vocab_size,  # no spare embedding row: the drafter learns mask_embedding
        target_layer_ids=list(cfg.tapped),
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=float((getattr(t, "rope_parameters", None) or {}).get("rope_theta", getattr(t, "rope_theta", 10000.0))),
        shift_label=True,
        projector_type=head,
        pure_draft_prefix_len=1,
        emb_dim=cfg.rank,
        gru_hidden_dim=cfg.gru,
        markov_rank=cfg.markov_rank if head == "markov" else 0,
        draft_vocab_size=None if vocab is None else int(vocab.numel()),
    )
    model = DrafterModel(dcfg)
    model.mask_embedding = torch.nn.Parameter(target.get_input_embeddings().weight.mean(0).detach().clone())
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        random_init_(model, gen, keep=("mask_embedding", "lm_head.weight"))
        if head == "domino":
            model.head.embed_proj[2].weight.zero_()  # the correction starts as a no-op on the base logits
        if head == "markov":
            model.head.markov_w2.weight.zero_()
        if vocab is not None:
            model.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab])
            model.d2t.copy_(vocab - torch.arange(vocab.numel()))
        if cfg.init_from_target:
            src_layers = target.model.layers[-model.config.num_hidden_layers:]
            for mine, theirs in zip(model.layers, src_layers):
                sd = {k: v for k, v in theirs.state_dict().items() if k in mine.state_dict()}
                mine.load_state_dict(sd, strict=False)
            model.norm.weight.copy_(target.model.norm.weight)
    return model


@torch.no_grad()
def random_init_(module: torch.nn.Module, gen: torch.Generator, keep=(), zero=()) -> None:
    """Norm weights to 1, parameters named in ``zero`` (by suffix) to 0, those in ``keep`` untouched,
    every other one N(0, 1 / fan_in)."""
    for name, p in module.named_parameters():
        if name in keep:
            continue
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif zero and name.endswith(zero):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[-1])))


def grow_layers(model: DrafterModel, layers: int, seed: int = 0) -> None:
    """Append randomly initialised layers whose output projections (attention ``o_proj``, MLP
    ``down_proj``) start at zero: each new layer adds nothing to the residual stream, so the grown
    drafter computes exactly what the trained one did and training only has to learn the increment."""
    have = model.config.num_hidden_layers
    if layers < have:
        raise DartreeError(f"--layers {layers} is fewer than the {have} layers of the drafter being resumed")
    gen = torch.Generator().manual_seed(seed + have)
    model.config.num_hidden_layers = layers
    ref = model.fc.weight
    for _ in range(layers - have):
        layer = DrafterLayer(model.config).to(device=ref.device, dtype=ref.dtype)
        random_init_(layer, gen, zero=("o_proj.weight", "down_proj.weight"))
        model.layers.append(layer)


@torch.no_grad()
def rerank_vocabulary(model: DrafterModel, vocab: torch.Tensor, out_weight: torch.Tensor) -> dict[str, int]:
    """Give a trained drafter the draft vocabulary ``vocab`` (sorted target ids, any size).

    A token in both vocabularies keeps its trained output row (and its Domino correction row); a
    new token's output row is the target's row (``out_weight``) mapped by the linear map that best
    carries the kept tokens' target rows to their trained rows (least squares), and its correction
    row (Domino's last layer, Markov's output layer) is the mean of the kept tokens' rows. Both
    matter: the trained correction carries a large shift common to every kept token (free under the
    softmax) that a zero row lacks, so with zero correction rows the new tokens would take most of
    the corrected probability (on the shipped drafter, 8k -> 16k: held-out loss 5.0 with both
    choices, 16.6 with zero correction rows; docs/experiments.md). Returns how many tokens were
    kept, added and dropped."""
    if model.d2t is None:
        raise DartreeError("the drafter has the target's full output layer; there is no draft vocabulary to re-rank")
    vocab = vocab.to(model.d2t.device).long()
    old_size = model.config.output_vocab_size
    src = model.target_to_draft(out_weight.shape[0]).to(vocab.device)[vocab]  # old draft id of each new token, -1: new
    kept = src >= 0
    ref = model.lm_head.weight
    target_rows = out_weight.to(device=ref.device, dtype=torch.float64)
    trained = ref[src[kept]].double()
    to_trained = torch.linalg.lstsq(target_rows[vocab[kept]], trained).solution  # [H, H]
    rows = (target_rows[vocab] @ to_trained).to(ref.dtype)
    rows[kept] = ref[src[kept]]
    model.lm_head = torch.nn.Linear(ref.shape[1], vocab.numel(), bias=False).to(device=ref.device, dtype=ref.dtype)
    model.lm_head.weight.copy_(rows)
    model.d2t = vocab - torch.arange(vocab.numel(), device=vocab.device)
    if model.head is not None:
        last = model.head.embed_proj[-1] if hasattr(model.head, "embed_proj") else model.head.markov_w2
        trained = last.weight[src[kept]]
        w = trained.mean(0, keepdim=True).repeat(vocab.numel(), 1)
        w[kept] = trained
        last.weight = torch.nn.Parameter(w)
        last.out_features = vocab.numel()
    model.config.draft_vocab_size = int(vocab.numel())
    return {"kept": int(kept.sum()), "added": int((~kept).sum()), "dropped": int(old_size - kept.sum())}


def block_batch(seq: Sequence, anchors: int, block: int, rng: random.Random):
    """Anchor positions, block token ids and labels for one sequence."""
    length = seq.tokens.numel()
    first, last = seq.prompt_len, length - 2  # anchor and its next token are both real
    pool = list(range(first, last + 1))
    picks = sorted(rng.sample(pool, min(anchors, len(pool))))
    a = torch.tensor(picks, device=seq.tokens.device)
    k = torch.arange(block, device=a.device)
    target_pos = a[:, None] + k[None, :] + 1  # slot k predicts token a+k+1
    valid = target_pos <= length - 1
    labels = seq.tokens[target_pos.clamp(max=length - 1)]
    prev = seq.tokens[(a[:, None] + k[None, :]).clamp(max=length - 1)]  # the tokens each slot conditions on
    return a, valid, labels, prev


def drafter_outputs(model: DrafterModel, embed, tokens: torch.Tensor, feats: torch.Tensor, a: torch.Tensor, block: int,
                    dense_mask: bool = False):
    """Packed forward: hidden states [A, b, H] for all anchors of one sequence; feats [C, m*H] are the
    tapped target states of positions 0..C-1. Block j sees context < a_j and its own block; that is
    given as ``PackedBlocks`` (scores only where visible), or with ``dense_mask`` as one [Q, C + Q]
    mask for SDPA (the same attention, kept to test the packed one against)."""
    n_ctx, dev = feats.shape[0], a.device
    emb = model.block_embeddings(embed, tokens[a])
    q = a.numel() * block
    block_pos = (a[:, None] + torch.arange(block, device=dev)[None, :]).reshape(-1)
    ctx_pos = torch.arange(n_ctx, device=dev)
    see_ctx = ctx_pos[None, :] < a.repeat_interleave(block)[:, None]
    if dense_mask:
        blk_id = torch.arange(a.numel(), device=dev).repeat_interleave(block)
        mask = torch.cat([see_ctx, blk_id[:, None] == blk_id[None, :]], dim=1)[None, None]
    else:
        mask = PackedBlocks(see_ctx, block)
    hidden = model(emb.reshape(1, q, -1), feats[None], ctx_pos, block_pos, attn_mask=mask)[0]
    return hidden.reshape(a.numel(), block, -1)


def block_loss(logits, teacher_p, labels, weights, hard_weight):
    """Weighted soft + hard cross-entropy over slots. logits [N, V_d], teacher_p [N, V_d] the teacher's
    probabilities, labels [N] draft ids (-1: outside the draft vocabulary, no hard term), weights [N]
    (0 for slots that supervise nothing)."""
    logp = logits.float().log_softmax(-1)
    soft = -(teacher_p * logp).sum(-1)
    hard = -logp.gather(-1, labels.clamp(min=0)[:, None]).squeeze(-1) * (labels >= 0)
    per = (1 - hard_weight) * soft + hard_weight * hard
    return (per * weights).sum() / weights.sum()


def chain_hits(logits_blocks, to_target, labels, valid):
    """[A, b] bool: the slot's argmax (as a target id) is the target's token."""
    return (to_target(logits_blocks.argmax(-1)) == labels) & valid


def chain_tau(hits: torch.Tensor) -> float:
    """Simulated chain acceptance: leading hits plus the bonus, averaged over anchors."""
    return (hits.long().cumprod(dim=1).sum(dim=1) + 1).float().mean().item()


def heldout_prompts(prompts_dir: str | Path, per_file: int) -> list[TrainingPrompt]:
    """The first ``per_file`` prompts of every expanded file's held-out split (never in the data)."""
    seen: dict[str, int] = {}
    out = []
    for p in expanded_prompts(prompts_dir, split="held_out"):
        if seen.get(p.source, 0) < per_file:
            seen[p.source] = seen.get(p.source, 0) + 1
            out.append(p)
    return out


@torch.no_grad()
def replay_tau_by_category(pipe: Pipeline, items: list[tuple[str, torch.Tensor]], builders: dict[str, TreeBuilder],
                           max_new_tokens: int, greedy_path: Path | None = None) -> dict[str, dict[str, float]]:
    """{method: {category: tau}} at T = 0 over ``items`` (category, prompt token ids) by exact replay
    (``dartree.replay``: the decoder's own round on the target's known greedy answer); tau = committed
    tokens / rounds over each category's prompts, and "all" over every prompt. The target's greedy
    answers are the costly part; ``greedy_path`` (JSONL) keeps them across calls, keyed by the prompt's
    ids, the length and the target's dtype."""
    stop = pipe.default_stop_ids()
    dtype = str(pipe.target_model.dtype).removeprefix("torch.")
    greedy = GreedyAnswers(greedy_path, ("prompt_sha1", "max_new_tokens", "dtype"))
    prompts = [ids.reshape(-1).to(pipe.device) for _, ids in items]
    keys = [{"prompt_sha1": hashlib.sha1(str(ids.tolist()).encode()).hexdigest(), "max_new_tokens": max_new_tokens, "dtype": dtype}
            for ids in prompts]
    greedy.prefetch(pipe, list(zip(prompts, keys)), max_new_tokens, stop)  # the missing answers in one batched run
    tokens = {name: {} for name in builders}
    rounds = {name: {} for name in builders}
    for (category, _), ids, key in zip(items, prompts, keys):
        answer = greedy.tokens(pipe, ids, max_new_tokens, stop, **key)
        output, lengths = replay(pipe, ids, builders, max_new_tokens, stop, answer)
        for name, acc in lengths.items():
            for group in {category, "all"}:
                tokens[name][group] = tokens[name].get(group, 0) + len(output)
                rounds[name][group] = rounds[name].get(group, 0) + len(acc)
    return {name: {c: round(tokens[name][c] / max(rounds[name][c], 1), 3) for c in sorted(tokens[name])} for name in builders}


class Trainer:
    def __init__(self, target, cfg: TrainConfig, stage: str, vocab_prior: torch.Tensor | None = None,
                 tokenizer=None, prompts_dir: str | Path | None = None):
        """``vocab_prior``: token counts that rank the tokens the responses do not decide when a new
        run picks its draft vocabulary (``reference_token_counts``). ``tokenizer`` and ``prompts_dir``
        label the sequences of shards that kept no sources (``label_original_sources``), so that they
        are balanced by category and Alpaca's are left out."""
        self.prompts_dir = prompts_dir
        self._eval_pipe: Pipeline | None = None  # the decoder's pieces for held-out replay (``replay_tau``)
        self.cfg, self.stage = cfg, stage  # stage: "drafter" (backbone + Domino) or "markov"
        self.dense_mask = False  # True: the packed forward's attention as one dense mask (to time the two)
        self.device = torch.device(cfg.device)
        self.target = target.to(self.device)
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        for p in target.parameters():
            p.requires_grad_(False)
        # The drafter trains in fp32 whatever the target's dtype (a bf16 target only computes the
        # features faster): fp32 copies of the frozen embedding and output layer it borrows.
        self.embed = torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.float(), freeze=True)
        self.out_weight = target.get_output_embeddings().weight.float()
        self._check_settings(target)
        self.tokenizer = tokenizer
        self._shards = self._shard_files()
        self._split_data(self._load(self._shards))
        self.rng = random.Random(cfg.seed + 1)
        self._feature_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._feature_cache_bytes = 0
        state = self._start_model(target, vocab_prior)
        self._prepare_training(target, state)
        self.log = open(self.out / "metrics.jsonl", "a")

    def _check_settings(self, target) -> None:
        cfg, n_layers = self.cfg, target.config.num_hidden_layers
        bad = [i for i in cfg.tapped if not 0 <= i < n_layers]
        if bad:
            raise DartreeError(f"tapped layers {bad} are out of range for a target with {n_layers} layers (0..{n_layers - 1})")
        if cfg.balance not in BALANCE:
            raise DartreeError(f"balance must be one of {', '.join(BALANCE)}, got {cfg.balance!r}")

    def _split_data(self, seqs: list[Sequence]) -> None:
        """The held-out sequences (``heldout``, ``heldout_by_category``) and the training ones."""
        cfg = self.cfg
        if len(seqs) <= cfg.heldout_seqs:
            raise DartreeError(f"{cfg.data} holds {len(seqs)} usable sequences; training needs more than the "
                               f"{cfg.heldout_seqs} held out for evaluation")
        # Held-out sequences are drawn from the first 256 only (the first shards), so that data added
        # later never moves a held-out sequence into training or the reverse; likewise the
        # held-out sequences of each category are its first ones in shard order.
        held = set(random.Random(cfg.seed).sample(range(min(len(seqs), 256)), min(cfg.heldout_seqs, len(seqs) - 1)))
        self.heldout = [seqs[i] for i in sorted(held)]
        self.heldout_by_category: dict[str, list[Sequence]] = {}
        for i, seq in enumerate(seqs):
            group = self.heldout_by_category.setdefault(sequence_category(seq), [])
            if i not in held and not self._excluded(seq) and len(group) < cfg.heldout_per_category:
                group.append(seq)
                held.add(i)
        self.heldout_by_category = {c: g for c, g in sorted(self.heldout_by_category.items()) if g}
        self.train_seqs: list[Sequence] = []
        self._by_category: dict[str, list[int]] = {}
        self._add_training([seqs[i] for i in range(len(seqs)) if i not in held])

    def _start_model(self, target, vocab_prior: torch.Tensor | None) -> dict | None:
        """``model`` and ``step``: the run folder's checkpoint, a committed drafter to resume from, or a
        new model. Returns the trainer state to restore the optimiser from (the checkpoint's), or None."""
        cfg = self.cfg
        ckpt = self.out / "checkpoint"
        if (ckpt / "config.json").is_file():
            self.model = load_drafter(ckpt)
            have = self.model.config.num_hidden_layers
            if cfg.layers and cfg.layers != have:
                raise DartreeError(f"{ckpt} holds a {have}-layer drafter; to grow it to {cfg.layers} layers, pass "
                                   f"--resume-from {ckpt} with a new --out")
            state = torch.load(self.out / "trainer.pt", weights_only=False, map_location="cpu")
            self.step = state["step"]
            self.rng.setstate(state["rng"])
            return state
        if cfg.resume_from and self.stage == "drafter":
            self._resume_committed(target, vocab_prior)
            return None
        self.step = 0
        if self.stage == "markov":
            base = load_drafter(cfg.init_drafter)
            vocab = None if base.d2t is None else base.draft_to_target(torch.arange(base.config.output_vocab_size))
            self.model = new_drafter(target, replace(cfg, layers=base.config.num_hidden_layers), "markov", vocab)
            own = self.model.state_dict()
            own.update({k: v for k, v in base.state_dict().items() if not k.startswith("head.")})
            self.model.load_state_dict(own)
        else:
            vocab = (draft_vocabulary(self.train_seqs, cfg.draft_vocab, target.config.vocab_size, vocab_prior)
                     if cfg.draft_vocab else None)
            self.model = new_drafter(target, cfg, "domino", vocab)
        return None

    def _resume_committed(self, target, vocab_prior: torch.Tensor | None) -> None:
        cfg = self.cfg
        # A shipped drafter (its folder holds no optimiser state): same weights, the
        # schedule continues at the recorded step, the optimiser's moments start afresh.
        self.model = load_drafter(cfg.resume_from)
        record = Path(cfg.resume_from) / TRAINING_RECORD
        self.step = json.loads(record.read_text())["step"] if record.is_file() else 0
        self.rng = random.Random(cfg.seed + 1 + self.step)
        if cfg.layers:
            grow_layers(self.model, cfg.layers, cfg.seed)
        if cfg.rerank_vocab:
            vocab = draft_vocabulary(self.train_seqs, cfg.draft_vocab, target.config.vocab_size, vocab_prior)
            counts = rerank_vocabulary(self.model, vocab, self.out_weight)
            print(f"draft vocabulary re-ranked on this run's data: {counts['kept']} tokens kept, "
                  f"{counts['added']} added, {counts['dropped']} dropped")

    def _prepare_training(self, target, state: dict | None) -> None:
        """The model on the device, its vocabulary maps, the head bound, the trained parameters and their optimiser."""
        self.model.to(self.device).train()
        self.vocab_ids = self.model.draft_to_target(torch.arange(self.model.config.output_vocab_size, device=self.device))
        self.teacher_rows = self.out_weight[self.vocab_ids]  # the target's logits restricted to the draft vocabulary
        self.to_draft = self.model.target_to_draft(target.config.vocab_size)
        if self.model.head is not None:
            self.model.head.bind(self.embed, self.model.d2t)
        if self.stage == "markov":
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith("head."))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=self.cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
        if state is not None:
            self.opt.load_state_dict(state["opt"])

    def _shard_files(self) -> list[Path]:
        return [f for folder in self.cfg.data.split(",") if folder.strip() for f in shard_files(folder.strip())]

    def _load(self, files: list[Path]) -> list[Sequence]:
        seqs = load_shards(files)
        if self.tokenizer is not None and self.prompts_dir is not None and Path(self.prompts_dir).is_dir():
            label_original_sources(seqs, self.prompts_dir, self.tokenizer)
        return seqs

    def _excluded(self, seq: Sequence) -> bool:
        return seq.source.partition("/")[0] in self.cfg.exclude_sources

    def _add_training(self, seqs: list[Sequence]) -> int:
        """Append the sequences that may be trained on; earlier ones keep their indices (feature cache keys)."""
        kept = [s for s in seqs if not self._excluded(s)]
        for seq in kept:
            self._by_category.setdefault(sequence_category(seq), []).append(len(self.train_seqs))
            self.train_seqs.append(seq)
        return len(kept)

    def add_new_shards(self) -> int:
        """Append the sequences of shards written since the data was loaded (a data job running
        beside training); earlier sequences keep their indices, so the feature cache stays valid."""
        known = set(self._shards)
        new = [f for f in self._shard_files() if f not in known]
        self._shards += new
        return self._add_training(self._load(new))

    def category_counts(self) -> dict[str, int]:
        return {c: len(ix) for c, ix in sorted(self._by_category.items())}

    def draw_sequence(self) -> int:
        """The index of the next training sequence: a category drawn uniformly, then one of its
        sequences (``balance="category"``), a category weighted by the square root of its size
        (``"sqrt"``), or any sequence (``"none"``)."""
        if self.cfg.balance == "category":
            return self.rng.choice(self._by_category[self.rng.choice(sorted(self._by_category))])
        if self.cfg.balance == "sqrt":
            names = sorted(self._by_category)
            weights = [math.sqrt(len(self._by_category[c])) for c in names]
            return self.rng.choice(self._by_category[self.rng.choices(names, weights)[0]])
        return self.rng.randrange(len(self.train_seqs))

    def lr_at(self, step):
        warm = max(1, int(self.cfg.warmup * self.cfg.steps))
        if step < warm:
            return self.cfg.lr * (step + 1) / warm
        progress = (step - warm) / max(1, self.cfg.steps - warm)
        return self.cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    def lam_at(self, step):
        if self.stage == "markov":
            return 0.0
        span = self.cfg.curriculum * self.cfg.steps
        ramp = max(0.0, 1.0 - step / span) if span > 0 else 0.0
        return max(self.cfg.base_weight, ramp)

    def features(self, seq: Sequence, key: int | None = None):
        """The target's tapped states and teacher log-probabilities (over the draft vocabulary) of
        positions 0..L-2 of one sequence: one teacher-forced forward feeds every anchor. With ``key``
        (the training sequence's index) the forward's states are kept, in the target's dtype, while
        the cache has room, so later epochs skip it (~30 % of a step); the teacher's distribution is
        recomputed from the kept final states (one small product) rather than stored (14x larger)."""
        tokens = seq.tokens.to(self.device)
        states = self._feature_cache.get(key) if key is not None else None
        if states is None:
            states = tapped_target_states(self.target, self.cfg.tapped, tokens)
            size = sum(t.numel() * t.element_size() for t in states)
            if key is not None and self._feature_cache_bytes + size <= self.cfg.feature_cache_gb * 2**30:
                self._feature_cache[key] = states
                self._feature_cache_bytes += size
        feats, final = states
        with torch.no_grad():
            teacher = (final[:-1].float() @ self.teacher_rows.T).log_softmax(-1)
        return tokens, feats[:-1].float(), teacher

    def _compute(self):
        """The context the drafter's forward and backward run under (bf16 autocast when asked)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.autocast)

    def sequence_losses(self, seq: Sequence, rng, grad: bool, prepared=None):
        cfg = self.cfg
        tokens, feats, teacher = prepared or self.features(seq)
        a, valid, labels, prev = block_batch(Sequence(tokens, seq.prompt_len), cfg.anchors, cfg.block_size, rng)
        ctx = torch.enable_grad() if grad and self.stage != "markov" else torch.no_grad()
        with ctx, self._compute():
            hidden = drafter_outputs(self.model, self.embed, tokens, feats, a, cfg.block_size, self.dense_mask)
            base = self.model.lm_head(hidden) if self.model.lm_head is not None else hidden @ self.out_weight.T
        with torch.enable_grad() if grad else torch.no_grad(), self._compute():
            final = self.model.head.block_logits(hidden, base, prev)
        tpos = (a[:, None] + torch.arange(cfg.block_size, device=a.device)[None, :]).clamp(max=teacher.shape[0] - 1)
        # Every slot goes through the loss (invalid ones, past the sequence's end, with weight 0):
        # indexing the [A, b, V] logits by a mask would cost a zero-filled copy in the backward pass.
        teacher_p = teacher[tpos.flatten()].exp()
        decay = torch.exp(-torch.arange(cfg.block_size, dtype=torch.float32, device=a.device) / cfg.gamma)
        w = (decay[None, :] * valid).flatten()
        lab = self.to_draft[labels.flatten()]
        flat = lambda x: x.reshape(-1, x.shape[-1])  # noqa: E731
        l_final = block_loss(flat(final), teacher_p, lab, w, cfg.hard_weight)
        l_base = block_loss(flat(base), teacher_p, lab, w, cfg.hard_weight) if self.stage != "markov" else l_final * 0
        return l_final, l_base, hidden.detach(), base.detach(), final.detach(), a, labels, valid

    @torch.no_grad()
    def evaluate(self):
        """Held-out: loss, per-depth top-1 (base and corrected) and simulated chain tau (base and
        corrected) at random anchors; the loss per category; and, where the drafter has a head, the
        tau of ``dartree`` (budget ``eval_tree_budget``) by exact replay of the decoder's round on the
        prompts of every held-out sequence (``replay_tau_by_category``), overall and per category."""
        out = self._evaluate(self.heldout, key_base=-1)
        by_category = {c: self._evaluate(seqs, key_base=-1_000 * (k + 2)) for k, (c, seqs) in enumerate(self.heldout_by_category.items())}
        if by_category:
            out["heldout_loss_by_category"] = {c: round(r["heldout_loss"], 4) for c, r in by_category.items()}
        if self.model.head is not None and self.cfg.replay_eval:  # a Domino head or a Markov head on the frozen backbone
            out.update(self.replay_tau())
        return out

    def replay_items(self) -> list[tuple[str, torch.Tensor]]:
        """The held-out sequences' prompts with their categories (the legacy ones count as "all" only)."""
        items = [("", s.tokens[: s.prompt_len]) for s in self.heldout]
        items += [(c, s.tokens[: s.prompt_len]) for c, seqs in self.heldout_by_category.items() for s in seqs]
        return items

    def replay_tau(self) -> dict:
        """The held-out tau by replay on the decoder's own pieces: the frozen target in float32 (on a
        CPU the lean forward, as ``dartree.load`` runs it, whatever dtype training computes features
        in; made once) and a float32 copy of the drafter as it is now, at a fixed budget."""
        if self._eval_pipe is None:
            target = self.target if self.target.dtype == torch.float32 else copy.deepcopy(self.target).float()
            drafter = copy.deepcopy(self.model).float().eval()
            if self.device.type == "cpu":
                cpu_products(drafter, lean=True)
            self._eval_pipe = Pipeline(target, drafter, self.tokenizer, cost_model=None)
        pipe = self._eval_pipe
        pipe.drafter.load_state_dict(self.model.state_dict())
        # the drafter's own tree (no n-gram branches): what training changes
        builder = {"dartree": DARTreeBuilder(TreeSettings(budget=self.cfg.eval_tree_budget, ngram=False))}
        tau = replay_tau_by_category(pipe, self.replay_items(), builder, self.cfg.eval_new_tokens,
                                     self.out / "heldout-greedy.jsonl")["dartree"]
        key = f"replay_tau_dartree_b{self.cfg.eval_tree_budget}"
        return {key: tau.pop("all"), f"{key}_by_category": {c: t for c, t in tau.items() if c}}

    def _evaluate(self, seqs: list[Sequence], key_base: int) -> dict:
        # Anchors come from one fixed generator and each held-out sequence's features are cached
        # (negative keys, apart from the training sequences'), so every evaluation sees the same slots.
        rng = random.Random(12345)
        to_target = self.model.draft_to_target
        hits_b, hits_f, valids, losses = [], [], [], []
        for i, seq in enumerate(seqs):
            prepared = self.features(seq, key=key_base - i)
            l_final, _, hidden, base, final, a, labels, valid = self.sequence_losses(seq, rng, grad=False, prepared=prepared)
            hits_b.append(chain_hits(base, to_target, labels, valid))
            hits_f.append(chain_hits(final, to_target, labels, valid))
            valids.append(valid)
            losses.append(l_final.item())
        hb, hf, v = torch.cat(hits_b), torch.cat(hits_f), torch.cat(valids)
        per_depth = lambda h: [round(x, 4) for x in (h.sum(0) / v.sum(0).clamp(min=1)).tolist()]  # noqa: E731
        return {"heldout_loss": sum(losses) / len(losses), "sim_tau_base": chain_tau(hb), "sim_tau_corrected": chain_tau(hf),
                "top1_base": per_depth(hb), "top1_corrected": per_depth(hf)}

    def save(self):
        ckpt = self.out / "checkpoint"
        save_drafter(self.model, ckpt)
        torch.save({"step": self.step, "opt": self.opt.state_dict(), "rng": self.rng.getstate(), "config": asdict(self.cfg)},
                   self.out / "trainer.pt")

    def _record(self, record: dict, bar, evaluate: bool) -> None:
        """Append ``record`` to metrics.jsonl; with ``evaluate``, the held-out figures added first (and printed)."""
        if evaluate:
            self.model.eval()
            record.update(self.evaluate())
            self.model.train()
            bar.write(json.dumps(record))
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()

    def run(self):
        cfg = self.cfg
        t0 = time.perf_counter()
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train {self.stage} ({self.device})", unit="step")
        if self.log.tell() == 0 and self.step < cfg.steps:
            # A new run folder: the starting point's held-out figures first (for a resumed drafter,
            # what it reached before this data), so every later evaluation has its baseline.
            self._record({"step": self.step, "elapsed_s": 0.0}, bar, evaluate=True)
        while self.step < cfg.steps:
            if cfg.max_minutes is not None and time.perf_counter() - t0 > 60 * cfg.max_minutes:
                bar.write(f"time limit reached at step {self.step}; run again to resume")
                break
            if cfg.rescan_every and self.step % cfg.rescan_every == 0 and (added := self.add_new_shards()):
                bar.write(f"step {self.step}: {added} new sequences from new shards; training on {len(self.train_seqs)}")
            lr, lam = self.lr_at(self.step), self.lam_at(self.step)
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.zero_grad(set_to_none=True)
            total = 0.0
            for _ in range(cfg.seqs_per_step):
                index = self.draw_sequence()
                seq = self.train_seqs[index]
                prepared = self.features(seq, key=index)
                l_final, l_base, *_ = self.sequence_losses(seq, self.rng, grad=True, prepared=prepared)
                loss = ((1 - lam) * l_final + lam * l_base) / cfg.seqs_per_step
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], 1.0)
            self.opt.step()
            self.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{total:.3f}", lam=f"{lam:.2f}")
            record = {"step": self.step, "loss": total, "lr": lr, "lambda": lam, "elapsed_s": time.perf_counter() - t0}
            self._record(record, bar, evaluate=self.step % cfg.eval_every == 0 or self.step == cfg.steps)
            if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                self.save()
        self.save()
        return self.out / "checkpoint"


TRAINING_RECORD = "training.json"


def export(checkpoint: str | Path, dest: str | Path, dtype=torch.bfloat16, shared_backbone: str | None = None) -> None:
    """Write a shippable copy of a checkpoint (smaller dtype; loading casts back), with a record of
    how it was trained (step, settings, data) so that a later run can resume from it.
    ``shared_backbone``: as in ``save_drafter`` (a head trained on a frozen, already shipped backbone)."""
    model = load_drafter(checkpoint)
    model.to(dtype)
    save_drafter(model, dest, shared_backbone)
    state_path = Path(checkpoint).parent / "trainer.pt"
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False, map_location="cpu")
        record = {"step": state["step"], "config": state["config"]}
        (Path(dest) / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
