#!/usr/bin/env bash
# The benchmark runs committed under docs/results/ for the default model (2-core CPU).
# Every run resumes where it stopped (records.jsonl); stop one any time and rerun to continue.
# Every run uses one thread, so two can share the two cores (two shards, or a decoding run beside a replay).
set -euo pipefail
cd "$(dirname "$0")/.."
ALL=dflash,ddtree,domino,domino-ddtree,heap,dartree,dartree-fixed
OUT=${OUT:-docs/results}
case "${1:-}" in
  gsm8k-humaneval-replay)   # T=0 tau of every method x budget on 30 + 30 prompts (exact replay)
    .venv/bin/dartree bench --replay --datasets gsm8k,humaneval --limit 30 --max-new-tokens 256 \
        --methods $ALL --budgets 16,32,64 --threads 1 --out $OUT/gsm8k-humaneval/replay ;;
  gsm8k-humaneval-decoded)  # the same grid decoded for wall-clock speedups: two shards, one core each
    D="--datasets gsm8k,humaneval --limit 30 --max-new-tokens 256 --methods ar,$ALL --budgets 16,32,64 --threads 1"
    .venv/bin/dartree bench $D --out $OUT/gsm8k-humaneval/decoded --shard 1/2 & first=$!
    .venv/bin/dartree bench $D --out $OUT/gsm8k-humaneval/decoded --shard 2/2
    wait $first ;;
  ablations)                # W, B and beta on real drafts, with tree-build time (exact replay)
    A="--replay --datasets gsm8k,humaneval --limit 5 --max-new-tokens 256 --threads 1 --out $OUT/ablations"
    .venv/bin/dartree bench $A --methods dartree --widths 1,2,4,8,12,16 --budgets 32,64
    .venv/bin/dartree bench $A --methods ddtree,domino-ddtree,heap,dartree,dartree-fixed --budgets 8,16,32,64,128
    .venv/bin/dartree bench $A --methods heap,dartree --betas 0,-0.1,-0.2,-0.5,-1 --budgets 32 ;;
  seven-decoded)            # all seven benchmarks, peers, T=0 and T=1, decoded
    .venv/bin/dartree bench --datasets all --limit 3 --max-new-tokens 128 --budgets 32 --temperatures 0,1 \
        --methods ar,dflash,ddtree,dartree,hf-generate,hf-prompt-lookup --threads 1 --out $OUT/seven-benchmarks/decoded ;;
  seven-replay)             # all seven benchmarks, T=0 tau of every method at B=32 (exact replay)
    .venv/bin/dartree bench --replay --datasets all --limit 10 --max-new-tokens 256 --budgets 32 \
        --methods $ALL --threads 1 --out $OUT/seven-benchmarks/replay ;;
  fast-decoded)             # ar, HF peers and dartree (budget auto / 16 / 64) side by side, 7 datasets, fp32 and bf16 in one run
    .venv/bin/dartree bench --datasets all --limit ${LIMIT:-1} --max-new-tokens 128 --budgets auto,16,64 --threads 1 --dtype ${DTYPE:-float32,bfloat16} \
        --methods ar,hf-generate,hf-prompt-lookup,dartree --out $OUT/fast-on-this-machine/${TAG:-side-by-side} ;;
  drafter-v2-replay)        # the retrained drafter: T=0 tau of every method on 15 + 15 held-out prompts (replay)
    R=$OUT/drafter-v2/gsm8k-humaneval-replay; mkdir -p $R
    .venv/bin/dartree bench --replay --datasets gsm8k,humaneval --limit 15 --max-new-tokens 256 \
        --methods $ALL --budgets 16,64 --threads 1 --out $R
    .venv/bin/dartree bench --replay --datasets gsm8k,humaneval --limit 15 --max-new-tokens 256 \
        --methods dartree --widths 24 --budgets 16,64 --threads 1 --out $R ;;
  drafter-replay)           # a drafter's T=0 tau, every method x B 16/32/64: the 60 GSM8K + HumanEval prompts (SHARD=1/2)
    # and 5 prompts of each of the seven benchmarks (SHARD=2/2); run both shards at once, one core each.
    # The target's greedy continuations do not depend on the drafter: earlier runs' greedy.jsonl are reused.
    # DRAFTER=dir replays another drafter than the shipped one (e.g. a training checkpoint); METHODS narrows the grid.
    R=$OUT/${TAG:-drafter}; mkdir -p $R/gsm8k-humaneval-replay $R/seven-replay
    for d in $R/gsm8k-humaneval-replay $R/seven-replay; do
      [ -f $d/greedy.jsonl ] || cat docs/results/drafter-v2/gsm8k-humaneval-replay/greedy.jsonl docs/results/seven-benchmarks/replay/greedy.jsonl \
          > $d/greedy.jsonl 2>/dev/null || true
    done
    if [ "${SHARD:-1/2}" = 1/2 ]; then
      .venv/bin/dartree bench --replay --datasets gsm8k,humaneval --limit 30 --max-new-tokens 256 \
          --methods ${METHODS:-$ALL} --budgets 16,32,64 --threads 1 ${DRAFTER:+--drafter $DRAFTER} --out $R/gsm8k-humaneval-replay
    else
      .venv/bin/dartree bench --replay --datasets all --limit 5 --max-new-tokens 256 \
          --methods ${METHODS:-$ALL} --budgets 16,32,64 --threads 1 ${DRAFTER:+--drafter $DRAFTER} --out $R/seven-replay
    fi ;;
  modeled-auto)             # budget auto against fixed budgets, replayed on a cost model (COST=float32|bfloat16, the
    # committed one-thread models of this CPU) over the drafter-replay prompts; speedups are modeled, not measured.
    # COSTS: the folder of cost models (default: the committed one-thread fp32/bf16 models).
    R=$OUT/${TAG:-drafter}; C=${COST:-float32}; M=$R/modeled-$C; mkdir -p $M
    COSTS=${COSTS:-docs/results/fast-on-this-machine/cost-models/session10}
    [ -f $M/greedy.jsonl ] || cat $R/gsm8k-humaneval-replay/greedy.jsonl $R/seven-replay/greedy.jsonl > $M/greedy.jsonl 2>/dev/null || true
    .venv/bin/dartree bench --replay --datasets all --limit 5 --max-new-tokens 256 --methods dartree \
        --budgets auto,4,8,16,32,64 --cost-model $COSTS/$C-1thread.json \
        --threads 1 ${DRAFTER:+--drafter $DRAFTER} --out $M ;;
  *) echo "usage: $0 gsm8k-humaneval-replay|gsm8k-humaneval-decoded|ablations|seven-decoded|seven-replay|fast-decoded|drafter-v2-replay|drafter-replay|modeled-auto" >&2; exit 2 ;;
esac
