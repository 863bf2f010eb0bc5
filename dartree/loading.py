"""Loading: checkpoints (targets and drafters), dtypes and devices, the target/drafter pair check.
Inference, training and the benchmark all load through here. (The target's attention is in
``attention.py``, its layout and layer taps in ``taps.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .drafter import CONFIG_NAME, RELEASED, WEIGHTS_NAME, DrafterConfig, DrafterModel
from .errors import CheckpointError, DartreeError, require
from .hardware import default_dtype
from .attention import register_attention
from .products import cpu_products

# ---------------------------------------------------------------- dtypes and devices


def parse_dtype(dtype, device=None) -> torch.dtype:
    """A torch dtype from a name; "auto" is ``hardware.default_dtype`` of the device."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return default_dtype(device if device is not None else "cpu")
    names = {"float32": torch.float32, "fp32": torch.float32, "float64": torch.float64, "fp64": torch.float64,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise DartreeError(f"unknown dtype {dtype!r}; use auto or one of {', '.join(names)}")
    return names[dtype]


def resolve_device(device) -> torch.device:
    """A torch device from a name; ``"auto"`` picks the first GPU when there is one, else the CPU.

    A GPU that this machine does not have is a clear error here rather than a CUDA assertion deep
    inside the first forward.
    """
    if isinstance(device, torch.device):
        device_obj = device
    else:
        if device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device_obj = torch.device(device)
        except (RuntimeError, TypeError):
            raise DartreeError(f"unknown device {device!r}; use cpu, cuda, cuda:N or auto") from None
    if device_obj.type == "cuda":
        if not torch.cuda.is_available():
            raise DartreeError(f"device {str(device_obj)!r} asked for, but this machine has no usable CUDA GPU "
                               f"(torch {torch.__version__}); use --device cpu")
        if device_obj.index is not None and device_obj.index >= torch.cuda.device_count():
            raise DartreeError(f"device {str(device_obj)!r} asked for, but this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device_obj.type == "mps":
        if not torch.backends.mps.is_available():
            raise DartreeError("device 'mps' asked for, but this machine has no usable Apple GPU; use --device cpu")
    elif device_obj.type != "cpu":
        raise DartreeError(f"device {str(device_obj)!r} is not supported; use cpu, cuda, cuda:N, mps or auto")
    return device_obj



# ---------------------------------------------------------------- the target

def load_target(directory: str | Path, dtype: torch.dtype, device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    require(directory.is_dir(), f"target directory {str(directory)!r} does not exist", CheckpointError)
    require((directory / "config.json").is_file(), f"target directory {str(directory)!r} has no config.json", CheckpointError)
    try:
        json.loads((directory / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{directory / 'config.json'} is not valid JSON ({exc})") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation=register_attention())
    except OSError as exc:  # missing weight files
        raise CheckpointError(f"cannot load the target from {directory}: {exc}") from None
    except Exception as exc:  # safetensors header errors and the like
        if "safetensor" in type(exc).__name__.lower() or "header" in str(exc).lower():
            raise CheckpointError(f"target weights in {directory} are corrupt or truncated: {exc}") from None
        raise
    model = model.to(device).eval()
    cpu_products(model)  # fp32/fp64 CPU targets only
    return model


def load_tokenizer(directory: str | Path):
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(directory)


# ---------------------------------------------------------------- drafters


def _read_config(directory: Path) -> DrafterConfig:
    path = directory / CONFIG_NAME
    require(directory.is_dir(), f"drafter directory {str(directory)!r} does not exist", CheckpointError)
    require(path.is_file(), f"drafter directory {str(directory)!r} has no {CONFIG_NAME}", CheckpointError)
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); expected a DFlash-format drafter config") from None
    require(isinstance(raw, dict), f"{path} must hold a JSON object", CheckpointError)
    return DrafterConfig.from_dict(raw)


# On disk the correction heads' tensors sit at top level under these names.
HEAD_TENSOR_PREFIXES = ("prefix_gru", "embed_proj", "markov_w1", "markov_w2")
# A config.json field of dartree's own: the path (relative to the drafter folder) of a weights file
# whose backbone tensors this drafter shares, so that drafters with one backbone and different heads
# (the shipped Domino and Markov ones) keep it once; the folder's own files hold the rest.
SHARED_BACKBONE_FIELD = "backbone_weights"


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"cannot read drafter weights {path}: the file is corrupt or truncated ({exc})") from None


def _read_weights(directory: Path, cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    require(bool(files), f"drafter directory {str(directory)!r} has no .safetensors weights", CheckpointError)
    state: dict[str, torch.Tensor] = {}
    shared = cfg.extra.get("top", {}).get(SHARED_BACKBONE_FIELD)
    if shared is not None:
        path = directory / str(shared)
        require(path.is_file(), f"{directory / CONFIG_NAME} names {SHARED_BACKBONE_FIELD} {shared!r}, which is not a file "
                f"(a path relative to {directory})", CheckpointError)
        state.update({k: v for k, v in _load_safetensors(path).items() if k.split(".")[0] not in HEAD_TENSOR_PREFIXES})
    for f in files:
        state.update(_load_safetensors(f))
    return state


def _to_module_names(state: dict[str, torch.Tensor], has_head: bool) -> dict[str, torch.Tensor]:
    """On disk the head's tensors sit at top level (prefix_gru.*, markov_w1.*); in memory under head.*."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("model."):  # some exporters nest the backbone
            name = name[len("model.") :]
        if has_head and name.split(".")[0] in HEAD_TENSOR_PREFIXES:
            name = "head." + name
        out[name] = tensor
    return out


def load_drafter(directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DrafterModel:
    directory = Path(directory)
    cfg = _read_config(directory)
    state = _to_module_names(_read_weights(directory, cfg), cfg.projector_type is not None)
    model = DrafterModel(cfg)
    if "mask_embedding" in state:
        model.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size))
    # DSpark ships copies of the target's embedding and lm_head; we use the target's. A reduced
    # draft vocabulary brings its own lm_head (and d2t), which is kept.
    ignored = {"embed_tokens.weight"} | (set() if cfg.draft_vocab_size else {"lm_head.weight"})
    state = {k: v for k, v in state.items() if k not in ignored}
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    require(not missing, f"drafter weights in {directory} lack {missing[:6]}{' ...' if len(missing) > 6 else ''}", CheckpointError)
    require(not unexpected, f"drafter weights in {directory} have unknown tensors {unexpected[:6]}", CheckpointError)
    for name, tensor in state.items():
        require(
            tuple(tensor.shape) == tuple(expected[name].shape),
            f"drafter tensor {name} has shape {tuple(tensor.shape)} but config.json implies {tuple(expected[name].shape)}",
            CheckpointError,
        )
    model.load_state_dict(state)
    if model.d2t is not None:
        target_ids = model.draft_to_target(torch.arange(cfg.draft_vocab_size))
        require(
            bool(((target_ids >= 0) & (target_ids < cfg.vocab_size)).all()) and target_ids.unique().numel() == target_ids.numel(),
            f"drafter d2t in {directory} must map the {cfg.draft_vocab_size} draft ids to distinct target ids below {cfg.vocab_size}",
            CheckpointError,
        )
    model.to(device=device, dtype=dtype)
    if model.d2t is not None:
        model.d2t = model.d2t.long()  # Module.to(dtype) leaves integer buffers alone; keep it explicit
    return model.eval()


def save_drafter(model: DrafterModel, directory: str | Path, shared_backbone: str | None = None) -> None:
    """Write ``model`` in the DFlash on-disk format. ``shared_backbone``: a weights file (a path
    relative to ``directory``) that already holds this drafter's backbone, bit for bit (checked):
    only the head's tensors are written, and config.json names the file (``backbone_weights``)."""
    require(not model.float_weights_released, RELEASED)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("head."):
            name = name[len("head.") :]
        state[name] = tensor.detach().contiguous().cpu()
    config = model.config.to_dict()
    config.pop(SHARED_BACKBONE_FIELD, None)
    if shared_backbone is not None:
        backbone = _load_safetensors(directory / shared_backbone)
        for name in [n for n in state if n.split(".")[0] not in HEAD_TENSOR_PREFIXES]:
            require(name in backbone and torch.equal(backbone[name], state[name]),
                    f"{directory / shared_backbone} does not hold this drafter's {name}: the backbones differ", CheckpointError)
            del state[name]
        config[SHARED_BACKBONE_FIELD] = shared_backbone
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    save_file(state, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})



# ---------------------------------------------------------------- the pair


def check_pair(target_model: torch.nn.Module, drafter: DrafterModel) -> None:
    """Raise a clear error when a drafter does not fit its target."""
    cfg, tcfg = drafter.config, target_model.config
    require(
        cfg.hidden_size == tcfg.hidden_size,
        f"drafter hidden_size {cfg.hidden_size} does not match the target's {tcfg.hidden_size}; the drafter "
        "reuses the target's embedding and lm_head, so they must be equal",
    )
    lm_rows = target_model.get_output_embeddings().weight.shape[0]
    require(
        cfg.vocab_size == lm_rows,
        f"drafter vocab_size {cfg.vocab_size} does not match the target's lm_head ({lm_rows} tokens)",
    )
    n_layers = tcfg.num_hidden_layers
    for i in cfg.target_layer_ids:
        require(
            0 <= i < n_layers,
            f"drafter taps target layer {i}, out of range for a target with {n_layers} layers (0..{n_layers - 1})",
        )
    require(
        cfg.num_target_layers == n_layers,
        f"drafter was built for a {cfg.num_target_layers}-layer target, this target has {n_layers} layers",
    )


