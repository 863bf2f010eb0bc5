"""Plot a drafter training run's held-out figures by step: tau by replay per category and the loss.

    python scripts/plot_training.py runs/drafter-v3/metrics.jsonl docs/training/drafter-v3-heldout.png

Reads the evaluation records of ``dartree train drafter`` (``metrics.jsonl``): the replayed
``dartree`` tau over all held-out prompts and per category, and the held-out loss per category.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    records = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    evals = [r for r in records if any(k.startswith("replay_tau_dartree_b") and not k.endswith("_by_category") for k in r)]
    if not evals:
        print(f"{sys.argv[1]} has no replay evaluations", file=sys.stderr)
        return 1
    key = next(k for k in evals[0] if k.startswith("replay_tau_dartree_b") and not k.endswith("_by_category"))
    steps = [r["step"] for r in evals]
    fig, (tau_ax, loss_ax) = plt.subplots(1, 2, figsize=(13, 5))
    categories = sorted({c for r in evals for c in r.get(f"{key}_by_category", {})})
    colour = {c: plt.cm.tab20(i % 20) for i, c in enumerate(categories)}
    for c in categories:
        tau_ax.plot(steps, [r.get(f"{key}_by_category", {}).get(c, float("nan")) for r in evals], marker=".", label=c, color=colour[c])
    tau_ax.plot(steps, [r[key] for r in evals], color="black", linewidth=2.5, label="all")
    tau_ax.set_title(f"held-out tau by replay ({key.removeprefix('replay_tau_')})")
    tau_ax.set_xlabel("step")
    tau_ax.legend(fontsize=7, ncol=2)
    for c in categories:
        loss_ax.plot(steps, [r.get("heldout_loss_by_category", {}).get(c, float("nan")) for r in evals], marker=".", label=c,
                     color=colour[c])
    loss_ax.plot(steps, [r["heldout_loss"] for r in evals], color="black", linewidth=2.5, label="legacy held-out")
    loss_ax.set_title("held-out loss")
    loss_ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=110)
    print(f"wrote {sys.argv[2]} ({len(evals)} evaluations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
