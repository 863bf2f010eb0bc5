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
from .quantized import WEIGHTS, QuantizedWeights

__all__ = ["Part", "Target", "HFTarget", "LeanTarget", "KnownTarget", "make_target", "prefill", "forward_tree",
           "check_context_length"]


def make_target(model, tapped_layers=(), lean: bool | str = "auto", lean_products: str = "exact",
                weights: str = "float32", gguf=None) -> Target:
    """The lean forward for the families it implements (``lean="auto"``, the default), else the
    Hugging Face forward; ``lean=True`` insists (a clear error where it cannot run), ``False`` refuses.
    ``lean_products``: how the lean forward multiplies float weights (``lean.PRODUCTS``; anything but
    "exact" insists on the lean forward). ``weights`` (``quantized.WEIGHTS``): "float32" the model's
    float weights; "file" the GGUF file ``gguf`` as stored, "q8_0" quantised at load, each on the lean
    forward's integer products (``targets/quantized.py``; both insist on the lean forward)."""
    if lean not in ("auto", True, False):
        raise DartreeError(f"lean must be 'auto', True or False, got {lean!r}")
    if weights not in WEIGHTS:
        raise DartreeError(f"weights must be one of {', '.join(WEIGHTS)} (or 'auto' in dartree.load), got {weights!r}")
    reason = unsupported_reason(model) if lean is not False else "lean=False"
    if reason is None and weights != "float32":
        return LeanTarget(model, tapped_layers, weights=QuantizedWeights(model, weights, gguf))
    if reason is None:
        return LeanTarget(model, tapped_layers, products=lean_products)
    if lean is True or lean_products != "exact" or weights != "float32":
        asked = "lean=True" if lean is True else f"lean_products={lean_products!r}" if lean_products != "exact" \
            else f"weights={weights!r}"
        raise DartreeError(f"{asked}, but the lean forward cannot run this target: {reason}")
    return HFTarget(model, tapped_layers)
