"""Targets: the model that verifies the drafts, behind one contract (``base.Target``).

``make_target`` is the one place that picks an implementation for a model on this machine.
Adding a target (a GPU forward, a quantised forward) is one file here implementing ``base.Target``
plus its branch in ``make_target``.
"""

from __future__ import annotations

from ..errors import DartreeError
from .base import Part, Target, check_context_length, forward_tree, prefill
from .hf import HFTarget
from .known import KnownTarget
from .lean import LeanTarget, unsupported_reason

__all__ = ["Part", "Target", "HFTarget", "LeanTarget", "KnownTarget", "make_target", "prefill", "forward_tree",
           "check_context_length"]


def make_target(model, tapped_layers=(), lean: bool | str = "auto", lean_products: str = "exact") -> Target:
    """The lean forward for the families it implements (``lean="auto"``, the default), else the
    Hugging Face forward; ``lean=True`` insists (a clear error where it cannot run), ``False`` refuses.
    ``lean_products``: how the lean forward multiplies (``lean.PRODUCTS``; anything but "exact" insists
    on the lean forward)."""
    if lean not in ("auto", True, False):
        raise DartreeError(f"lean must be 'auto', True or False, got {lean!r}")
    reason = unsupported_reason(model) if lean is not False else "lean=False"
    if reason is None:
        return LeanTarget(model, tapped_layers, products=lean_products)
    if lean is True or lean_products != "exact":
        asked = "lean=True" if lean is True else f"lean_products={lean_products!r}"
        raise DartreeError(f"{asked}, but the lean forward cannot run this target: {reason}")
    return HFTarget(model, tapped_layers)
