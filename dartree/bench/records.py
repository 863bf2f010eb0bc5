"""The bench's JSONL files: records appended whole (shards of one run share a file), read back
past a line an interrupted run cut, and the target's greedy answers kept across runs. The lines and
the greedy answers are the core's (``dartree.greedy``), shared with the training's evaluation."""

from __future__ import annotations

from ..greedy import GreedyAnswers, append_line, read_records

__all__ = ["GreedyAnswers", "append_line", "read_records"]
