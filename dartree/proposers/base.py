"""The proposer contract: what speculates for a request, and what the round tells it back.

A proposer serves ONE request (its own state: a drafter cache, a suffix index, ...). Per round:

- ``propose_batch(proposers, bonuses, positions) -> [proposal, ...]`` (a classmethod): ONE call
  for every request of the round whose proposers share a ``batch_key``. ``bonuses[i]`` is request
  i's next token (chosen by the target, not yet in its cache) at position ``positions[i]`` (the
  request's committed length). A proposal is either
  - a **draft** the tree methods read (today ``drafter.DraftOutput``: per-depth states and base
    logits, corrected by ``head``), or
  - a finished ``trees.DraftTree`` of target token ids under the bonus token, ranked (``rank``)
    by ``log_probs``, each node's log-probability of being accepted along its path: the unit the
    global top-B and the budget rank every tree in.
- ``observe(tokens, tapped_states)``: the rows the target committed for this request since the
  last call, in order (prompt chunks, then each round's accepted path starting with its bonus
  token): their token ids [n] and, where ``reads_tapped_states``, the target's tapped states [n, m*H].
- ``reset()``: the proposer starts a new request.
- ``learn(tree, accepted)`` (optional): after a round with its proposal, the tree the target verified
  (its proposal as the method and the budget cut it, target ids) and the rows of the accepted path
  (0 the root): what a proposer that estimates its own acceptance learns from (``ngram``).
- ``free_proposals(proposers, bonuses, positions) -> [DraftTree, ...]`` (optional classmethod): what
  it offers, at next to no cost (no model call), in a round whose budget does not pay for
  ``propose_batch`` (budget auto backed off, or the batch's plan left it out): finished ranked trees
  as above. The drafter with the n-gram proposer offers its n-gram tree, so a round without a drafter
  call still verifies the text's repeats where they pay. A proposal that holds such a tree besides
  its draft names it ``free_part``: budget auto then weighs a drafted round against it, not against
  a plain step.
- ``finish(prompt, output)`` (optional): the request ended, with these prompt and output token ids
  (what the n-gram proposer hands to the server-wide suffix cache).

Attributes: ``name`` (as registered), ``reads_tapped_states`` (the target collects tapped states
for rounds with such a request), ``head`` (the correction head the tree methods that need one
apply to its drafts, or None), ``batch_key`` (proposers with equal keys are proposed for together),
``num_depths`` (how deep its proposals go), and optionally ``depth_limit`` (settable: the depths its
next proposal need reach, None for all; the round sets it from the request's budget policy, and a
drafter then runs a shorter block). ``create(pipeline)`` (classmethod) makes one for a
request of a ``Pipeline``, or raises ``DartreeError`` saying what it needs.

Adding a proposer is one file in ``dartree/proposers/`` with one class decorated ``@register``,
imported in ``proposers/__init__.py``; a tree method names it in its ``proposer`` attribute.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from ..errors import DartreeError

PROPOSERS: dict[str, type] = {}


@runtime_checkable
class Proposer(Protocol):
    name: ClassVar[str]
    reads_tapped_states: bool
    head: Any
    num_depths: int

    @property
    def batch_key(self) -> object: ...

    @classmethod
    def propose_batch(cls, proposers: list, bonuses: list[int], positions: list[int]) -> list: ...

    def observe(self, tokens: torch.Tensor, tapped_states: torch.Tensor | None) -> None: ...

    def reset(self) -> None: ...


def register(cls: type) -> type:
    """Register a proposer class under its ``name``."""
    if not getattr(cls, "name", None):
        raise DartreeError(f"proposer class {cls.__name__} has no name")
    if cls.name in PROPOSERS and PROPOSERS[cls.name] is not cls:
        raise DartreeError(f"a proposer named {cls.name!r} is already registered ({PROPOSERS[cls.name].__name__})")
    PROPOSERS[cls.name] = cls
    return cls


def make_proposer(name: str, pipeline) -> Proposer:
    """A new proposer ``name`` for one request of ``pipeline``."""
    if name not in PROPOSERS:
        raise DartreeError(f"unknown proposer {name!r}; registered: {', '.join(sorted(PROPOSERS))}")
    return PROPOSERS[name].create(pipeline)
