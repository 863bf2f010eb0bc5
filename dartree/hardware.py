"""What the machine offers: CPU model and flags, native bf16 matrix instructions, physical cores."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

from .errors import DartreeError

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # native bf16 dot products (Intel AMX, AVX-512 BF16 on Intel/AMD)


@functools.lru_cache(maxsize=1)
def _cpuinfo_fields() -> dict[str, str] | None:
    """The first CPU's fields in /proc/cpuinfo (each key's first value); None where it cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_info() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; ("unknown", {}) where it cannot be read."""
    fields = _cpuinfo_fields()
    if fields is None:
        return platform.processor() or "unknown", frozenset()
    return fields.get("model name") or "unknown", frozenset(fields.get("flags", "").split())


def cpu_generation() -> str:
    """The CPU's family and model numbers ("family 26 model 2"; "" where unknown): guests report one
    model name ("AMD EPYC") for generations whose kernels and costs differ (Zen 4 is family 25, Zen 5 26)."""
    fields = _cpuinfo_fields() or {}
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"family {fields['cpu family']} model {fields['model']}"


def has_native_bf16() -> bool:
    return any(f in cpu_info()[1] for f in BF16_CPU_FLAGS)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """What dtype="auto" loads: bfloat16 on a GPU (as every GPU engine does); float32 on a CPU, where it
    is exact (a bf16 tree forward rounds differently from a one-token step, so bf16 speculation does
    not reproduce bf16 greedy decoding token for token) and measured no slower for decoding here."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def native_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on a GPU or on a CPU with native bf16 matrix instructions, else float32."""
    device = torch.device(device)
    if device.type == "cuda" or (device.type == "cpu" and has_native_bf16()):
        return torch.bfloat16
    return torch.float32


def inexact_work_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The dtype of work that need not be bit-exact (data generation, the frozen target's training
    tapped states, the drafter's training products): "float32", "bfloat16", or "auto" = ``native_dtype``
    (bf16 where it is native)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(name) or native_dtype(device)


def physical_cores() -> int:
    """Cores without SMT siblings (what a compute-bound forward can use), at least 1."""
    try:
        seen = set()
        for cpu in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
            if (cpu / "core_id").is_file():
                seen.add(((cpu / "physical_package_id").read_text().strip(), (cpu / "core_id").read_text().strip()))
        allowed = len(os.sched_getaffinity(0))
        if seen:
            return max(1, min(len(seen), allowed))
        return max(1, allowed)
    except (OSError, AttributeError):
        return max(1, os.cpu_count() or 1)


def describe_machine() -> str:
    """One line to record beside every timing: CPU model and the flags that decide kernel choice."""
    model, flags = cpu_info()
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile", "amx_int8")
            if f in flags]
    generation = cpu_generation()
    named = f"{model} ({generation})" if generation else model
    return f"{named}; flags: {' '.join(keep) or 'none of avx2/avx512/amx'}; {physical_cores()} physical cores"


_threads_chosen: int | None = None  # the count set_threads last chose (None: torch's own default still stands)


def resident_mb(pid: int | str = "self") -> float:
    """A process's resident memory (VmRSS) in MB, from /proc; raises where it cannot be read."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise DartreeError(f"no VmRSS in /proc/{pid}/status")


def release_freed_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``); returns whether it ran.

    Loading a model frees a great deal it made on the way (each tensor's raw copy once it is packed, a
    drafter's file once converted), and glibc keeps those pages resident until they are handed back.
    Where the C library is not glibc this does nothing."""
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def set_threads(threads: int | None) -> int:
    """Use ``threads`` CPU threads for torch; returns the count in use. ``None`` keeps a count chosen
    earlier in the process (the command line chooses once, before anything loads), else takes
    $OMP_NUM_THREADS when set, else the physical cores: torch's own default counts every logical CPU
    it sees, which on a busy or SMT machine can make a decoding step ~10x slower."""
    global _threads_chosen
    if threads is None:
        if _threads_chosen is not None:
            return torch.get_num_threads()
        env = os.environ.get("OMP_NUM_THREADS", "")
        threads = int(env) if env.isdigit() and int(env) > 0 else physical_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise DartreeError(f"threads must be an integer >= 1, got {threads!r}")
    torch.set_num_threads(threads)
    _threads_chosen = threads
    return threads


def hand_over_threads() -> bool:
    """Free the calling thread's OpenMP worker threads, before another thread does the computing.

    OpenMP keeps one pool of workers per thread that ran a parallel region; with a second pool (the
    server's engine thread after the main thread loaded and measured the model) that thread's steps
    run up to ~17 % slower than on the main thread (about 2x with OMP_WAIT_POLICY=active), and after
    this call they do not. Returns whether the OpenMP runtime did it (False where torch's runtime is
    not libgomp or lacks omp_pause_resource_all)."""
    import ctypes
    import glob

    omp_pause_hard = 2
    for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))) or ["libgomp.so.1"]:
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause(omp_pause_hard) == 0
    return False
