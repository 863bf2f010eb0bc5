"""Measuring the cost model on this machine, once per (target, drafter, device, dtype, threads,
machine, kernels):

- a target forward over n rows (n = 1, 2, 3, 4, 6, ... 128) appended to a context of ``context``
  tokens, with the output layer over the rows a walk asks for first (``verify.first_ask``: at most
  ``verify.OUTPUT_ROWS_PER_ASK`` rows): the verify stage of the round (``engine.run_round``) for a
  tree of n - 1 nodes; n = 1 is a plain decoding step;
- one drafter call (a round's draft, with a couple of new context rows, as in steady decoding, as deep
  as budget "auto" drafts when recent rounds verified shallow prefixes: ``BudgetPolicy.min_draft_depth``
  depths), and one call for 4 and for 16 requests at once (``drafter.draft_batch``);
- the ``dartree`` tree build at the largest budget, alone and for 4 and 16 requests together.

The parts are handed in (the target adapter, the drafter's proposer, the correction head); the
result is cached as JSON under ``.cache/costmodel/``.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import kernels, quant
from .budget import BudgetPolicy
from .costmodel import CostModel
from .default_model import cache_root
from .engine import Request, run_round
from .hardware import describe_machine
from .heads import CorrectionHead, to_target_ids
from .proposers import DraftProposer, draft_batch
from .targets.base import Part
from .trees import DraftTree, TreeBuilder, TreeSettings, build_trees, grow_kernel, make_builder
from .verify import Sampler

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DRAFT_BATCHES = (4, 16)  # requests in one timed batched drafter call and in one timed batch of trees
# Part of a cached model's identity: raised whenever what is timed changes, so that older caches are measured again.
COST_MODEL_VERSION = 12  # 12: the bonus a draft-vocabulary token where the drafter has a reduced one


def identity(target, proposer=None) -> dict:
    """What a cost model depends on: the target and its forward, the drafter, the machine."""
    cfg = target.config
    drafter = proposer.model.config if proposer is not None else None
    return {
        "target": f"{cfg.model_type}-L{cfg.num_hidden_layers}-H{cfg.hidden_size}-V{cfg.vocab_size}",
        "drafter": "none" if drafter is None else
                   f"L{drafter.num_hidden_layers}-b{drafter.block_size}-V{drafter.output_vocab_size}-{drafter.projector_type}",
        "device": str(target.device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "forward": target.name,  # which forward (targets/)
        "kernels": kernels.build_dir().name,  # the lean kernels' source and build: changed kernels, new times
        "quant_kernels": quant.build_dir().name,  # the same for the integer products
        "tree_kernels": grow_kernel.build_dir().name,  # and the tree grower
        "threads": torch.get_num_threads(),
        "machine": describe_machine(),
        "version": COST_MODEL_VERSION,
    }


def cache_path(ident: dict, context: int) -> Path:
    digest = hashlib.sha1(json.dumps([ident, context], sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "costmodel" / f"{digest}.json"


def _median_ms(fn, repeats: int, before=None) -> float:
    """Median milliseconds of ``fn()``; ``before()`` (untimed) runs ahead of each call."""
    times = []
    for i in range(repeats + 1):  # the first call warms up
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(1000.0 * (time.perf_counter() - t0))
    return statistics.median(times)


class _Chain(TreeBuilder):
    """The cost model's round: the root and a chain of fixed tokens (not a method; no drafter)."""

    name = "cost-model chain"
    proposer = None

    def __init__(self, tokens: torch.Tensor):
        super().__init__(TreeSettings())
        self.tokens = tokens

    def build(self, draft, head, budget):
        return DraftTree.chain(self.tokens)


@torch.no_grad()
def measure(target, proposer: DraftProposer | None = None, head: CorrectionHead | None = None, context: int = 256,
            rows=ROWS, repeats: int = 5, max_budget: int = 64, progress: bool = True) -> CostModel:
    """Time ``target``'s verification forwards, ``proposer``'s drafter call and the ``dartree`` tree
    build with ``head`` on this machine. A forward of n rows is timed as the verify stage of the
    round every request runs (``engine.run_round``): one request whose tree is a chain of n - 1
    tokens after a context of ``context`` tokens, in slot 0, cut back to the context after each."""
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    device = target.device
    prompt = torch.randint(vocab, (context,), generator=gen)
    d2t = proposer.model.d2t if proposer is not None else None
    if d2t is not None:  # a reduced draft vocabulary: the bonus one of its tokens, as most bonus tokens of real text
        # are (the tree's root state then comes from the head's token table, as in most rounds, not from a product)
        prompt[-1] = int(to_target_ids(d2t.cpu(), torch.randint(d2t.numel(), (1,), generator=gen))[0])
    prompt = prompt.to(device)
    bonus = int(prompt[-1])
    target.reserve_slots(1)
    target.reset_slot(0)
    target.capture = proposer is not None
    tapped_states = target.forward_parts([Part.causal(0, prompt)])[0][1]
    target.keep(0, 0, torch.arange(context, device=device))
    requests = {n: Request(prompt, _Chain(torch.randint(vocab, (n - 1,), generator=gen).to(device)), Sampler(0.0), 1 << 30,
                           set(), slot=0, output=[bonus], prefilled=context, bonus=bonus) for n in rows}

    def forward(n: int) -> float:
        r = requests[n]
        r.output, r.bonus = [bonus], bonus
        before = r.stats.stage_ms.get("verify", 0.0)
        run_round(target, [r])
        target.keep(0, context, torch.zeros(0, dtype=torch.long, device=device))  # back to the context
        return r.stats.stage_ms["verify"] - before

    # Sizes take turns, one forward each per pass, so a machine whose speed drifts (a shared or
    # throttled CPU) shifts every size alike instead of bending the curve; each size's median counts.
    times = {n: [] for n in rows}
    for n in rows:
        forward(n)  # warm-up
    for _ in tqdm(range(repeats), desc="timing target forwards", unit="pass", disable=not progress):
        for n in rows:
            times[n].append(forward(n))
    verify_ms = {n: statistics.median(ts) for n, ts in times.items()}
    draft_ms = tree_ms = 0.0
    draft_batch_ms: dict[int, float] = {}
    tree_batch_ms: dict[int, float] = {}
    if proposer is not None:
        # In a round the drafter call and the tree build follow a target forward, which has streamed
        # the target's weights through the caches and pushed the drafter's out: each timed call here
        # follows one too (untimed). Timed back to back on warm caches, both come out cheaper than in
        # real rounds (a drafter call by up to a third; docs/experiments.md, "Notes that used to live
        # in the code").
        # budget "auto" (the only user of these prices) drafts BudgetPolicy.min_draft_depth depths unless
        # recent rounds verified deeper prefixes; the real calls' times then scale the price (MeasuredCostModel)
        depth_limit, proposer.depth_limit = proposer.depth_limit, BudgetPolicy.min_draft_depth
        try:
            def draft_call():
                proposer.reset()
                proposer.draft(bonus, tapped_states[: context - 2], context - 2)  # the drafter's own prefill
                forward(1)
                t0 = time.perf_counter()
                out = proposer.draft(bonus, tapped_states[context - 2:], context)  # a steady round: 2 new rows
                return out, 1000.0 * (time.perf_counter() - t0)

            draft_call()
            timed = [draft_call() for _ in range(repeats)]
            draft_ms = statistics.median(ms for _, ms in timed)
            for size in DRAFT_BATCHES:  # one call for several requests, each with its own cache and context
                group = [DraftProposer(proposer.model, proposer.embed_tokens, proposer.lm_head) for _ in range(size)]
                for p in group:
                    p.depth_limit = BudgetPolicy.min_draft_depth

                # 2-5 new context rows each (requests accept different run lengths)
                cuts = [max(context - 2 - i % 4, 1) for i in range(size)]

                def batch_call():
                    for p, cut in zip(group, cuts):
                        p.reset()
                        p.draft(bonus, tapped_states[:cut], cut)
                    forward(1)
                    t0 = time.perf_counter()
                    draft_batch(group, [bonus] * size, [tapped_states[cut:context] for cut in cuts], [context] * size)
                    return 1000.0 * (time.perf_counter() - t0)

                batch_call()
                draft_batch_ms[size] = statistics.median(batch_call() for _ in range(repeats))
            if head is not None:
                draft = timed[-1][0]
                builder = make_builder("dartree", TreeSettings(budget=max_budget))
                # each build after a target forward and the round's drafter call (draft_call), as in a round
                tree_ms = _median_ms(lambda: builder.build_tree(draft, head), repeats, draft_call)
                for size in DRAFT_BATCHES:  # the trees of several requests built together
                    tree_batch_ms[size] = _median_ms(lambda: build_trees([builder] * size, [draft] * size, head, [max_budget] * size),
                                                     repeats, draft_call)
        finally:  # the proposer is the pipeline's own: its depth limit back even where a timing fails
            proposer.depth_limit = depth_limit
    target.reset_slot(0)
    target.capture = True
    return CostModel(identity(target, proposer), context, verify_ms, draft_ms, tree_ms, draft_batch_ms, tree_batch_ms)


def load_or_measure(target, proposer: DraftProposer | None = None, head: CorrectionHead | None = None, context: int = 256,
                    remeasure: bool = False, progress: bool = True) -> CostModel:
    """The cached cost model of (``target``, ``proposer``, ``head``) on this machine, measured (and
    cached) when missing."""
    ident = identity(target, proposer)
    path = cache_path(ident, context)
    if path.is_file() and not remeasure:
        try:
            return CostModel.from_json(path.read_text())
        except (json.JSONDecodeError, KeyError, TypeError):
            pass  # a corrupt cache file is measured again
    if progress:
        print(f"dartree: measuring this machine's cost model once (cached in {path.parent}); "
              "`dartree calibrate` shows it", file=sys.stderr)
    model = measure(target, proposer, head, context, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model.to_json())
    return model
