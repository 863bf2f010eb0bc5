"""Draft-tree builders: one small class per method behind one interface.

A builder turns one round's draft (drafter states and base logits, plus a correction head for the
corrected methods) into a ``DraftTree``. Node i of a tree has row i+1 in the verification batch;
row 0 is the root (the bonus token). Parents always come before their children.
"""

from __future__ import annotations

from ..errors import DartreeError
from .base import BUILDERS, TreeBuilder, TreeSettings, build_trees, parse_budget, register
from .tree import DraftTree, subtree

# The methods in the order they register (the order of METHODS, the CLI, the bench and the report).
from . import ar, dflash, domino, ddtree, domino_ddtree, heap, dartree, ngram  # noqa: E402,F401  isort: skip
from .dartree import DARTreeBuilder, Supertree, grow_supertree, grow_supertrees  # noqa: E402

METHODS: tuple[str, ...] = tuple(BUILDERS)
HEAD_METHODS: tuple[str, ...] = tuple(name for name, b in BUILDERS.items() if b.needs_head)


def available_methods(has_drafter: bool, has_head: bool) -> tuple[str, ...]:
    """The methods a pipeline can run: plain decoding always, drafter methods with a drafter, the
    corrected ones only with a head."""
    return tuple(name for name, b in BUILDERS.items()
                 if (has_drafter or b.proposer != "drafter") and (has_head or not b.needs_head))


def builder_class(method: str, others: tuple[str, ...] = ()) -> type[TreeBuilder] | None:
    """The registered builder of ``method``; None for one of ``others`` (e.g. the bench's peers);
    any other name is an error that lists the choices."""
    if method in BUILDERS:
        return BUILDERS[method]
    if method in others:
        return None
    raise DartreeError(f"unknown method {method!r}; choose one of: {', '.join(METHODS + tuple(others))}")


def make_builder(method: str, settings: TreeSettings | None = None) -> TreeBuilder:
    builder_class(method)
    settings = settings or TreeSettings()
    settings.validate()
    return BUILDERS[method](settings)


__all__ = ["BUILDERS", "DARTreeBuilder", "DraftTree", "HEAD_METHODS", "METHODS", "Supertree", "TreeBuilder", "TreeSettings",
           "available_methods", "build_trees", "builder_class", "grow_supertree", "grow_supertrees", "make_builder", "parse_budget", "register", "subtree"]
