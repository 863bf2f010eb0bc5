"""The lean forward's compiled kernels (``csrc/lean_kernels.cpp``), built once per machine.

They are compiled for this CPU (``-march=native``) into the cache folder on first use (about a
minute; ``scripts/setup.sh`` does it up front) and loaded from there afterwards. Where no compiler
is available, ``available()`` is False and targets keep the Hugging Face forward.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: builds are not guarded (torch's own lock file only)
    fcntl = None

import torch

from .default_model import cache_root
from .hardware import cpu_info

SOURCE = Path(__file__).parent / "csrc" / "lean_kernels.cpp"
# the whole forward in one call (targets/lean.py ``forward``), compiled from both kernel sources
FORWARD_SOURCE = SOURCE.parent / "forward_kernels.cpp"
INCLUDES = {FORWARD_SOURCE.name: ("lean_kernels.cpp", "quant_kernels.cpp")}  # what a source #includes: part of its build key
# Only correctly rounded operations are written in the source (explicit fma), so no contraction:
# the compiler may not fuse a multiply and an add on its own in one code path and not in another.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
# -fopenmp is what makes at::parallel_for split work over torch's threads: ATen's OpenMP backend is an
# inline ``#pragma omp parallel`` in its header, so without the flag every kernel runs on one thread
# (one-row products over a SmolLM2 forward's weights take 2.4x as long as with it on 2 threads). The
# process links torch's own libgomp (same soname), so there is one OpenMP runtime and thread count.
LDFLAGS = ["-fopenmp"]


def extension_dir(source: Path, folder: str, extra_cflags: tuple[str, ...] = ()) -> Path:
    """Where ``source`` is built for this CPU: keyed by the source (and the sources it includes), torch,
    the flags and the CPU."""
    model, flags = cpu_info()
    texts = [source.read_text()] + [(source.parent / name).read_text() for name in INCLUDES.get(source.name, ())]
    key = hashlib.sha256("\n".join(texts + [torch.__version__, " ".join(CFLAGS + list(extra_cflags) + LDFLAGS),
                                    model, " ".join(sorted(flags))]).encode()).hexdigest()[:16]
    return cache_root() / folder / key


def build_extension(source: Path, folder: str, module: str, what: str, extra_cflags: tuple[str, ...] = (),
                    verbose: bool = False):
    """Compile (once per machine) and load the torch extension ``source`` as ``module``; a variant
    with ``extra_cflags`` is a module of its own name, so that it loads beside the default one."""
    from torch.utils.cpp_extension import load as load_extension

    # torch finds ninja on PATH: the one installed beside this Python (pip's ninja) comes first
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    out = extension_dir(source, folder, extra_cflags)
    out.mkdir(parents=True, exist_ok=True)
    with build_lock(out):
        if not any(out.glob("*.so")):
            print(f"dartree: compiling {what} for this CPU into {out} (once, about a minute)", file=sys.stderr)
        name = module + (f"_{out.name}" if extra_cflags else "")
        return load_extension(name=name, sources=[str(source)], extra_cflags=CFLAGS + list(extra_cflags),
                              extra_ldflags=list(LDFLAGS), build_directory=str(out), verbose=verbose)  # a copy: torch appends to it


TORCH_LOCK = "lock"  # the file torch's extension loader creates in a build folder while it builds, and waits on


@contextlib.contextmanager
def build_lock(out: Path):
    """Hold the build folder ``out`` against other dartree processes (an advisory lock that the system
    drops when its holder dies), and clear a lock file that torch's loader left there: torch marks a build
    with a bare file and waits, without end, while it exists, so a build interrupted by Ctrl-C or a kill
    would hang every later start. Once this lock is held no live dartree process is building here, so
    such a file is stale."""
    try:  # read-only is enough for flock, and works on a shared cache where another user made the file
        fd = os.open(out / ".dartree-build", os.O_RDONLY | os.O_CREAT, 0o666) if fcntl is not None else None
    except OSError:  # a folder we cannot write to: nothing to guard (torch could not build there either)
        fd = None
    if fd is None:
        yield
        return
    with os.fdopen(fd) as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"dartree: waiting for another process that is compiling into {out}", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = out / TORCH_LOCK
            if stale.exists():
                stale.unlink(missing_ok=True)
                print(f"dartree: removed {stale}, left by an interrupted build", file=sys.stderr)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_dir(extra_cflags: tuple[str, ...] = ()) -> Path:
    return extension_dir(SOURCE, "kernels", extra_cflags)


@functools.lru_cache(maxsize=None)
def load(verbose: bool = False, extra_cflags: tuple[str, ...] = ()):
    """The compiled module (built first when this machine has none yet). ``extra_cflags`` builds a
    variant beside it (for instance ``("-mno-avx512f",)``: the AVX2 paths on an AVX-512 CPU), which
    the tests use to check that every instruction-set path gives the same bits."""
    return build_extension(SOURCE, "kernels", "dartree_lean_kernels", "the lean forward's kernels", extra_cflags, verbose)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether the kernels are built (or can be built) here."""
    try:
        load()
    except Exception as exc:  # no compiler, no ninja, a failed build: the HF forward stays
        print(f"dartree: the lean forward's kernels are unavailable here ({type(exc).__name__}: "
              f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); using the Hugging Face forward",
              file=sys.stderr)
        return False
    return True


@functools.lru_cache(maxsize=None)
def load_forward(verbose: bool = False, extra_cflags: tuple[str, ...] = ()):
    """The whole-forward module (``forward_kernels.cpp``: the lean forward's layer loop in one call, on the
    same kernels), or None where it does not build (the forward then loops over the layers in Python)."""
    try:
        return build_extension(FORWARD_SOURCE, "forward_kernels", "dartree_forward_kernels",
                               "the lean forward's layer loop", extra_cflags, verbose)
    except Exception as exc:  # noqa: BLE001 - the Python loop runs the same kernels
        print(f"dartree: the compiled layer loop is unavailable here ({type(exc).__name__}); the forward loops in Python",
              file=sys.stderr)
        return None
