"""The lean forward on block-quantised weights: the model's own GGUF file as stored, or Q8_0 at load.

Every product of the decoder and the output layer runs on ``dartree.quant`` (integer block sums of
int8-quantised activations with the weight's 4- or 8-bit quants, float block terms in one fixed
order per row): a row's bits do not depend on the row count or on what shares the forward, so this
target is row-invariant like the fp32 lean forward and every method reproduces its ``ar`` token for
token. Norms, RoPE, attention, the K/V store and the residual stream stay float32 (``lean.forward``).

``weights="file"`` reads a GGUF file's Q8_0 / Q4_0 / Q4_1 tensors as stored (Llama's q and k rows
put back into Hugging Face's order, checked against the model at load); ``weights="q8_0"`` quantises
a float32 Hugging Face model's weights to Q8_0 (GGUF's own format, bit for bit).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import quant
from ..errors import DartreeError
from .lean import LeanWeights, from_gguf

WEIGHTS = ("float32", "file", "q8_0")  # the target's weights: dequantised float32, the file as stored, Q8_0 at load
ROLES = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
         "down": ("ffn_down",)}


def _llama_rope_rows(rows: int, heads: int) -> torch.Tensor:
    """The Hugging Face row of each GGUF row of a Llama q or k weight: llama.cpp's converter
    interleaves each head's two rotary halves (``permute``); this gives its inverse as an index."""
    order = torch.arange(rows).reshape(heads, 2, rows // heads // 2).transpose(1, 2).reshape(rows)
    return torch.argsort(order)


def _tensor_index_reader(path: Path):
    """``gguf.GGUFReader`` over ``path`` with the metadata's arrays skipped instead of parsed.

    The library's reader makes numpy views of every element of every metadata array: for the bundled
    file's tokenizer (49k tokens, 48k merges) ~250k small objects and about 3 s of every load on an AMD EPYC
    Zen 3 (``scripts/load_memory.py`` times both readers), for values no target reads (the tokenizer comes
    from the model's own tokenizer files). This reader steps over an array by its length (a string array
    string by string) and parses everything else with the library's own code: the scalar and string
    fields (``general.architecture``, ``general.alignment``), the tensor index and the tensors' data
    views. A file in the other byte order is parsed by the library in full."""
    import struct

    import gguf
    from gguf.gguf_reader import ReaderField

    class TensorIndexReader(gguf.GGUFReader):
        def _build_fields(self, offs: int, count: int) -> int:
            if self.byte_order != "I":  # "=" below is the host's order, which "I" says the file has
                return super()._build_fields(offs, count)
            buf = memoryview(self.data)
            array, string = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING

            def skip_array(offs: int) -> int:  # offs: at the array's item type; returns the offset past it
                item_type, length = struct.unpack_from("=IQ", buf, offs)
                offs += 12
                if item_type == string:  # each string: a uint64 length, then its bytes
                    for _ in range(length):
                        offs += 8 + struct.unpack_from("=Q", buf, offs)[0]
                elif item_type == array:  # arrays of arrays, each with its own header
                    for _ in range(length):
                        offs = skip_array(offs)
                else:
                    offs += length * np.dtype(self.gguf_scalar_to_np[gguf.GGUFValueType(item_type)]).itemsize
                return offs

            for _ in range(count):
                start = offs
                (key_len,) = struct.unpack_from("=Q", buf, offs)
                offs += 8 + key_len
                (value_type,) = struct.unpack_from("=I", buf, offs)
                offs += 4
                if value_type == array:
                    offs = skip_array(offs)
                    continue
                key_parts = [self._get(start, np.uint64), self._get(start + 8, np.uint8, key_len),
                             self._get(offs - 4, np.uint32)]
                size, parts, idxs, types = self._get_field_parts(offs, value_type)
                self._push_field(ReaderField(start, bytes(key_parts[1]).decode(), key_parts + parts,
                                             [i + len(key_parts) for i in idxs], types), skip_sum=True)
                offs += size
            if offs > len(self.data):
                raise ValueError(f"the metadata runs past the end of the file ({offs} > {len(self.data)} bytes)")
            return offs

    return TensorIndexReader(str(path))


class GGUFTensors:
    """The raw blocks of a GGUF file's tensors, by name (the file's tensor index parsed once)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.reader = _tensor_index_reader(self.path)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a bad file
            raise DartreeError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc}); "
                               "check the file is complete (re-download or re-install its package)") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        arch = self.reader.fields.get("general.architecture")
        self.arch = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else "?"

    def parameter_count(self) -> int:
        """The values of every tensor of the file (what its float32 checkpoint holds, 4 bytes each)."""
        return sum(int(np.prod([int(d) for d in t.shape])) for t in self.tensors.values())

    def float_tensor(self, name: str) -> torch.Tensor:
        """A float32 (F32) tensor of the file, e.g. a norm's weight, as a torch tensor of its own."""
        t = self.tensors.get(name)
        if t is None or t.tensor_type.name != "F32":
            raise DartreeError(f"{self.path.name}: no float32 tensor {name!r}; is this the model's own GGUF file?")
        return torch.from_numpy(t.data.copy()).reshape(list(reversed([int(d) for d in t.shape])))

    def raw(self, name: str) -> tuple[str, torch.Tensor, int]:
        """(quantisation type, uint8 blocks [N, bytes per row], K) of tensor ``name``."""
        if name not in self.tensors:
            raise DartreeError(f"{self.path.name}: no tensor {name!r}; is this the model's own GGUF file?")
        t = self.tensors[name]
        qtype = t.tensor_type.name
        if qtype not in quant.TYPES:
            raise DartreeError(f"{self.path.name}: tensor {name} is {qtype}; products on the file as stored take "
                               f"{', '.join(quant.TYPES)}; load with weights='float32' (the dequantised model) or 'q8_0'")
        k = int(t.shape[0])
        values, size = quant.BLOCK_FORMAT[qtype]  # values and bytes per block
        return qtype, torch.from_numpy(t.data.copy()).reshape(-1, k // values * size), k


def file_target_reason(source: GGUFTensors) -> str | None:
    """Why the target on ``source`` as stored cannot be built (None where it can): its architecture (not one of
    ``FILE_ARCHITECTURES``) or a weight of a quantisation type the products do not take."""
    if source.arch not in FILE_ARCHITECTURES:
        return (f"its architecture is {source.arch!r} (the target on the file as stored is built for "
                f"{', '.join(FILE_ARCHITECTURES)} files)")
    other = sorted({t.tensor_type.name for t in source.tensors.values()
                    if t.tensor_type.name not in quant.TYPES and t.tensor_type.name != "F32"})
    if other:
        return f"it holds {', '.join(other)} weights (the products take {', '.join(quant.TYPES)})"
    return None


@dataclass(frozen=True)
class WeightInParts:
    """One product's weight stored in parts of different types (rows in order: q+k in Q4_K, then v in Q6_K): each
    part is a ``quant.QuantWeight`` on the file's blocks as stored, and the product is theirs side by side."""

    parts: list

    @property
    def shape(self) -> tuple[int, int]:
        return sum(w.shape[0] for w in self.parts), self.parts[0].shape[1]


def parts_of(weight) -> list:
    """A product's weight as its parts: a ``WeightInParts``' own, or the one ``quant.QuantWeight``."""
    return weight.parts if isinstance(weight, WeightInParts) else [weight]


class StoredEmbedding(nn.Module):
    """A token embedding looked up in the file's packed weight (``quant.QuantWeight``, any type of
    ``quant.TYPES``): a row dequantised when it is looked up (the values ``gguf`` dequantises the tensor to,
    so the float32 checkpoint's rows bit for bit, checked at load). A quarter of the float32 table's memory
    or less, only the rows a text uses ever expanded; where the output layer is tied to the embedding (the file has no
    ``output.weight``, as the bundled SmolLM2's) it is the output layer's own weight, held once."""

    def __init__(self, weight: quant.QuantWeight):
        super().__init__()
        self.weight = weight
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = quant.dequantize(self.weight, rows=ids.reshape(-1).to(device="cpu", dtype=torch.long))
        return rows.reshape(*ids.shape, self.embedding_dim)


# GGUF architectures (``general.architecture``) the target on the file as stored is built for: the lean forward's
# families, whose GGUF tensors llama.cpp's converter names alike (Llama's q/k rows permuted, Qwen3's as they are)
FILE_ARCHITECTURES = ("llama", "qwen3")
# Hugging Face's norms of a decoder layer -> the GGUF tensors holding them (Qwen3's per-head q/k norms too)
_LAYER_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_HEAD_NORMS = {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}


def model_from_gguf(config_dir: str | Path, source: GGUFTensors) -> nn.Module:
    """The Hugging Face module of a Llama or Qwen3 GGUF file for the target on the file as stored, without a float32
    copy of its weights: made from its config on the meta device (no memory, no initialisation), with only
    what the lean forward reads from the module made real: the norms (the file's F32 tensors) and the RoPE
    tables. The products and the embedding come from the file (``QuantizedWeights``); anything that would
    read the module's other weights (its own forward, training) fails on the meta tensors instead of
    computing with them: those need the float32 checkpoint (``weights="float32"``)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from ..taps import decoder_layers

    config = AutoConfig.from_pretrained(config_dir)
    if source.arch not in FILE_ARCHITECTURES or config.model_type != source.arch:
        raise DartreeError(f"a target straight from a GGUF file is built for {', '.join(FILE_ARCHITECTURES)} files; "
                           f"{source.path.name} is {source.arch!r} (its config says {config.model_type!r}): use "
                           "weights='float32'")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if (Path(config_dir) / "generation_config.json").is_file():  # its stop tokens, as from_pretrained reads them
        model.generation_config = GenerationConfig.from_pretrained(config_dir)
    with torch.no_grad():
        for i, block in enumerate(decoder_layers(model)):
            for attr, name in _LAYER_NORMS.items():
                norm = getattr(block, attr)
                norm.weight = nn.Parameter(source.float_tensor(f"blk.{i}.{name}.weight"), requires_grad=False)
            for attr, name in _HEAD_NORMS.items():
                norm = getattr(block.self_attn, attr, None)
                if norm is not None:
                    norm.weight = nn.Parameter(source.float_tensor(f"blk.{i}.{name}.weight"), requires_grad=False)
        model.model.norm.weight = nn.Parameter(source.float_tensor("output_norm.weight"), requires_grad=False)
        rotary = model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # its tables, on the CPU
        scaled = (getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}).get("rope_type", "default")
        if "rope_freqs.weight" in source.tensors and scaled == "default":
            # Llama 3.1+ files carry their RoPE scaling as per-frequency factors that divide the frequencies (what
            # llama.cpp applies; Hugging Face's llama3 rope type computes the same quotients), which the config
            # read from the file's fields does not hold
            factors = source.float_tensor("rope_freqs.weight").reshape(-1)
            if factors.shape != rotary.inv_freq.shape:
                raise DartreeError(f"{source.path.name}: rope_freqs holds {factors.numel()} factors for "
                                   f"{rotary.inv_freq.numel()} RoPE frequencies")
            rotary.inv_freq = rotary.inv_freq / factors
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_rows = int(source.tensors["blk.0.attn_q.weight"].shape[1])
    if q_rows != head_dim * config.num_attention_heads:
        raise DartreeError(f"{source.path.name}: layer 0's q projection has {q_rows} rows, not the config's "
                           f"{config.num_attention_heads} heads x head_dim {head_dim}; this file's config is not read "
                           "right here (load with weights='float32')")
    model.dartree_weights_in_gguf = True  # what ``lean.from_gguf`` reads
    model.dartree_gguf_file = Path(source.path).resolve()  # the file (the bench's Hugging Face peers load its float32 checkpoint)
    return model.eval()


def stored_embedding(source: GGUFTensors, model: nn.Module, output: quant.QuantWeight | None = None) -> StoredEmbedding | None:
    """The file's token embedding as a ``StoredEmbedding`` where its type is one ``quant`` takes (Q8_0 in the
    bundled file; Q4_K or Q6_K in most Q4_K_M files) and it gives the model's rows bit for bit (checked on rows
    spread over the table, the first and last included); else None (the model's own).
    ``output``: the output layer's packed weight, the embedding's own where the file ties the two."""
    t = source.tensors.get("token_embd.weight")
    if t is None or t.tensor_type.name not in quant.TYPES:
        return None
    if output is not None and "output.weight" not in source.tensors:  # tied: the same blocks, packed once
        embedding = StoredEmbedding(output)
    else:
        qtype, raw, k = source.raw("token_embd.weight")
        embedding = StoredEmbedding(quant.QuantWeight.from_blocks(qtype, raw, k))
    if from_gguf(model):  # the file is the model: no other table to agree with
        return embedding
    float_table = model.get_input_embeddings().weight
    if tuple(float_table.shape) != embedding.weight.shape or float_table.dtype != torch.float32:
        return None
    rows = embedding.num_embeddings
    probe = torch.unique(torch.cat([torch.linspace(0, rows - 1, 97).long(), torch.tensor([rows - 1])]))
    with torch.no_grad():
        return embedding if torch.equal(embedding(probe), float_table[probe]) else None


class QuantizedWeights(LeanWeights):
    """``LeanWeights`` whose products run on block-quantised weights (``quant.QuantWeight``)."""

    row_invariant = True
    integer_products = True

    def __init__(self, model: nn.Module, weights: str = "file", gguf: str | Path | GGUFTensors | None = None):
        if weights not in ("file", "q8_0"):
            raise DartreeError(f"quantised weights are 'file' or 'q8_0', got {weights!r}")
        if weights == "file" and gguf is None:
            raise DartreeError("weights='file' needs the model's GGUF file; this target was not loaded from one "
                               "(use weights='q8_0' to quantise it at load, or 'float32')")
        if next(model.parameters()).dtype != torch.float32:
            raise DartreeError(f"quantised weights run a float32 model (their activations and residuals are float32); "
                               f"this one is {next(model.parameters()).dtype}: load it with dtype=torch.float32")
        if not quant.available():
            raise DartreeError("the quantised products could not be built on this machine (see the message above); "
                               "use weights='float32'")
        if weights != "file" and from_gguf(model):
            raise DartreeError(f"weights={weights!r} needs the model's float32 weights; this target was built straight "
                               "from its GGUF file (load with weights='float32')")
        self.source = (gguf if isinstance(gguf, GGUFTensors) else GGUFTensors(gguf)) if weights == "file" else None
        self._qext = quant.load()
        super().__init__(model, products="exact")
        # the embedding as stored where it can be (the float32 table is then never read: its pages stay on disk)
        stored = stored_embedding(self.source, model, self.output) if self.source is not None else None
        if stored is not None:
            self.embedding = stored
        elif from_gguf(model):
            t = self.source.tensors.get("token_embd.weight")
            raise DartreeError(f"{self.source.path.name}: the token embedding is "
                               f"{t.tensor_type.name if t is not None else 'missing'}; a target straight from the file "
                               f"takes it as {', '.join(quant.TYPES)} (load with weights='float32')")
        # the file's mapping is dropped once every weight is packed: what stays resident is the packed weights
        self.source = None
        self.products = weights  # "file" or "q8_0": ``product`` below, not the float kernels

    @property
    def products_name(self) -> str:
        return "q8_0" if self.products == "q8_0" else "+".join(sorted({w.qtype.lower() for w in self._all()}))

    def _all(self):
        for layer in self.layers:
            for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
                yield from parts_of(w)
        yield self.output

    def prepare(self, role: str, layer: int | None, float_weight) -> quant.QuantWeight:
        """The packed weight of ``role`` in ``layer`` (the output layer: role "output")."""
        if self.source is None:  # weights="q8_0"
            return quant.quantize_q8_0(float_weight())
        if role == "output":
            name = "output.weight" if "output.weight" in self.source.tensors else "token_embd.weight"
            qtype, raw, k = self.source.raw(name)
            return quant.QuantWeight.from_blocks(qtype, raw, k)
        parts = []
        for tensor in ROLES[role]:
            qtype, raw, k = self.source.raw(f"blk.{layer}.{tensor}.weight")
            if self.source.arch == "llama" and tensor in ("attn_q", "attn_k"):
                raw = raw[_llama_rope_rows(raw.shape[0], self.heads if tensor == "attn_q" else self.kv_heads)]
            parts.append((qtype, raw))
        # consecutive tensors of one type packed as one weight; a file that mixes types (llama.cpp's Q4_K_M: Q6_K v
        # rows beside Q4_K q and k) gives the product in parts, each on its own blocks as stored
        packed = [quant.QuantWeight.from_blocks(qtype, torch.cat([raw for _, raw in run]), k)
                  for qtype, run in itertools.groupby(parts, key=lambda part: part[0])]
        weight = packed[0] if len(packed) == 1 else WeightInParts(packed)
        if layer == 0 and role == "qkv" and not from_gguf(self.model):  # the file is this model's: its values are the checkpoint's
            got, want = torch.cat([quant.dequantize(w) for w in packed]), float_weight()
            if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
                raise DartreeError(f"{self.source.path.name} does not hold this model's weights (layer 0's q, k, v "
                                   "differ from the checkpoint's); pass the GGUF file the checkpoint came from")
        return weight

    def product(self, x: torch.Tensor, weight, n: int, residual: torch.Tensor | None = None) -> torch.Tensor:
        # ``quant.qproduct`` without its wrapper: four products a layer, and the kernels hand on contiguous rows
        # (the compiled product checks that they are)
        if not isinstance(weight, WeightInParts):
            return self._qext.qproduct(x, weight.packed, weight.shape[0], residual)
        if residual is not None:  # each part's outputs side by side, as the compiled loop does
            raise DartreeError("a product in parts takes no residual")
        return torch.cat([self._qext.qproduct(x, w.packed, w.shape[0], None) for w in weight.parts], dim=1)

    def weight_parts(self, weight, n: int) -> list[tuple[torch.Tensor, int]]:
        return [(w.packed, w.shape[0]) for w in parts_of(weight)]
