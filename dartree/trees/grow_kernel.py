"""DARTree's supertree grown in one compiled call (``csrc/tree_kernels.cpp``) where it can be.

``grow_supertree`` in ``trees/dartree.py`` runs a depth as some twenty framework calls (the head's
products, a log-softmax, a top-n, the GRU step): ~4 ms a tree on a CPU, most of it per-call
overhead. The compiled grower does the same computation in one call over tables prepared once per
head (``HeadTables``): the Domino GRU's input projection of every draft token (one product at bind
time instead of one a depth), the Markov head's W1 rows by draft id, the output rows. The tree is
the Python builder's on the same logits (tests/test_tree_kernels.py: node for node in float64, over
random heads, logits, widths, budgets and betas); the Python builder stays the reference and the
path for heads, dtypes and devices the kernel does not take.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import kernels
from ..heads import DominoHead, MarkovHead
from . import common
from .tree import DraftTree

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "tree_kernels.cpp"
NO_HEAD, DOMINO, MARKOV = 0, 1, 2
MAX_TABLE_BYTES = 64 << 20  # a head's token table above this (a full 150k vocabulary) keeps the Python grower


def build_dir() -> Path:
    return kernels.extension_dir(SOURCE, "tree_kernels")


@functools.lru_cache(maxsize=1)
def load():
    return kernels.build_extension(SOURCE, "tree_kernels", "dartree_tree_kernels", "the tree builders' kernels")


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        load()
    except Exception as exc:  # no compiler: the Python grower stays
        print(f"dartree: the compiled tree grower is unavailable here ({type(exc).__name__}); "
              "trees grow in Python", file=sys.stderr)
        return False
    return True


@dataclass
class HeadTables:
    kind: int
    table: torch.Tensor      # [V_d, X] what a token's step needs, by draft id
    out_rows: torch.Tensor   # [V_d, R] the head's output rows
    w_state_t: torch.Tensor  # Domino: W_s transposed [S, R]
    w_hh_t: torch.Tensor     # Domino: the GRU's hidden weights transposed [S, 3S]
    uncorrected: int
    draft_id: torch.Tensor   # Domino: each target token's draft id (-1: not in the draft vocabulary)
    out_rows_t: torch.Tensor  # [R, V_d] the output rows transposed, for the chain over the whole vocabulary
    w_z_t: torch.Tensor      # Domino: W_z transposed [H, R] (the hidden projection's weights; empty for Markov)

    def __post_init__(self):
        self.draft_rows = self.draft_id.numpy()  # the same ids, read by a Python int without a tensor operation


def _version(head) -> tuple:
    """What the tables are made of: each parameter (replaced or changed in place) and the bound
    embedding. Read every round, so the head's modules are listed once (a parameter set anew on a
    module still shows: its ``_parameters`` entry is read each time)."""
    modules = head.__dict__.get("_grow_modules")
    if modules is None:
        modules = head.__dict__["_grow_modules"] = list(head.modules())
    return tuple((id(p), p._version) for m in modules for p in m._parameters.values() if p is not None) + \
        (id(head._embed), id(head._d2t))


@torch.no_grad()
def head_tables(head) -> HeadTables | None:
    """The compiled grower's tables for ``head`` (made once, again when its weights change), or None
    where the kernel does not take it."""
    if not isinstance(head, (DominoHead, MarkovHead)) or head._embed is None:
        return None
    param = next(head.parameters())
    if param.device.type != "cpu" or param.dtype not in (torch.float32, torch.float64) or not available():
        return None
    key = _version(head)
    cached = head.__dict__.get("_grow_tables")
    if cached is not None and cached[0] == key:
        return cached[1]
    empty = param.new_zeros(0)
    if isinstance(head, DominoHead):
        w2 = head.embed_proj[2].weight
        ids = head.target_ids(torch.arange(w2.shape[0]))
        w_ih = head.prefix_gru.weight_ih_l0
        if w2.shape[0] * w_ih.shape[0] * param.element_size() > MAX_TABLE_BYTES:
            return None
        table = head._embed(ids).to(param.dtype) @ w_ih.T
        draft_id = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long)
        draft_id[ids] = torch.arange(ids.numel())
        tables = HeadTables(DOMINO, table.contiguous(), w2.detach().contiguous(),
                            head.embed_proj[0].weight[:, head.hidden_size:].detach().T.contiguous(),
                            head.prefix_gru.weight_hh_l0.detach().T.contiguous(), head.uncorrected_depths, draft_id,
                            w2.detach().T.contiguous(), head.embed_proj[0].weight[:, :head.hidden_size].detach().T.contiguous())
    else:
        w2 = head.markov_w2.weight
        ids = head.target_ids(torch.arange(w2.shape[0]))
        tables = HeadTables(MARKOV, head.markov_w1.weight[ids].detach().contiguous(), w2.detach().contiguous(),
                            empty, empty, head.uncorrected_depths, torch.zeros(0, dtype=torch.long), w2.detach().T.contiguous(),
                            empty)
    head.__dict__["_grow_tables"] = (key, tables)
    return tables


def _inputs(draft, head, tables: HeadTables, tree_top_k: int) -> tuple[torch.Tensor, ...]:
    """One request's part of the call: its candidates [D, K], their base logits [D, K], their output
    rows transposed [D, R, K], its hidden projection (Domino) and its root state."""
    base = draft.base_logits.contiguous()
    # candidate_tables' top-K, their base logits and output rows in one call (the same candidates, in the same
    # order wherever the K-th logit is not tied: then torch.topk leaves open which of the tied come in)
    cands, cand_base, out_rows_t = load().candidates(base, tables.out_rows, min(tree_top_k, base.shape[-1]))
    return cands, cand_base, out_rows_t, _hidden_projection(draft, tables), _root(head, tables, draft.bonus)


def _hidden_projection(draft, tables: HeadTables) -> torch.Tensor:
    """Domino's W_z z_d of every depth (``head.start_round``'s hidden projection) by the grower's own product, in one
    call: the same values up to the order of the sums, the same bits every call. Empty for Markov."""
    if tables.kind != DOMINO:
        return draft.base_logits.new_zeros(0)
    return load().hidden_projection(draft.hidden.to(tables.table.dtype).contiguous(), tables.w_z_t)


def _root(head, tables: HeadTables, bonus: int) -> torch.Tensor:
    """The head's state after the bonus token (``head.initial_state``). Domino's step from the zero state
    needs the bonus's input projection, already a row of the token table where the bonus is a draft token:
    the row read instead of a product with the GRU's input weights (a third of a millisecond a round on a
    CPU, those weights cold after the target's forward), and the step made in one compiled call. The same
    values up to rounding (the compiled and the Python growers' trees agree node for node:
    tests/test_tree_kernels.py)."""
    if tables.kind == DOMINO and 0 <= bonus < len(tables.draft_rows) and tables.draft_rows[bonus] >= 0:
        return load().domino_root(tables.table, int(tables.draft_rows[bonus]))
    return head.initial_state(bonus)[0].contiguous()


@torch.no_grad()
def grow_supertree(draft, head, tree_top_k: int, width: int, budget: int | None, beta: float):
    """``trees.dartree.grow_supertree`` with a quota of ``width`` a depth, in one compiled call: the
    supertree's (tokens, parents, depths, scores); None where the kernel does not take this head or
    these logits (the caller grows in Python)."""
    grown = grow_supertrees([draft], head, tree_top_k, width, [budget], beta)
    return None if grown is None else grown[0]


@torch.no_grad()
def grow_supertrees(drafts: list, head, tree_top_k: int, width: int, budgets: list[int | None], beta: float):
    """``grow_supertree`` for several requests in one compiled call, the requests split over the threads:
    each request's supertree is the one it gets alone, bit for bit. None where the kernel does not take
    this head or these logits."""
    tables = head_tables(head)
    if tables is None or not all(d.base_logits.dtype == tables.table.dtype and d.base_logits.device.type == "cpu"
                                 for d in drafts):
        return None
    parts = list(zip(*(_inputs(d, head, tables, tree_top_k) for d in drafts)))
    grown = load().grow_supertrees(list(parts[0]), list(parts[1]), tables.kind, list(parts[2]), tables.table, list(parts[3]),
                                   tables.w_state_t, tables.w_hh_t, list(parts[4]), tables.uncorrected, width,
                                   [0 if b is None else b for b in budgets], float(beta))
    return [tuple(g) for g in grown]


@torch.no_grad()
def corrected_chain(draft, head) -> tuple[torch.Tensor, torch.Tensor]:
    """``trees.common.corrected_chain_logits`` (the head-corrected greedy chain's draft ids [D] and its
    corrected logits [D, V_d]) in one compiled call where the kernel takes this head and these logits
    (the same values up to the order of the products' sums, tests/test_tree_kernels.py); elsewhere the
    Python chain."""
    tables = head_tables(head)
    base = draft.base_logits
    if tables is None or base.dtype != tables.table.dtype or base.device.type != "cpu":
        return common.corrected_chain_logits(draft, head)
    base = base.contiguous()
    tokens, logits = load().corrected_chain(base, tables.kind, tables.out_rows_t, tables.table, _hidden_projection(draft, tables),
                                            tables.w_state_t, tables.w_hh_t, _root(head, tables, draft.bonus), tables.uncorrected)
    return tokens, logits


@torch.no_grad()
def best_first_marginals(logprobs: torch.Tensor, budget: int) -> DraftTree:
    """``trees.common.best_first_marginals`` (DDTree's best-first heap), in one compiled call after the
    top-k where it runs: the same pops in the same order, the scores summed in float64 as Python's
    floats are. Elsewhere (off the CPU, no compiler) the Python heap."""
    if logprobs.device.type != "cpu" or not available():
        return common.best_first_marginals(logprobs, budget)
    top_lp, top_ids = logprobs.topk(min(budget, logprobs.shape[1]), dim=-1)
    tokens, parents, depths, scores = load().best_first(top_lp.to(torch.float64).contiguous(), top_ids.contiguous(), int(budget))
    tree = DraftTree(tokens, parents, depths, log_probs=scores)
    tree.rank = torch.arange(len(tree))
    return tree
