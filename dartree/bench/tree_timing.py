"""Tree-construction latency: the sequential ``heap`` against the depth-batched ``dartree``.

Both builders get the same draft outputs (random drafter states and base logits) and the same
Domino head with the published sizes (GRU 1024, rank 256), so the only difference is how the tree
is searched. Times are medians over repeated rounds, measured side by side in one process.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch

from ..drafter import DraftOutput
from ..heads import DominoHead, MarkovHead
from ..trees import TreeSettings, make_builder


@dataclass
class TreeTiming:
    hidden: int
    vocab: int
    head: str
    heap_ms: float
    dartree_ms: float
    same_tree: bool
    dartree_depth: float  # mean depth of the deepest node in the dartree tree

    @property
    def ratio(self) -> float:
        return self.heap_ms / self.dartree_ms


def _random_setup(hidden, vocab, head_kind, depths, gru, rank, seed, dtype, logit_scale=3.0):
    g = torch.Generator().manual_seed(seed)
    if head_kind == "domino":
        head = DominoHead(hidden, gru, rank, vocab, pure_prefix=1)
    else:
        head = MarkovHead(vocab, rank)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
    embed = torch.nn.Embedding(vocab, hidden)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.02)
    head, embed = head.to(dtype), embed.to(dtype)
    head.bind(embed)

    def draft(round_seed):
        rg = torch.Generator().manual_seed(round_seed)
        return DraftOutput(
            bonus=int(torch.randint(vocab, (1,), generator=rg)),
            hidden=torch.randn(depths, hidden, generator=rg).to(dtype),
            base_logits=(logit_scale * torch.randn(depths, vocab, generator=rg)).to(dtype),
        )

    return head, draft


@torch.no_grad()
def time_tree_builders(
    hidden: int,
    vocab: int,
    head_kind: str = "domino",
    settings: TreeSettings = TreeSettings(),
    depths: int = 16,
    gru: int = 1024,
    rank: int = 256,
    rounds: int = 20,
    warmup: int = 3,
    seed: int = 0,
    dtype=torch.float32,
    logit_scale: float = 3.0,
) -> TreeTiming:
    head, make_draft = _random_setup(hidden, vocab, head_kind, depths, gru, rank, seed, dtype, logit_scale)
    heap, dart = make_builder("heap", settings), make_builder("dartree", settings)
    # The equal-result check needs a beam that keeps every node the heap visits (W >= B).
    wide = make_builder("dartree", replace(settings, width=settings.budget))
    heap_t, dart_t, same, reach = [], [], True, []
    for r in range(warmup + rounds):
        draft = make_draft(seed * 1000 + r)
        # alternate the order so neither builder always runs on a warmer cache
        order = [(heap, heap_t), (dart, dart_t)] if r % 2 == 0 else [(dart, dart_t), (heap, heap_t)]
        for builder, sink in order:
            t0 = time.perf_counter()
            tree = builder.build(draft, head, builder.settings.build_budget)
            elapsed = time.perf_counter() - t0
            if r >= warmup:
                sink.append(elapsed * 1000)
                if builder is dart:
                    reach.append(int(tree.depths.max()))
        if r == warmup:
            same = heap.build(draft, head, heap.settings.build_budget).paths() == wide.build(draft, head, wide.settings.build_budget).paths()
    return TreeTiming(hidden, vocab, head_kind, statistics.median(heap_t), statistics.median(dart_t), same,
                      sum(reach) / len(reach))


def format_table(rows: list[TreeTiming], settings: dict) -> str:
    lines = [
        f"D={settings['depths']}, K={settings['tree_top_k']}, W={settings['width']}, B={settings['budget']}, "
        f"beta={settings['beta']}, GRU {settings['gru']}, rank {settings['rank']}, draft logits N(0, {settings['logit_scale']}^2), "
        f"{settings['rounds']} rounds per cell (median), torch {torch.__version__}, {torch.get_num_threads()} threads",
        "",
        "| head | hidden | vocab | heap ms/round | dartree ms/round | heap / dartree | dartree tree depth | same tree as heap at W=B |",
        "|---|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for t in rows:
        lines.append(
            f"| {t.head} | {t.hidden} | {t.vocab} | {t.heap_ms:.2f} | {t.dartree_ms:.2f} | {t.ratio:.2f}x | {t.dartree_depth:.1f} | "
            f"{'yes' if t.same_tree else 'NO'} |"
        )
    return "\n".join(lines)
