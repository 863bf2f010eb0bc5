"""Products for inference on a CPU: fp32 ``nn.Linear`` on oneDNN-packed weights (``CpuLinear``),
and weight-first products over a few rows where oneDNN is not there.

Loading (``loading.load_target``, ``pipeline.load``) turns a target's and a drafter's Linears into
``CpuLinear``. The correction heads' own products, over a few cache-resident rows, are left as they
are: packing does not make them faster. The measurements behind these choices are in
docs/experiments.md ("Notes that used to live in the code") and docs/results/fast-on-this-machine.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels

FEW_ROWS = 6  # at most this many rows: the weight-first product (without oneDNN)
LEAN_MAX_ROWS = 64  # up to this many rows the lean kernels' product leads oneDNN's (docs/results/lean-forward/products-2threads.json)
PADDED_ROWS = {1: 2, 3: 4}  # row counts whose weight-first product runs faster padded to more columns
ONEDNN_ROWS_HINT = 4  # the row count oneDNN lays packed weights out for (any count works)
PACKED_SHARE_OF_MEMORY = 0.25  # pack weights only while the packed copy takes at most this share of RAM


@functools.lru_cache(maxsize=1)
def onednn_packing_available() -> bool:
    """Whether this torch build runs fp32 products on oneDNN-packed weights, checked by doing one
    (the ops are torch internals that inductor uses; a build or platform without them, or where
    they fail, keeps the weight-first products)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    gen = torch.Generator().manual_seed(0)
    weight, x, bias = torch.randn(5, 8, generator=gen), torch.randn(3, 8, generator=gen), torch.randn(5, generator=gen)
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_ROWS_HINT)
            out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5))


class CpuLinear(nn.Linear):
    """``nn.Linear`` for inference on a CPU in fp32/fp64: the products that speculation needs fast.

    torch hands fp32 products to MKL, which on AMD CPUs runs them far below what the memory allows;
    oneDNN on weights packed once for it runs SmolLM2-135M's layers 1.8x (one row) to 2.4x (17 rows)
    faster on one thread, and scales with a second thread where MKL does not. So fp32 products run
    on packed weights (a second copy of the weights, made on the first product and made again when
    they change in place or are replaced);
    the dense ``weight`` stays the parameter (state dict, tied embedding, training). While autograd
    records, or in other dtypes, the product is ``F.linear``.

    Without oneDNN (or in fp64, which it lacks) products over up to ``FEW_ROWS`` rows run
    weight-first, ``W @ x.T``: MKL computes ``F.linear`` over 2-5 rows as one pass over the weights
    per row, ``W @ x.T`` reads them once (a whole forward over 2 rows about a quarter faster). One
    row runs as two and three as four, rows repeated and dropped after: MKL's one- and three-column
    products are slower than its two- and four-column ones. All paths give ``F.linear``'s values up
    to the order of the sums."""

    pack_weights = False  # set per module by ``cpu_products``
    lean_products = False  # set per module by ``cpu_products``: the lean kernels' product up to LEAN_MAX_ROWS rows
    _packed: tuple[tuple, torch.Tensor] | None = None  # (which weight, in which version; its packed copy)
    _lean_packed: tuple[tuple, torch.Tensor] | None = None  # the same for the lean kernels' packing

    def _packed_weight(self) -> torch.Tensor:
        """The oneDNN-packed copy of the weight, packed again when the weight changes in place or
        is replaced."""
        weight = self.weight
        key = (id(weight), weight.data_ptr(), weight._version)
        if self._packed is None or self._packed[0] != key:
            with torch.no_grad():
                self._packed = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS_HINT))
        return self._packed[1]

    def _lean_weight(self) -> torch.Tensor:
        """The weight packed for the lean kernels' product (``kernels.py``), packed again when it changes."""
        weight = self.weight
        key = (id(weight), weight.data_ptr(), weight._version)
        if self._lean_packed is None or self._lean_packed[0] != key:
            with torch.no_grad():
                self._lean_packed = (key, kernels.load().pack_weight(weight.detach()))
        return self._lean_packed[1]

    def __getstate__(self):
        state = super().__getstate__().copy()
        state.pop("_packed", None)  # an opaque oneDNN tensor cannot be pickled; it is made again on use
        state.pop("_lean_packed", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        recording = torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)
        if recording or x.device.type != "cpu" or x.dtype != weight.dtype:
            return F.linear(x, weight, self.bias)
        rows = x.numel() // x.shape[-1]
        if self.lean_products and 0 < rows <= LEAN_MAX_ROWS and x.dtype in (torch.float32, torch.float64):
            out = kernels.load().product(x.reshape(rows, x.shape[-1]).contiguous(), self._lean_weight(), self.out_features, None)
            if self.bias is not None:
                out = out + self.bias
            return out.reshape(*x.shape[:-1], self.out_features)
        if self.pack_weights and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), self.bias, "none", [], "")
        if rows > FEW_ROWS or rows == 0 or x.dtype not in (torch.float32, torch.float64):
            return F.linear(x, weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        if rows in PADDED_ROWS:
            flat = torch.cat([flat, flat[: PADDED_ROWS[rows] - rows]])
        out = torch.mm(weight, flat.t()).t()[:rows].contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_products(model: torch.nn.Module, pack: bool | None = None, lean: bool = False) -> None:
    """Make every plain ``nn.Linear`` of a float32/float64 CPU ``model`` a ``CpuLinear`` (same
    weights, same module tree, same state dict); other models (bf16, whose products torch already
    runs in oneDNN; GPU) are left as they are. ``pack``: run fp32 products on oneDNN-packed weights;
    by default when oneDNN is there and the packed copy fits in ``PACKED_SHARE_OF_MEMORY`` of this
    machine's memory. ``lean``: products over up to ``LEAN_MAX_ROWS`` rows run on the lean kernels
    (where they are built), which read the weights near the memory's speed where oneDNN does not:
    the drafter's products over a draft block's rows (a call of the default drafter, 18 rows, about
    a fifth faster; over 64 rows, 8 requests in one call, the same)."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu" or first.dtype not in (torch.float32, torch.float64):
        return
    linears = [m for m in model.modules() if type(m) is nn.Linear or type(m) is CpuLinear]
    if pack is None:
        packed_bytes = sum(m.weight.numel() * 4 for m in linears)
        memory = _physical_memory()  # 0 where it cannot be read: pack (most machines have the room)
        pack = onednn_packing_available() and (memory == 0 or packed_bytes <= PACKED_SHARE_OF_MEMORY * memory)
    lean = lean and kernels.available()
    for module in linears:
        module.__class__ = CpuLinear
        module.pack_weights = bool(pack) and onednn_packing_available()
        module.lean_products = bool(lean)
