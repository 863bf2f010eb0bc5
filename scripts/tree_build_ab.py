"""The compiled dartree tree build's Python-side preparation before and after it moved into compiled calls, side by
side in one process, warm and right after a target step (as in a round, where the forward has pushed the
tree's tables and the framework's own code out of the caches).

    .venv/bin/python scripts/tree_build_ab.py [--threads 2] [--repeats 40]

``before``: each depth's top-K by ``torch.topk``, the candidates' logits and output rows gathered and transposed by
tensor operations, Domino's hidden projection by ``DominoHead.start_round`` and its root state by tensor operations
on the bonus's token-table row, and the grower alone on one thread (as a lone request's tree was grown; ``torch.set_num_threads(1)`` and back around it, inside the
timed call, a few microseconds). ``after``:
``grow_kernel._inputs`` as it is (``candidates``, ``hidden_projection`` and ``domino_root``, one compiled call each)
and the grower with the head's larger products split over the threads. Both grow the same supertree from the same
draft (asserted, node for node: the hidden projections differ only in the order of their sums) and cut it to the
same top-B. The draft is the shipped drafter's after a context of about 200 tokens of the bundled model's own greedy answer, cut
where the bonus token is in the draft vocabulary (most are).
Medians; configurations take turns call by call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dartree  # noqa: E402
from dartree.hardware import describe_machine  # noqa: E402
from dartree.proposers.drafter import DraftProposer  # noqa: E402
from dartree.targets.base import Part  # noqa: E402
from dartree.trees import grow_kernel  # noqa: E402
from dartree.trees.dartree import Supertree, _ranked_top_b  # noqa: E402

K, WIDTH, BUDGET, BETA = 64, 12, 64, -0.2


def inputs_before(draft, head, tables):
    """grow_kernel._inputs as it was: tensor operations from Python."""
    base = draft.base_logits
    cands = base.topk(min(K, base.shape[-1]), dim=-1).indices.contiguous()
    cand_base = base.gather(1, cands).contiguous()
    out_rows_t = tables.out_rows[cands].transpose(1, 2).contiguous()
    hidden_proj = head.start_round(draft.hidden, base).hidden_proj.contiguous()
    row = int(tables.draft_id[draft.bonus]) if 0 <= draft.bonus < tables.draft_id.numel() else -1
    if row >= 0:
        gi = tables.table[row]
        size = gi.numel() // 3
        root = ((1 - torch.sigmoid(gi[size:2 * size])) * torch.tanh(gi[2 * size:])).contiguous()
    else:
        root = head.initial_state(draft.bonus)[0].contiguous()
    return cands, cand_base, out_rows_t, hidden_proj, root


def build(draft, head, before: bool):
    tables = grow_kernel.head_tables(head)
    parts = inputs_before(draft, head, tables) if before else grow_kernel._inputs(draft, head, tables, K)
    threads = torch.get_num_threads()
    if before:
        torch.set_num_threads(1)
    try:
        grown = grow_kernel.load().grow_supertrees([parts[0]], [parts[1]], tables.kind, [parts[2]], tables.table, [parts[3]],
                                                   tables.w_state_t, tables.w_hh_t, [parts[4]], tables.uncorrected, WIDTH,
                                                   [BUDGET], BETA)[0]
    finally:
        torch.set_num_threads(threads)
    return grown, _ranked_top_b(Supertree(*grown), BUDGET, BETA)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    pipe = dartree.load(threads=args.threads, cost_model=None)
    print(describe_machine(), f"threads {torch.get_num_threads()}, target {pipe.target.name}")
    prompt = pipe.encode(prompt="Tell me a short story about a lighthouse keeper.")
    answer = pipe.generate(input_ids=prompt, method="ar", max_new_tokens=200)
    context = torch.cat([prompt.flatten(), torch.tensor(answer.token_ids)])
    rows = grow_kernel.head_tables(pipe.head).draft_rows
    in_draft = [i for i in range(min(200, context.numel()), 10, -1) if int(context[i - 1]) < len(rows) and rows[int(context[i - 1])] >= 0]
    if not in_draft:
        raise SystemExit("no token of the answer's first 200 is in the draft vocabulary")
    n = in_draft[0]  # a bonus in the draft vocabulary, as most are
    context = context[:n]
    target = pipe.target
    target.reserve_slots(1)
    target.reset_slot(0)
    target.capture = True
    tapped = target.forward_parts([Part.causal(0, context)])[0][1]
    target.keep(0, 0, torch.arange(n))
    proposer = DraftProposer.create(pipe)
    proposer.reset()
    proposer.draft(int(context[-3]), tapped[:n - 2], n - 2)
    draft = proposer.draft(int(context[-1]), tapped[n - 2:], n)
    head = pipe.head
    tables = grow_kernel.head_tables(head)
    print(f"draft: {draft.base_logits.shape[0]} depths, bonus {draft.bonus} "
          f"({'a draft token' if draft.bonus < len(tables.draft_rows) and tables.draft_rows[draft.bonus] >= 0 else 'not a draft token'})")
    a, tree_a = build(draft, head, True)
    b, tree_b = build(draft, head, False)
    same = all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and torch.equal(tree_a.tokens, tree_b.tokens)
    print(f"the same supertree ({len(a[0])} nodes) and top-{BUDGET} tree: {same}")
    assert same

    def step():  # a one-row target step, as before a round's tree build
        target.forward_parts([Part.causal(0, context[-1:])])
        target.keep(0, n, torch.zeros(0, dtype=torch.long))

    times = {(before, cold): [] for before in (True, False) for cold in (False, True)}
    for _ in range(args.repeats):
        for key in times:
            before, cold = key
            if cold:
                step()
            t0 = time.perf_counter()
            build(draft, head, before)
            times[key].append(1000.0 * (time.perf_counter() - t0))
    for cold in (False, True):
        b_ms, a_ms = (statistics.median(times[(before, cold)]) for before in (True, False))
        print(f"{'after a target step' if cold else 'warm, back to back':22s} before {b_ms:.3f} ms, after {a_ms:.3f} ms "
              f"(before/after {b_ms / a_ms:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
