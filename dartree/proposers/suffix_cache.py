"""A server-wide cache of earlier answers for the n-gram proposer (``dartree serve --suffix-cache MB``).

The n-gram proposer of one request looks only at that request's own text. On repeated workloads
(agents calling the same tools, templated answers) the answer a request is writing often continues
the way an earlier request's answer did. This cache keeps the most recent answers (each with the last
few prompt tokens before it, so an answer's opening is reachable from the end of a prompt), indexed
by their n-grams, bounded in memory, least-recently-used first out. A request's n-gram proposer
adds the continuations it finds here as further branches of its tree.

It changes what is proposed, never what is written: every proposal is verified by the target like
any other (lossless). It does share statistics between requests: which tokens one request proposes
depends on what earlier requests answered, so the acceptance (and the time a request takes) does
too. Off unless asked for.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

from ..errors import require

# Resident bytes per cached token, at worst: the token itself, its n-gram index entries (one per n,
# 8 bytes each in an array) and, where its n-grams are new, their keys and arrays. Measured with
# tracemalloc: ~380 on the drafter's held-out answers, ~600 on random tokens of a 49k vocabulary (every
# n-gram new); tests/test_ngram.py checks the bound on the latter.
BYTES_PER_TOKEN = 640
DEAD_SHARE = 0.25  # evicted answers' index entries kept until they reach this share of the live ones
_POSITION_BITS = 24  # an index entry is (entry id << _POSITION_BITS) | position in the entry


class SuffixCache:
    """Earlier answers by their n-grams (n = ``min_match`` .. ``max_match``), at most ``capacity_tokens``."""

    min_match = 2  # a shared one-token match is too weak a hint across requests
    context = 4  # prompt tokens kept before an answer

    def __init__(self, megabytes: float, max_match: int = 4):
        require(megabytes > 0, f"the suffix cache needs a positive size in MB, got {megabytes}")
        self.capacity_tokens = int(megabytes * 2**20 / (BYTES_PER_TOKEN * (1 + DEAD_SHARE)))
        self.max_match = max_match
        self.entries: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self.index: dict[tuple[int, ...], array] = {}
        self.tokens = 0  # tokens held by live entries
        self.dead = 0  # tokens of evicted answers still in the index, dropped at the next compaction
        self.next_id = 0

    def add(self, prompt_tail: list[int], answer: list[int]) -> None:
        """Keep one finished request's answer (with the end of its prompt before it)."""
        tokens = list(prompt_tail[-self.context:]) + list(answer)
        if not answer or len(tokens) > min(self.capacity_tokens, 2**_POSITION_BITS):
            return
        while self.entries and self.tokens + len(tokens) > self.capacity_tokens:
            _, old = self.entries.popitem(last=False)
            self.tokens -= len(old)
            self.dead += len(old)
        entry = self.next_id
        self.next_id += 1
        self.entries[entry] = tokens
        self.tokens += len(tokens)
        for end in range(1, len(tokens) + 1):
            for n in range(self.min_match, min(self.max_match, end) + 1):
                self.index.setdefault(tuple(tokens[end - n:end]), array("q")).append((entry << _POSITION_BITS) | end)
        if self.dead > DEAD_SHARE * self.tokens:
            self._compact()

    def continuations(self, history: list[int], limit: int, depth: int) -> tuple[int, list[list[int]]]:
        """The longest suffix of ``history`` (>= ``min_match`` tokens) found in the cache and the
        continuations (up to ``depth`` tokens) after its latest ``limit`` occurrences, latest first.
        The answers they come from count as used."""
        for n in range(min(self.max_match, len(history)), self.min_match - 1, -1):
            ends = self.index.get(tuple(history[len(history) - n:]))
            if not ends:
                continue
            found = []
            for code in reversed(ends):
                entry, end = code >> _POSITION_BITS, code & ((1 << _POSITION_BITS) - 1)
                tokens = self.entries.get(entry)
                if tokens is None or end >= len(tokens):  # evicted, or nothing followed
                    continue
                found.append(tokens[end:end + depth])
                self.entries.move_to_end(entry)
                if len(found) == limit:
                    break
            if found:
                return n, found
        return 0, []

    def _compact(self) -> None:
        """Drop the index entries of evicted answers (amortised: runs once they are a quarter of the live ones)."""
        live = set(self.entries)
        index = {}
        for key, ends in self.index.items():
            kept = array("q", (c for c in ends if (c >> _POSITION_BITS) in live))
            if kept:
                index[key] = kept
        self.index, self.dead = index, 0
