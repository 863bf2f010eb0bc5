"""What a draft vocabulary of V_d tokens can cost, measured on replay results.

    .venv/bin/python scripts/vocab_ceiling.py docs/results/drafter-v4/gsm8k-humaneval-replay \
        docs/results/drafter-v4/seven-replay [--data data/smollm2-selfdistill] [--json OUT]

A drafter can never draft a token outside its vocabulary. For each V_d (the V_d most frequent
tokens of the target-written training responses, as `dartree train drafter --draft-vocab` picks
them; plus the shipped drafter's own vocabulary) this prints the share of the target's greedy
benchmark tokens inside it, and the share of `dartree` rounds (B = 16 and 64, from records.jsonl)
whose first rejected position holds a token outside it: those rounds would have ended there with
any drafter of that vocabulary, so a larger vocabulary can lengthen at most that share of rounds.

    .venv/bin/python scripts/vocab_ceiling.py --by-category data/smollm2-expanded [--json OUT]

prints, per category of those shards, the share of response tokens inside the shipped drafter's
vocabulary and inside V_d re-ranked on the other half: vocabularies ranked on the even sequences of
every category, measured on the odd ones (out of sample for both).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dartree.loading import load_drafter
from dartree.train.data import load_shards, sequence_category, shard_files
from dartree.train.drafter import draft_vocabulary

SIZES = (4096, 8192, 16384, 32768)


def ended_outside(records: list[dict], vocab: set[int], budget: int, depth: int) -> tuple[int, int]:
    """(rounds whose bonus token lies outside ``vocab``, all rounds) of the dartree records at ``budget``;
    a round that committed every depth plus the bonus was not stopped by a rejection."""
    outside = rounds = 0
    for rec in records:
        if rec["method"] != "dartree" or rec["budget"] != budget:
            continue
        for turn in rec["turns"]:
            pos = 0
            for length in turn["acceptance_lengths"]:
                rounds += 1
                last = pos + length - 1  # the target's own token after the accepted drafts
                if length <= depth and last < len(turn["token_ids"]) and turn["token_ids"][last] not in vocab:
                    outside += 1
                pos += length
    return outside, rounds


def candidate_vocabularies(shipped, ranked_on: list) -> dict[str, torch.Tensor]:
    """Target ids of the shipped drafter's vocabulary and of each size in SIZES ranked on ``ranked_on``."""
    size = shipped.config.output_vocab_size
    vocabs = {f"shipped ({size})": shipped.draft_to_target(torch.arange(size))}
    vocabs.update({str(v): draft_vocabulary(ranked_on, v, int(shipped.config.vocab_size)) for v in SIZES})
    return vocabs


def coverage_by_category(data: str, drafter: str) -> dict[str, dict[str, float]]:
    seqs = load_shards(shard_files(data))
    shipped = load_drafter(drafter)
    n_target = int(shipped.config.vocab_size)
    by_category: dict[str, list] = {}
    for s in seqs:
        by_category.setdefault(sequence_category(s), []).append(s)
    ranked_on = [s for group in by_category.values() for s in group[0::2]]
    masks = {}
    for name, ids in candidate_vocabularies(shipped, ranked_on).items():
        masks[name] = torch.zeros(n_target, dtype=torch.bool)
        masks[name][ids] = True
    table = {}
    print(f"{'category':>14} {'tokens':>8} " + " ".join(f"{name:>14}" for name in masks))
    for category, group in sorted(by_category.items()):
        measured = group[1::2]
        if not measured:
            continue
        tokens = torch.cat([s.tokens[s.prompt_len:].long() for s in measured])
        row = table[category] = {name: float(mask[tokens].float().mean()) for name, mask in masks.items()}
        row["tokens"] = int(tokens.numel())
        print(f"{category:>14} {tokens.numel():8d} " + " ".join(f"{row[name]:14.1%}" for name in masks))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("replays", nargs="*", help="replay result folders (greedy.jsonl and records.jsonl)")
    parser.add_argument("--by-category", metavar="DATA", help="shard folder: coverage per category instead (see above)")
    parser.add_argument("--data", default="data/smollm2-selfdistill", help="training shards that rank the vocabulary")
    parser.add_argument("--drafter", default="dartree/assets/smollm2-drafter-domino")
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args()
    if args.by_category:
        table = coverage_by_category(args.by_category, args.drafter)
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
        return
    if not args.replays:
        parser.error("give replay result folders, or --by-category DATA")
    seqs = load_shards(shard_files(args.data))
    shipped = load_drafter(args.drafter)
    depth = shipped.config.num_draft_depths
    vocabs = {name: set(ids.tolist()) for name, ids in candidate_vocabularies(shipped, seqs).items()}
    table = {}
    for folder in map(Path, args.replays):
        greedy = [t for line in open(folder / "greedy.jsonl") for t in json.loads(line)["tokens"]]
        records = [json.loads(line) for line in open(folder / "records.jsonl")]
        print(f"{folder}: {len(greedy)} greedy tokens")
        print(f"{'V_d':>14} {'coverage':>9} {'B16 rounds ended outside':>25} {'B64':>7}")
        rows = table[str(folder)] = {}
        for name, vocab in vocabs.items():
            cov = sum(t in vocab for t in greedy) / len(greedy)
            row = rows[name] = {"coverage": cov}
            for b in (16, 64):
                out, n = ended_outside(records, vocab, b, depth)
                row[f"B{b}"] = out / n if n else None
            print(f"{name:>14} {cov:9.1%} {row['B16'] or 0:25.1%} {row['B64'] or 0:7.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
