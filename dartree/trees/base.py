"""What every method shares: the tree settings, the builder interface and the registry."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields, replace

from ..errors import DartreeError
from ..heads import CorrectionHead
from .tree import DraftTree


def parse_budget(text: str) -> int | str:
    """A budget as written on a command line or in a list: an integer or 'auto'."""
    return text if text == "auto" else int(text)


def parse_switch(text) -> bool:
    """A switch as written on a command line or in a list: on/off (true/false, 1/0, yes/no)."""
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in ("on", "true", "1", "yes"):
        return True
    if word in ("off", "false", "0", "no"):
        return False
    raise ValueError(text)


def refuse_retired(**renamed: str):
    """A class decorator: each keyword ``old=new`` of ``renamed`` is a retired spelling of a setting
    that is now ``new``; giving it to the class (or to ``GenerationSettings.from_kwargs``) is a
    ``DartreeError`` that names the new spelling, not a bare ``TypeError``. ``cls.retired`` keeps the map."""

    def wrap(cls):
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            check_retired(cls.__name__, cls.retired, kwargs)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        cls.retired = dict(renamed)
        return cls

    return wrap


def check_retired(owner: str, retired: dict[str, str], names) -> None:
    """A ``DartreeError`` naming the new spelling when ``names`` holds a retired one of ``retired``."""
    old = sorted(set(names) & set(retired))
    if old:
        raise DartreeError("; ".join(f"{owner}: {name!r} was renamed {retired[name]!r}" + RETIRED_NOTES.get(name, "")
                                     for name in old))


# Why a spelling was retired, where the old name now means something else.
RETIRED_NOTES = {
    "top_k": " (DARTree's K, candidate tokens per depth); top_k is now sampling top-k (GenerationSettings.top_k, "
             "generate(top_k=...), --top-k)",
    "sampling_top_k": " (sampling top-k of the target, as in Hugging Face and vLLM); DARTree's K is tree_top_k",
}


def _setting(default, help: str, flags: tuple[str, ...], request: str, key: str, parse=int):
    """One tree setting's declaration: its default, its help, its command-line flags, its name as a
    request field of ``dartree serve``, its short name in a bench configuration's key (``B=16``) and
    how to read it from text (and what that accepts, for error messages). The CLI, the server, the bench grid and its records derive their
    arguments and fields from these; the methods that read a setting come from the registry
    (``TreeBuilder.settings_read``)."""
    expects = {int: "an integer", float: "a number", parse_budget: "an integer or 'auto'", parse_switch: "on or off"}[parse]
    return field(default=default, metadata={"help": help, "flags": flags, "request": request, "key": key, "parse": parse,
                                            "expects": expects})


@refuse_retired(top_k="tree_top_k")
@dataclass(frozen=True)
class TreeSettings:
    """The tree settings and their defaults (the paper's), in one place; each builder declares which
    of them it reads (``TreeBuilder.reads``)."""

    budget: int | str = _setting(  # B; "auto": chosen every round (budget.py)
        "auto", "tree nodes verified per round, root excluded, or 'auto' (chosen every round from the measured cost model)",
        ("--budget", "-B"), "budget", "B", parse_budget)
    width: int = _setting(12, "branches kept per depth", ("--width", "-W"), "width", "W")  # W
    # K; "top_k" is sampling top-k everywhere (as in Hugging Face and vLLM), so DARTree's K is "tree_top_k"
    tree_top_k: int = _setting(64, "DARTree's K: candidate tokens per depth", ("--tree-top-k", "-K"), "tree_top_k", "K")
    beta: float = _setting(-0.2, "depth bonus of the final top-B, must be <= 0", ("--beta",), "beta", "beta", float)
    max_budget: int = _setting(64, "with --budget auto: the largest tree built each round", ("--max-budget",), "max_budget",
                               "max")
    # on: the n-gram tree merged before the global top-B, measured better on every held-out category and
    # in wall clock (docs/results/lean-round); off: the drafter's tree alone, today's trees node for node
    ngram: bool = _setting(True, "dartree: merge the n-gram proposer's continuations of the text's repeated suffix into "
                           "the drafter's tree before its global top-B (on/off)", ("--ngram",), "ngram", "ngram", parse_switch)

    @classmethod
    def declarations(cls):
        """The settings' dataclass fields, each with its ``metadata`` (help, flags, request, parse)."""
        return fields(cls)

    @property
    def auto(self) -> bool:
        return self.budget == "auto"

    @property
    def build_budget(self) -> int:
        """The budget builders build at: the budget, or ``max_budget`` when the budget is chosen per round."""
        return self.max_budget if self.auto else self.budget

    def validate(self) -> "TreeSettings":
        if isinstance(self.budget, str) and self.budget != "auto":
            raise DartreeError(f"budget must be an integer >= 1 or 'auto', got {self.budget!r}")
        for name in ("width", "tree_top_k", "max_budget") + (() if self.auto else ("budget",)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DartreeError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.ngram, bool):
            raise DartreeError(f"ngram must be on or off (a boolean), got {self.ngram!r}")
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta)):
            raise DartreeError(f"beta must be a finite number <= 0, got {self.beta!r}")
        if self.beta > 0:
            raise DartreeError(
                f"beta must be <= 0, got {self.beta}: with a positive depth bonus a child can outscore its parent, "
                "so the global top-B is no longer a valid (ancestor-closed) tree"
            )
        return self


BUILDERS: dict[str, type["TreeBuilder"]] = {}


def register(cls: type["TreeBuilder"]) -> type["TreeBuilder"]:
    """Add a method to the registry: its name, what it needs and which settings it reads are
    declared on the class, and everything else (METHODS, CLI choices, bench grids, report order,
    ``Pipeline.methods``, test parametrisations) derives from here. Order = registration order."""
    if cls.name in BUILDERS:
        raise ValueError(f"method {cls.name!r} registered twice")
    unknown = set(cls.reads) - set(TreeSettings.__dataclass_fields__)
    if unknown:
        raise ValueError(f"method {cls.name!r} reads unknown settings {sorted(unknown)}")
    BUILDERS[cls.name] = cls
    return cls


class TreeBuilder:
    """One method: turns one round's draft into a tree. Subclasses set the class attributes below
    and implement ``build``; ``@register`` makes them a method."""

    name = ""
    proposer: str | None = "drafter"  # the registered proposer its trees are built from (None: plain decoding)
    needs_head = False  # True: needs a correction head (Domino or Markov)
    reads: tuple[str, ...] = ()  # the TreeSettings fields this method uses
    ranked = False  # True: its trees carry a ranking whose prefixes are trees (budget "auto" cuts them)

    def __init__(self, settings: TreeSettings):
        self.settings = settings

    @classmethod
    def settings_read(cls, budget: int | str | None = None) -> tuple[str, ...]:
        """The TreeSettings fields this method reads: ``reads``, and ``max_budget`` for a ranked
        method (budget "auto" builds at most that many nodes; with ``budget`` given, only when it is
        "auto"). In declaration order."""
        names = set(cls.reads)
        if cls.ranked and budget in (None, "auto"):
            names.add("max_budget")
        return tuple(s.name for s in TreeSettings.declarations() if s.name in names)

    @property
    def cut_per_round(self) -> bool:
        """Whether budget "auto" applies: its trees are ranked and the budget is chosen per round, so a
        budget policy cuts each round's tree to the prefix worth verifying."""
        return self.ranked and self.settings.auto

    @property
    def depth_bonus(self) -> float:
        """The beta its trees are ranked with (score + beta * depth), 0 for a method that reads none:
        what a tree merged into one of its trees (the grammar's forced run) is ranked with too."""
        return self.settings.beta if "beta" in self.reads else 0.0

    def build(self, draft, head: CorrectionHead | None, budget: int) -> DraftTree:
        """The tree over draft ids (the draft's output vocabulary), of at most ``budget`` nodes."""
        raise NotImplementedError

    @staticmethod
    def build_many(builders: list["TreeBuilder"], drafts: list, head: CorrectionHead | None,
                   budgets: list[int]) -> list[DraftTree]:
        """The trees of several requests of one method (over draft ids, as ``build``): one at a time
        here; a method whose expansion batches across requests overrides it (``dartree``)."""
        return [b.build(d, head, n) for b, d, n in zip(builders, drafts, budgets)]

    def build_tree(self, draft, head: CorrectionHead | None, budget: int | None = None) -> DraftTree:
        """The tree over target ids, ready to verify. ``budget``: build at most this many nodes this
        round instead of ``settings.build_budget`` (budget "auto" builds no more than it may verify)."""
        return build_trees([self], [draft], head, [budget])[0]


def build_trees(builders: list[TreeBuilder], drafts: list, head: CorrectionHead | None,
                budgets: list[int | None]) -> list[DraftTree]:
    """Each request's tree over target ids, ready to verify (``budgets[i]``: build at most this many
    nodes instead of ``settings.build_budget``; budget "auto" builds no more than it may verify).
    Requests of one method and the same settings are built together (``TreeBuilder.build_many``)."""
    budgets = [b.settings.build_budget if n is None else n for b, n in zip(builders, budgets)]
    trees: list[DraftTree | None] = [None] * len(builders)
    groups: dict[tuple, list[int]] = {}
    for i, b in enumerate(builders):
        groups.setdefault((type(b), b.settings), []).append(i)
    for members in groups.values():
        kind = type(builders[members[0]])
        built = kind.build_many([builders[i] for i in members], [drafts[i] for i in members], head, [budgets[i] for i in members])
        for i, tree in zip(members, built):
            draft = drafts[i]
            if getattr(draft, "d2t", None) is not None and len(tree):
                tree = replace(tree, tokens=draft.to_target(tree.tokens))
            trees[i] = tree
    return trees
