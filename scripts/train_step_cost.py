"""What one drafter training step costs, split into the target's teacher-forced forward and the
drafter's own work, for several anchor counts and drafter shapes.

    python scripts/train_step_cost.py --threads 1 --anchors 64,128,256 --shapes 1x8192,2x16384 \
        --out docs/results/drafter-v8/train-step-cost.json

Every step takes a sequence not seen before (as training on tens of thousands of sequences does,
where the in-memory feature cache holds a few hundred), so the target's forward is paid every step;
``--anchors`` is how many block positions of that sequence one forward feeds. The drafter part is
the step as ``Trainer.run`` takes it (forward, corrected + base losses, backward, clipping, AdamW).
Sequences come from the expanded set's first shards; the figures do not depend on the weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dartree.default_model import default_target_dir  # noqa: E402
from dartree.hardware import describe_machine, inexact_work_dtype  # noqa: E402
from dartree.loading import load_target  # noqa: E402
from dartree.train.data import shard_files  # noqa: E402
from dartree.train.drafter import TrainConfig, Trainer  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "data" / "smollm2-expanded"), help="shard folder (its first --shards shards are read)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--anchors", default="64,128,256", help="anchors per sequence and step, comma-separated")
    ap.add_argument("--shapes", default="1x8192,2x16384", help="drafter LAYERSxDRAFT_VOCAB, comma-separated")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per setting (one untimed step first)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attention", default="packed", help="the drafter's training attention, comma-separated of: packed "
                    "(scores only where a block sees), dense (one [Q, C + Q] mask); several are timed on the same sequences and anchors")
    ap.add_argument("--compute-dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--out", help="write the figures here as JSON")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    dtype = inexact_work_dtype("auto", device)
    autocast = inexact_work_dtype(args.compute_dtype, device) == torch.bfloat16
    target = load_target(default_target_dir(), dtype, device)
    anchors = [int(a) for a in args.anchors.split(",")]
    attentions = args.attention.split(",")
    if any(m not in ("packed", "dense") for m in attentions):
        ap.error(f"--attention takes packed and/or dense, got {args.attention!r}")
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        for f in shard_files(args.data)[: args.shards]:
            (data / f.name).symlink_to(f.resolve())
        for layers, vocab in shapes:
            cfg = TrainConfig(data=str(data), out=str(Path(tmp) / f"run-{layers}-{vocab}"), layers=layers, draft_vocab=vocab,
                              heldout_seqs=4, heldout_per_category=0, feature_cache_gb=0, autocast=autocast, rescan_every=0)
            trainer = Trainer(target, cfg, "drafter")
            seqs = iter(range(len(trainer.train_seqs)))
            for n in anchors:
                cfg.anchors = n
                teacher_s, slots = [], []
                drafter_s: dict[str, list[float]] = {mode: [] for mode in attentions}
                for k in range(args.steps + 1):
                    seq = trainer.train_seqs[next(seqs)]
                    t0 = time.perf_counter()
                    prepared = trainer.features(seq)  # no key: never cached, as for a sequence seen once
                    teacher_s.append(time.perf_counter() - t0)
                    state = trainer.rng.getstate()
                    for mode in attentions:  # the same anchors for each
                        trainer.rng.setstate(state)
                        trainer.dense_mask = mode == "dense"
                        t1 = time.perf_counter()
                        trainer.opt.zero_grad(set_to_none=True)
                        l_final, l_base, *_, valid = trainer.sequence_losses(seq, trainer.rng, grad=True, prepared=prepared)
                        (0.7 * l_final + 0.3 * l_base).backward()
                        torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), 1.0)
                        trainer.opt.step()
                        drafter_s[mode].append(time.perf_counter() - t1)
                    slots.append(int(valid.sum()))
                teacher = statistics.median(teacher_s[1:])  # the first step of a setting warms up allocations
                for mode in attentions:
                    drafter = statistics.median(drafter_s[mode][1:])
                    row = {"layers": layers, "draft_vocab": vocab, "anchors": n, "attention": mode, "teacher_s": round(teacher, 3),
                           "drafter_s": round(drafter, 3), "step_s": round(teacher + drafter, 3),
                           "slots_per_step": round(statistics.mean(slots[1:]), 1),
                           "slots_per_s": round(statistics.mean(slots[1:]) / (teacher + drafter), 1)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    record = {"machine": describe_machine(), "threads": args.threads, "target_dtype": str(dtype).removeprefix("torch."),
              "autocast_bf16": autocast, "steps_per_setting": args.steps, "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
