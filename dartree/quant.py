"""Products on block-quantised weights as GGUF stores them (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K):
``csrc/quant_kernels.cpp``.

A row of activations is quantised per block of 32 to int8 (llama.cpp's Q8_0 way: d = max|x| / 127,
q = round-to-nearest-even(x * (1 / d)), with the block sum d * sum(q) kept for the minimum term of Q4_1
Q5_1, Q4_K and Q5_K), each block's integer dot product with the weight's quants is exact in int32, and the float
block terms ``d_w * d_x * isum (+ m_w * d_x * sum(q_x))`` are summed over k-blocks 0..K/32-1 in that
order with one fma each (Q6_K, a scale per 16: two terms a block). So a row's output has the same bits
whatever the row count and the other rows of the call, and on every instruction-set path (AVX-512 VNNI,
AVX2, scalar): what the lean forward's float products promise (``kernels.py``), at a quarter to an
eighth of the weight bytes. It is not the fp32 product of the dequantised weight: the activations'
int8 rounding moves each output by at most |W| . (d_x / 2), well under 1 % on SmolLM2's layers.

    qw = read_gguf_tensor(path, "blk.0.ffn_down.weight")     # QuantWeight("Q4_1", (576, 1536), packed)
    y = qw.product(x)                                          # x float32 [M, 1536] -> [M, 576]
    qw8 = quantize_q8_0(weight)                                # a float weight [N, K] as GGUF Q8_0
    w = dequantize(qw)                                         # GGUF's own float values, [N, K] float32

Built for this CPU (``-march=native``) into the cache folder on first use, like ``kernels.py``.
Mind that a GGUF file stores Llama's q and k projections with their rows permuted for llama.cpp's
RoPE (Hugging Face's loader undoes it): a product on ``attn_q``/``attn_k`` as stored gives outputs in
that order.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .kernels import build_extension, extension_dir

SOURCE = Path(__file__).parent / "csrc" / "quant_kernels.cpp"
BLOCK = 32
# GGML type ids (gguf.GGMLQuantizationType) and (values, bytes) per block as GGUF stores them
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
BLOCK_FORMAT = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q4_K": (256, 144),
                "Q5_K": (256, 176), "Q6_K": (256, 210)}
# builds of the other instruction-set paths, for the tests: AVX2 (maddubs) and the scalar code
VARIANTS = {"avx2": ("-mno-avx512f", "-mno-avx512vnni"), "scalar": ("-DDARTREE_SCALAR",)}


def build_dir(extra_cflags: tuple[str, ...] = ()) -> Path:
    return extension_dir(SOURCE, "quant_kernels", extra_cflags)


@functools.lru_cache(maxsize=None)
def load(verbose: bool = False, extra_cflags: tuple[str, ...] = ()):
    """The compiled module (built first when this machine has none yet): ``pack``, ``qproduct``,
    ``dequantize``, ``quantize_rows``, ``path``. ``extra_cflags`` builds a variant beside it (``VARIANTS``:
    the AVX2 path on an AVX-512 CPU, the scalar code), for checking that every path gives the same bits."""
    return build_extension(SOURCE, "quant_kernels", "dartree_quant_kernels", "the quantised products", extra_cflags,
                           verbose)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the module is built (or can be built) here."""
    try:
        load()
    except Exception as exc:  # no compiler, no ninja, a failed build
        print(f"dartree: the quantised products are unavailable here ({type(exc).__name__})", file=sys.stderr)
        return False
    return True


@dataclass(frozen=True)
class QuantWeight:
    """A weight [N, K] (K a multiple of 32; of 256 for the K-quants) in GGUF's blocks, packed for ``qproduct``.

    ``qtype`` is one of ``TYPES``; ``packed`` is uint8 [ceil(N / 16), K / 32,
    record bytes] (the same layout on every instruction-set path, described in csrc/quant_kernels.cpp:
    Q8_0, Q4_0 and Q4_1 keep GGUF's fp16 scales, 8.5, 4.5 and 5 bits a weight as in the file; Q5_0 in Q8_0's
    records, its 5-bit values as bytes beside its fp16 scale; Q5_1 as bytes with its fp16 scale and minimum, 9 bits a
    weight; the K-quants keep each row's fp16 d (and dmin) beside a byte for each 32's (each 16's for Q6_K) scale (and
    minimum), multiplied in the kernels (exact): Q4_K as nibbles, 5.5 bits a weight, Q5_K and Q6_K as bytes, 9.5 and
    9.25)."""

    qtype: str
    shape: tuple[int, int]
    packed: torch.Tensor

    @classmethod
    def from_blocks(cls, qtype: str, raw: torch.Tensor, k: int, ext=None) -> "QuantWeight":
        """From GGUF's raw blocks, uint8 [N, K / block values * block bytes] (a tensor's ``data`` as stored)."""
        if qtype not in TYPES:
            raise ValueError(f"quantised products take {', '.join(TYPES)}, not {qtype}")
        raw = torch.as_tensor(raw, dtype=torch.uint8).contiguous()
        packed = (ext or load()).pack(raw, TYPES[qtype], k)
        return cls(qtype, (raw.shape[0], k), packed)

    def product(self, x: torch.Tensor, residual: torch.Tensor | None = None, ext=None) -> torch.Tensor:
        """``qproduct(x, self, residual)``."""
        return qproduct(x, self, residual, ext)


def qproduct(x: torch.Tensor, weight: QuantWeight, residual: torch.Tensor | None = None, ext=None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T (+ residual [M, N], added after the whole sum), float32 in and out.

    Exactness promise: each row's output is bitwise what the row gives alone (any row count, any
    other rows) and what every instruction-set build gives; it equals the float64 product of the
    dequantised weight and the row's int8-quantised values up to the float32 rounding of the block
    terms' sum (~1e-6 relative to the sum of their magnitudes). A row holding a NaN or an infinity
    gives NaN (in every output its non-finite blocks reach); the other rows are unaffected."""
    return (ext or load()).qproduct(x.contiguous(), weight.packed, weight.shape[0], residual)


def dequantize(weight: QuantWeight, ext=None, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The weight's float32 values [N, K], bitwise what ``gguf.quants.dequantize`` gives; with ``rows``
    (ids [R]) only those rows, [R, K] (a token embedding's lookup)."""
    return (ext or load()).dequantize(weight.packed, weight.shape[0], rows)


def quantize_rows(x: torch.Tensor, ext=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activation quantisation ``qproduct`` applies: x float32 [M, K] -> (q int8 [M, K], d float32
    [M, K / 32], sum of q int32 [M, K / 32]); row r's values are q * d per block."""
    q, d, s = (ext or load()).quantize_rows(x.contiguous())
    return q, d, s


def quantize_q8_0(weight: torch.Tensor, ext=None) -> QuantWeight:
    """A float weight [N, K] (K a multiple of 32) as GGUF Q8_0, bit for bit what ``gguf.quants.quantize``
    (and llama.cpp's reference) writes: per block d = max|w| / 127 stored as fp16, q = round-half-away(w / d)
    computed as w * (1 / d) in float32."""
    w = weight.detach().to(torch.float32).contiguous()
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs K a multiple of {BLOCK}, not {k}")
    blocks = w.reshape(-1, BLOCK)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    a = (blocks * inv).abs()  # round half away from zero, exactly as gguf's np_roundf does it
    floored = a.floor()
    q = (torch.sign(blocks * inv) * (floored + (2 * (a - floored)).floor())).to(torch.int8)
    raw = torch.cat([d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=1)
    return QuantWeight.from_blocks("Q8_0", raw.reshape(n, -1), k, ext)


def read_gguf_tensor(path, name: str, ext=None) -> QuantWeight:
    """One tensor of a GGUF file (of a type in ``TYPES``), by name, packed (needs the ``gguf`` package). ``path``
    may also be an open ``gguf.GGUFReader`` (opening one parses the whole header: seconds for a model)."""
    import gguf

    reader = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(str(path))
    for tensor in reader.tensors:
        if tensor.name == name:
            qtype = tensor.tensor_type.name
            if qtype not in TYPES:
                raise ValueError(f"{name} is {qtype}; quantised products take {', '.join(TYPES)}")
            return QuantWeight.from_blocks(qtype, torch.from_numpy(tensor.data.copy()), int(tensor.shape[0]), ext)
    raise KeyError(f"no tensor {name} in {path}")
