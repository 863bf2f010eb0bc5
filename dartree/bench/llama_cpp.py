"""llama.cpp as a peer: ``llama-server`` decoding the same weights, driven over its HTTP API.

``scripts/build_llama_cpp.sh`` builds llama.cpp b11434 into ``<cache>/llama.cpp/`` and writes the
F32 GGUF of the shipped Q4_1 file (every weight d * q + m, exactly the fp32 weights dartree
decodes). Three peers run on it: ``llama.cpp-f32`` (those weights, in fp32), ``llama.cpp-q4_1``
(the shipped 4-bit file itself) and ``llama.cpp-q4_1-ngram`` (that file with llama.cpp's n-gram
speculation, ``--spec-type ngram-simple``). A peer gets the prompt as token ids (our chat template's, so both
sides decode the same input), greedy, and returns its token ids and its own decode time (prompt
processing excluded, as ours). The benchmark (``dartree bench``), ``scripts/side_by_side_llama_cpp.py``
and ``scripts/serve_load.py`` all start it here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from ..default_model import cache_root, gguf_path
from ..errors import DartreeError

BUILD_HINT = "bash scripts/build_llama_cpp.sh   # builds llama.cpp b11434 into .cache/llama.cpp (~8 minutes on 2 cores)"
F32_FILE = "SmolLM2-135M-Instruct.F32.gguf"
# peer -> its speculation flags: llama.cpp's own drafter-free speculation (``--spec-type ngram-simple``),
# with the lookup and draft lengths of dartree's ``ngram-chain`` (a suffix of up to 3 tokens here; 8 drafted)
PEER_FLAGS = {"llama.cpp-f32": (), "llama.cpp-q4_1": (),
              "llama.cpp-q4_1-ngram": ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                       "--spec-ngram-simple-size-m", "8")}
LLAMA_PEERS = tuple(PEER_FLAGS)


def llama_dir() -> Path:
    return cache_root() / "llama.cpp"


def server_binary() -> Path:
    return llama_dir() / "bin" / "llama-server"


def peer_weights(peer: str) -> Path:
    """The GGUF file a peer decodes."""
    if peer == "llama.cpp-f32":
        return llama_dir() / F32_FILE
    if peer in ("llama.cpp-q4_1", "llama.cpp-q4_1-ngram"):
        return gguf_path()
    raise DartreeError(f"unknown llama.cpp peer {peer!r}; known: {', '.join(LLAMA_PEERS)}")


def missing() -> str | None:
    """Why the peers cannot run here (None: they can), with the one line that builds them."""
    for path in (server_binary(), peer_weights("llama.cpp-f32")):
        if not path.is_file():
            return f"llama.cpp is not built here ({path} is missing); build it with: {BUILD_HINT}"
    return None


def wait_healthy(proc: subprocess.Popen, base_url: str, tries: int, interval: float = 0.5) -> bool:
    """Poll a server's /health (``interval`` seconds apart) until it answers 200; False when the process
    exits or it does not come up in ``tries`` polls (llama-server's and dartree serve's alike)."""
    for _ in range(tries):
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(interval)
    return False


class LlamaServer:
    """One ``llama-server`` process on a GGUF file, ``slots`` parallel slots, CPU only."""

    def __init__(self, gguf: Path, threads: int, port: int, slots: int = 1, context_per_slot: int = 4096,
                 speculation: tuple[str, ...] = ()):
        self.gguf, self.threads, self.port, self.slots = Path(gguf), threads, port, slots
        self.speculation = tuple(speculation)  # llama-server's --spec-* flags (none: plain decoding)
        self.flags: tuple[str, ...] = ()
        self.proc: subprocess.Popen | None = None
        self.context = context_per_slot * slots

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, tries: int = 240) -> "LlamaServer":
        """Start it and wait until it answers (and has loaded lazily: one short warm-up request).
        Repacking the Q4_1 weights was seen to die of an illegal instruction in a KVM guest that
        reports AMX: then it starts again with ``--no-repack`` (recorded in ``flags``)."""
        for flags in ((), ("--no-repack",)):
            self.flags = flags
            env = dict(os.environ, LD_LIBRARY_PATH=str(server_binary().parent))
            self.proc = subprocess.Popen(
                [str(server_binary()), "-m", str(self.gguf), "-t", str(self.threads), "-tb", str(self.threads),
                 "-c", str(self.context), "-np", str(self.slots), "--port", str(self.port), "--host", "127.0.0.1",
                 "-ngl", "0", *self.speculation, *flags], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if wait_healthy(self.proc, self.base_url, tries):
                try:
                    self.complete([1, 2, 3], 4)
                    return self
                except OSError:
                    pass
            self.close()
        raise DartreeError(f"llama-server on {self.gguf} did not come up (with or without --no-repack)")


    def complete(self, prompt_ids: list[int], max_new_tokens: int) -> dict:
        """Greedy decoding of ``prompt_ids``: the new token ids (a stop token included, as ours),
        the decode time and the prompt time as llama.cpp measures them."""
        body = json.dumps({"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": 0, "top_k": 1,
                           "seed": 0, "cache_prompt": False, "return_tokens": True}).encode()
        req = urllib.request.Request(f"{self.base_url}/completion", body, {"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
        wall = time.perf_counter() - t0
        t = out["timings"]
        return {"token_ids": list(out["tokens"]), "new_tokens": int(t["predicted_n"]),
                "decode_seconds": t["predicted_ms"] / 1000.0, "prompt_seconds": t["prompt_ms"] / 1000.0,
                "drafted": t.get("draft_n", 0), "draft_accepted": t.get("draft_n_accepted", 0),  # with --spec-type
                "total_seconds": wall, "stop_type": out.get("stop_type")}

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def __enter__(self) -> "LlamaServer":
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_peer(peer: str, threads: int, port: int | None = None, slots: int = 1) -> LlamaServer:
    """A started server for ``peer`` (``LLAMA_PEERS``) on ``port`` (default: a free one); a clear
    error with the build line where llama.cpp is missing."""
    reason = missing()
    if reason is not None:
        raise DartreeError(reason)
    return LlamaServer(peer_weights(peer), threads, free_port() if port is None else port, slots,
                       speculation=PEER_FLAGS[peer]).start()
