"""The target's greedy answers kept across runs (the costly part of a replay), one JSONL line each,
for the bench and the training's held-out evaluation alike; and the JSONL lines themselves: appended
whole under a lock (shards of one run share a file), read back past a line an interrupted run cut."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .replay import enough_greedy, enough_greedy_many

try:  # POSIX: lets shards of one run (``dartree bench --shard``) append to the same records file
    import fcntl
except ImportError:  # pragma: no cover - Windows runs one shard per folder
    fcntl = None


def read_records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by an interrupted run
                    continue
    return out


def append_line(sink, record: dict) -> None:
    """Append one JSON line whole, under an exclusive lock, so concurrent shards never interleave."""
    line = json.dumps(record) + "\n"
    if fcntl is not None:
        fcntl.flock(sink.fileno(), fcntl.LOCK_EX)
    try:
        sink.write(line)
        sink.flush()
    finally:
        if fcntl is not None:
            fcntl.flock(sink.fileno(), fcntl.LOCK_UN)


class GreedyAnswers:
    """The target's greedy answers (``replay.enough_greedy``), the costly part of a replay, kept in a
    JSONL file across runs: a line per answer, its key's fields (``key_fields``) and its ``tokens``.
    The bench keys them by dataset, sample, turn and length; the training evaluation by the prompt's
    ids, the length and the target's dtype. ``path`` None: kept in memory only."""

    def __init__(self, path: Path | None, key_fields: tuple[str, ...]):
        self.path, self.key_fields = path, key_fields
        self.known = {tuple(g[f] for f in key_fields): g["tokens"] for g in (read_records(path) if path else [])}

    def prefetch(self, pipe, prompts: list[tuple[torch.Tensor, dict]], new_tokens: int, stop_ids: set[int], slots: int = 16) -> None:
        """Generate every answer ``prompts`` (prompt ids, key) lacks in one batched run
        (``replay.enough_greedy_many``): what ``tokens`` would generate one prompt at a time."""
        todo, seen = [], set()
        for ids, key in prompts:
            k = self._key(key)
            if k not in self.known and k not in seen:
                seen.add(k)
                todo.append((ids, key))
        if not todo:
            return
        for (ids, key), answer in zip(todo, enough_greedy_many(pipe, [ids for ids, _ in todo], new_tokens, stop_ids, slots)):
            self._keep(key, answer)

    def _key(self, key: dict) -> tuple:
        return tuple(key[f] for f in self.key_fields)

    def _keep(self, key: dict, answer: list[int]) -> None:
        self.known[self._key(key)] = answer
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as sink:
                append_line(sink, {**{f: key[f] for f in self.key_fields}, "tokens": answer})

    def tokens(self, pipe, prompt_ids: torch.Tensor, new_tokens: int, stop_ids: set[int], **key) -> list[int]:
        """The answer of ``new_tokens`` (and the tokens a replay looks past it) for ``key`` (every field
        of ``key_fields``), generated and appended where new."""
        k = self._key(key)
        if k not in self.known:
            self._keep(key, enough_greedy(pipe, prompt_ids, new_tokens, stop_ids))
        return self.known[k]
