"""Time a round's own stages on the bundled model, each path side by side in one process.

    .venv/bin/python scripts/time_lean_round.py --threads 2

The drafter call (one request, a steady round: 2 new context rows after a 200-token context) on the
module forward, on the lean kernels with float32 products and with Q8_0 products (the default), with
how far each path's base logits are from the module's; then one ``dartree`` tree build (K = 64,
W = 12, up to 64 nodes) grown in Python and by the compiled grower, 4 / 8 / 16 requests' trees by a
compiled call each against one call for the batch, the head-corrected chain (`domino`, `domino-ddtree`) and
DDTree's best-first heap, each in Python and compiled; last a round without a drafter call: the n-gram
proposer's tree after the model's own 200-token answer, and budget auto's cut of it. Medians of back-to-back calls.
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
from dartree.budget import BudgetPolicy, cut_batch  # noqa: E402
from dartree.costmodel import CostModel  # noqa: E402
from dartree.hardware import describe_machine  # noqa: E402
from dartree.lean_drafter import DRAFTER_PRODUCTS, LeanDrafterWeights  # noqa: E402
from dartree.proposers.drafter import DraftProposer  # noqa: E402
from dartree.proposers.ngram import NgramProposer  # noqa: E402
from dartree.targets.base import Part  # noqa: E402
from dartree.targets.lean import KVStore  # noqa: E402
from dartree.trees import grow_kernel  # noqa: E402
from dartree.trees.common import best_first_marginals, corrected_chain_logits  # noqa: E402
from dartree.trees.dartree import grow_supertree  # noqa: E402


def median_ms(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(1000.0 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    pipe = dartree.load(threads=args.threads, cost_model=None, keep_drafter_weights=True)  # it times the module forward too
    print(describe_machine(), f"threads {torch.get_num_threads()}, target {pipe.target.name}")
    context = 200
    prompt = torch.randint(pipe.target_model.config.vocab_size - 1, (context,), generator=torch.Generator().manual_seed(0))
    pipe.target.reserve_slots(1)
    pipe.target.reset_slot(0)
    pipe.target.capture = True
    tapped = pipe.target.forward_parts([Part.causal(0, prompt)])[0][1]

    def steady_call(proposer):
        proposer.reset()
        proposer.draft(5, tapped[:context - 2], context - 2)
        return proposer.draft(7, tapped[context - 2:], context)

    def timed(proposer):
        def once():
            proposer.reset()
            proposer.draft(5, tapped[:context - 2], context - 2)
            t0 = time.perf_counter()
            proposer.draft(7, tapped[context - 2:], context)
            return 1000.0 * (time.perf_counter() - t0)
        once()
        return statistics.median(once() for _ in range(15))

    module = DraftProposer.create(pipe)
    module.lean = module.store = None
    reference = steady_call(module)
    print(f"drafter call, module forward: {timed(module):.2f} ms")
    for products in DRAFTER_PRODUCTS:
        lean = DraftProposer.create(pipe)
        lean.lean = LeanDrafterWeights(lean.model, lean.lm_head, products)
        lean.store = KVStore(lean.lean, 1, 256)
        out = steady_call(lean)
        diff = (out.base_logits - reference.base_logits).abs().max().item()
        top1 = (out.base_logits.argmax(-1) == reference.base_logits.argmax(-1)).float().mean().item()
        print(f"drafter call, lean {products}: {timed(lean):.2f} ms (base logits: max difference {diff:.2g}, "
              f"top-1 the same at {top1:.0%} of depths)")
    draft, head = reference, pipe.head
    python_ms = median_ms(lambda: grow_supertree(draft, head, 64, lambda d, p: 12, budget=64, beta=-0.2))
    compiled_ms = median_ms(lambda: grow_kernel.grow_supertree(draft, head, 64, 12, 64, -0.2))
    print(f"dartree supertree (K 64, W 12, B 64): Python {python_ms:.2f} ms, compiled {compiled_ms:.2f} ms")
    for requests in (4, 8, 16):
        drafts = [draft] * requests
        each_ms = median_ms(lambda: [grow_kernel.grow_supertree(d, head, 64, 12, 64, -0.2) for d in drafts])
        together_ms = median_ms(lambda: grow_kernel.grow_supertrees(drafts, head, 64, 12, [64] * requests, -0.2))
        print(f"{requests} supertrees: a compiled call each {each_ms:.2f} ms, one call for all {together_ms:.2f} ms")
    python_ms = median_ms(lambda: corrected_chain_logits(draft, head))
    compiled_ms = median_ms(lambda: grow_kernel.corrected_chain(draft, head))
    print(f"head-corrected chain ({draft.base_logits.shape[0]} depths, {draft.base_logits.shape[1]} draft tokens; domino, "
          f"domino-ddtree): Python {python_ms:.2f} ms, compiled {compiled_ms:.2f} ms")
    logprobs = draft.base_logits.log_softmax(-1)
    python_ms = median_ms(lambda: best_first_marginals(logprobs, 64))
    compiled_ms = median_ms(lambda: grow_kernel.best_first_marginals(logprobs, 64))
    print(f"DDTree best-first tree (B 64, top-k included): Python {python_ms:.3f} ms, compiled {compiled_ms:.3f} ms")
    # a round without a drafter call: the n-gram tree over the model's own answer, and its cut (a cost curve
    # of the Zen 3 one's shape: a second row 1.2x a step, four 1.8x)
    answer = pipe.generate(prompt="Tell me a short story about a lighthouse keeper.", method="ar", max_new_tokens=200).token_ids
    ngram = NgramProposer()
    ngram.observe(torch.tensor(answer[:-1]), None)
    tree = ngram.propose(answer[-1])
    cost = CostModel({}, 256, {1: 1.0, 2: 1.2, 3: 1.5, 4: 1.8, 8: 3.2, 16: 5.4, 32: 10.0, 64: 19.0})
    policy = BudgetPolicy(cost)
    kept = cut_batch([(policy, tree)], 1, 1.0, 0, [False], [None])[0]
    propose_ms = median_ms(lambda: ngram.propose(answer[-1]), 200)
    cut_ms = median_ms(lambda: cut_batch([(policy, tree)], 1, 1.0, 0, [False], [None]), 200)
    print(f"n-gram tree ({len(tree)} nodes, cut to {len(kept)}): propose {propose_ms:.3f} ms, budget cut {cut_ms:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
