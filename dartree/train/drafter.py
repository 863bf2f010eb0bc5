"""Drafter + correction-head training on target-written shards.

One step packs every anchor of a sequence into one drafter forward: block j is
[x_a, MASK, ..., MASK] at positions a..a+b-1; its queries see the fused target context at positions
< a and their own block, never another block. With shifted labels, slot k predicts token a+k+1.

Loss per supervised slot, weighted by exp(-k/gamma): distillation to the target's full next-token
distribution (soft cross-entropy) plus a little hard-label cross-entropy. The Domino head is
trained with the base-anchored curriculum: L = (1 - lam) L(corrected) + lam L(base), lam falling
linearly from 1 to 0 over the first ``curriculum`` share of the steps. The Markov step trains only
the Markov head on the frozen backbone. Checkpoints (weights, optimiser, step, RNG) let a run resume.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..drafter import DrafterConfig, DrafterModel, load_drafter, save_drafter
from ..heads import MarkovHead
from .data import Sequence, load_shard


@dataclass
class TrainConfig:
    data: str = "runs/data"
    out: str = "runs/drafter"
    steps: int = 2000
    seqs_per_step: int = 2
    anchors: int = 24
    block_size: int = 16
    layers: int = 1
    gru: int = 256
    rank: int = 64
    markov_rank: int = 64
    lr: float = 1e-3
    warmup: float = 0.04
    gamma: float = 7.0
    hard_weight: float = 0.1  # share of hard-label CE next to the soft (distillation) CE
    curriculum: float = 0.5
    heldout_seqs: int = 12
    eval_every: int = 100
    save_every: int = 100
    max_minutes: float | None = None
    seed: int = 0
    device: str = "cpu"  # where the target and the drafter train; shards stay in CPU memory
    init_from_target: bool = True
    init_drafter: str = "runs/drafter/checkpoint"  # markov step: the trained drafter whose backbone is kept
    tapped: list[int] = field(default_factory=lambda: [1, 7, 14, 21, 27])


def load_all_shards(data_dir: str | Path) -> list[Sequence]:
    files = sorted(Path(data_dir).glob("shard-*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no shards in {data_dir}; run `dartree train data` first")
    seqs = []
    for f in files:
        seqs += [s for s in load_shard(f) if s.tokens.numel() - s.prompt_len >= 2]
    return seqs


def new_drafter(target, cfg: TrainConfig, head: str | None) -> DrafterModel:
    """A drafter shaped like the target's layers; optionally start from copies of its top layers."""
    t = target.config
    dcfg = DrafterConfig(
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=cfg.layers,
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
    )
    model = DrafterModel(dcfg)
    model.mask_embedding = torch.nn.Parameter(target.get_input_embeddings().weight.mean(0).detach().clone())
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name != "mask_embedding":
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / math.sqrt(p.shape[-1])))
        if head == "domino":
            model.head.embed_proj[2].weight.zero_()  # the correction starts as a no-op on the base logits
        if head == "markov":
            model.head.markov_w2.weight.zero_()
        if cfg.init_from_target:
            src_layers = target.model.layers[-cfg.layers:]
            for mine, theirs in zip(model.layers, src_layers):
                sd = {k: v for k, v in theirs.state_dict().items() if k in mine.state_dict()}
                mine.load_state_dict(sd, strict=False)
            model.norm.weight.copy_(target.model.norm.weight)
    return model


def to_device(seq: Sequence, device: torch.device) -> Sequence:
    """The sequence's tensors on ``device`` (``Tensor.to`` returns them as they are when already there)."""
    return Sequence(seq.tokens.to(device), seq.prompt_len, seq.features.to(device), seq.teacher.to(device))


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


def drafter_outputs(model: DrafterModel, embed, seq: Sequence, a: torch.Tensor, block: int, dtype):
    """Packed forward: hidden states [A, b, H] for all anchors of one sequence."""
    n_ctx, dev = seq.features.shape[0], a.device
    feats = seq.features.to(dtype)
    emb = model.block_embeddings(embed, seq.tokens[a])
    q = a.numel() * block
    block_pos = (a[:, None] + torch.arange(block, device=dev)[None, :]).reshape(-1)
    ctx_pos = torch.arange(n_ctx, device=dev)
    # visibility: block j sees context < a_j and its own block
    see_ctx = ctx_pos[None, :] < a.repeat_interleave(block)[:, None]
    blk_id = torch.arange(a.numel(), device=dev).repeat_interleave(block)
    see_blk = blk_id[:, None] == blk_id[None, :]
    mask = torch.cat([see_ctx, see_blk], dim=1)[None, None]
    hidden = model(emb.reshape(1, q, -1), feats[None], ctx_pos, block_pos, attn_mask=mask)[0]
    return hidden.reshape(a.numel(), block, -1)


def block_loss(logits, teacher_logp, labels, weights, hard_weight):
    """Weighted soft + hard cross-entropy over valid slots. logits [N, V], weights [N]."""
    logp = logits.float().log_softmax(-1)
    soft = -(teacher_logp.exp() * logp).sum(-1)
    hard = -logp.gather(-1, labels[:, None]).squeeze(-1)
    per = (1 - hard_weight) * soft + hard_weight * hard
    return (per * weights).sum() / weights.sum()


def acceptance(logits_blocks, labels, valid):
    """Simulated chain acceptance: leading slots whose argmax equals the target's token, plus the bonus."""
    hit = (logits_blocks.argmax(-1) == labels) & valid
    run = hit.long().cumprod(dim=1).sum(dim=1)
    return (run + 1).float().mean().item()


class Trainer:
    def __init__(self, target, cfg: TrainConfig, stage: str):
        self.cfg, self.stage = cfg, stage  # stage: "drafter" (backbone + Domino) or "markov"
        self.device = torch.device(cfg.device)
        self.target = target.to(self.device)
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        for p in target.parameters():
            p.requires_grad_(False)
        seqs = load_all_shards(cfg.data)
        want = len(cfg.tapped) * target.config.hidden_size
        if seqs[0].features.shape[1] != want:
            raise ValueError(f"shards hold {seqs[0].features.shape[1]} feature columns but {len(cfg.tapped)} tapped layers "
                             f"of width {target.config.hidden_size} need {want}; pass the tapped layers used for the data")
        rng = random.Random(cfg.seed)
        rng.shuffle(seqs)
        self.heldout, self.train_seqs = seqs[: cfg.heldout_seqs], seqs[cfg.heldout_seqs:]
        self.rng = random.Random(cfg.seed + 1)
        ckpt = self.out / "checkpoint"
        if (ckpt / "config.json").is_file():
            self.model = load_drafter(ckpt)
            state = torch.load(self.out / "trainer.pt", weights_only=False, map_location="cpu")
            self.step = state["step"]
            self.rng.setstate(state["rng"])
        else:
            self.step = 0
            if stage == "markov":
                base = load_drafter(cfg.init_drafter)
                self.model = new_drafter(target, cfg, "markov")
                own = self.model.state_dict()
                own.update({k: v for k, v in base.state_dict().items() if not k.startswith("head.")})
                self.model.load_state_dict(own)
            else:
                self.model = new_drafter(target, cfg, "domino")
            state = None
        self.model.to(self.device).train()
        if self.model.head is not None:
            self.model.head.bind(self.embed)
        if stage == "markov":
            for name, p in self.model.named_parameters():
                p.requires_grad_(name.startswith("head."))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
        if state is not None:
            self.opt.load_state_dict(state["opt"])
        self.log = open(self.out / "metrics.jsonl", "a")

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
        return max(0.0, 1.0 - step / span) if span > 0 else 0.0

    def sequence_losses(self, seq: Sequence, rng, grad: bool, need_base: bool = True):
        cfg = self.cfg
        seq = to_device(seq, self.device)
        a, valid, labels, prev = block_batch(seq, cfg.anchors, cfg.block_size, rng)
        ctx = torch.enable_grad() if grad and self.stage != "markov" else torch.no_grad()
        with ctx:
            hidden = drafter_outputs(self.model, self.embed, seq, a, cfg.block_size, torch.float32)
        base = self.lm_head(hidden)
        with torch.enable_grad() if grad else torch.no_grad():
            final = self.model.head.block_logits(hidden, base, prev)
        tpos = (a[:, None] + torch.arange(cfg.block_size, device=a.device)[None, :]).clamp(max=seq.teacher.shape[0] - 1)
        with torch.no_grad():
            teacher_logp = self.lm_head(seq.teacher[tpos[valid]].float()).log_softmax(-1)
        w = torch.exp(-torch.arange(cfg.block_size, dtype=torch.float32, device=a.device) / cfg.gamma)[None, :].expand_as(valid)[valid]
        lab = labels[valid]
        l_final = block_loss(final[valid], teacher_logp, lab, w, cfg.hard_weight)
        # the base term costs a full-vocabulary softmax: skip it once the curriculum weight is 0
        use_base = need_base and self.stage != "markov"
        l_base = block_loss(base[valid], teacher_logp, lab, w, cfg.hard_weight) if use_base else l_final * 0
        return l_final, l_base, base.detach(), final.detach(), labels, valid

    @torch.no_grad()
    def evaluate(self):
        rng = random.Random(12345)
        acc_b, acc_f, lf = [], [], []
        for seq in self.heldout:
            l_final, _, base, final, labels, valid = self.sequence_losses(seq, rng, grad=False, need_base=False)
            acc_b.append(acceptance(base, labels, valid))
            acc_f.append(acceptance(final, labels, valid))
            lf.append(l_final.item())
        return {"heldout_loss": sum(lf) / len(lf), "sim_tau_base": sum(acc_b) / len(acc_b), "sim_tau_corrected": sum(acc_f) / len(acc_f)}

    def save(self):
        ckpt = self.out / "checkpoint"
        save_drafter(self.model, ckpt)
        torch.save({"step": self.step, "opt": self.opt.state_dict(), "rng": self.rng.getstate(), "config": asdict(self.cfg)},
                   self.out / "trainer.pt")

    def run(self):
        cfg = self.cfg
        t0 = time.perf_counter()
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train {self.stage} ({self.device})", unit="step")
        while self.step < cfg.steps:
            if cfg.max_minutes is not None and time.perf_counter() - t0 > 60 * cfg.max_minutes:
                bar.write(f"time limit reached at step {self.step}; run again to resume")
                break
            lr, lam = self.lr_at(self.step), self.lam_at(self.step)
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.zero_grad(set_to_none=True)
            total = 0.0
            for _ in range(cfg.seqs_per_step):
                seq = self.train_seqs[self.rng.randrange(len(self.train_seqs))]
                l_final, l_base, *_ = self.sequence_losses(seq, self.rng, grad=True, need_base=lam > 0)
                loss = ((1 - lam) * l_final + lam * l_base) / cfg.seqs_per_step
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], 1.0)
            self.opt.step()
            self.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{total:.3f}", lam=f"{lam:.2f}")
            record = {"step": self.step, "loss": total, "lr": lr, "lambda": lam, "elapsed_s": time.perf_counter() - t0}
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                self.model.eval()
                record.update(self.evaluate())
                self.model.train()
                bar.write(json.dumps(record))
            self.log.write(json.dumps(record) + "\n")
            self.log.flush()
            if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                self.save()
        self.save()
        return self.out / "checkpoint"


def export(checkpoint: str | Path, dest: str | Path, dtype=torch.bfloat16) -> None:
    """Write a shippable copy of a checkpoint (smaller dtype; loading casts back)."""
    model = load_drafter(checkpoint)
    model.to(dtype)
    save_drafter(model, dest)


def add_drafter_args(steps) -> None:
    for name, helptext in (("drafter", "train the block drafter with its Domino head (curriculum)"),
                           ("markov", "train a Markov head on a trained, frozen drafter")):
        p = steps.add_parser(name, help=helptext)
        p.add_argument("--target", help="target directory (default: bundled SmolLM2-135M-Instruct)")
        p.add_argument("--data", default="runs/data")
        p.add_argument("--out", default=f"runs/{name}")
        p.add_argument("--steps", type=int, default=TrainConfig.steps)
        p.add_argument("--seqs-per-step", type=int, default=TrainConfig.seqs_per_step)
        p.add_argument("--anchors", type=int, default=TrainConfig.anchors)
        p.add_argument("--layers", type=int, default=TrainConfig.layers)
        p.add_argument("--gru", type=int, default=TrainConfig.gru)
        p.add_argument("--rank", type=int, default=TrainConfig.rank)
        p.add_argument("--markov-rank", type=int, default=TrainConfig.markov_rank)
        p.add_argument("--lr", type=float, default=TrainConfig.lr)
        p.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
        p.add_argument("--max-minutes", type=float, default=None, help="stop cleanly after this long; rerun to resume")
        p.add_argument("--device", default="auto", help="auto (default: a GPU when there is one, else the CPU), cpu, cuda or cuda:N")
        p.add_argument("--export", help="after training, write a bf16 copy of the drafter here")
        if name == "markov":
            p.add_argument("--init-drafter", default="runs/drafter/checkpoint", help="trained drafter whose backbone is kept")
        p.set_defaults(func=_run_train, stage=name)


def _run_train(args) -> int:
    from ..default_model import default_target_dir
    from ..pipeline import load_target, resolve_device

    torch.manual_seed(0)
    device = resolve_device(args.device)
    target = load_target(Path(args.target) if args.target else default_target_dir(), torch.float32, device)
    cfg = TrainConfig(data=args.data, out=args.out, steps=args.steps, seqs_per_step=args.seqs_per_step, anchors=args.anchors,
                      layers=args.layers, gru=args.gru, rank=args.rank, markov_rank=args.markov_rank, lr=args.lr,
                      eval_every=args.eval_every, save_every=args.eval_every, max_minutes=args.max_minutes,
                      device=str(device))
    if args.stage == "markov":
        cfg.init_drafter = args.init_drafter
    ckpt = Trainer(target, cfg, args.stage).run()
    if args.export:
        export(ckpt, args.export)
        print(f"exported {ckpt} -> {args.export}")
    return 0
