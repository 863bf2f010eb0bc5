#!/usr/bin/env bash
# Reproduce the drafters shipped in dartree/assets/ for SmolLM2-135M-Instruct (CPU recipe; one thread
# by default so a second job can share a 2-core machine). Every step resumes from its checkpoint when
# run again and --max-minutes stops a step cleanly, so the recipe spreads over several sessions:
# the data set grows shard by shard (shards are committed in data/), training resumes from runs/.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
DATA=${DATA:-data/smollm2-selfdistill}
# 1. The target writes responses to every training prompt (greedy, 1 shard in 4 at T=1), token ids only.
.venv/bin/dartree train data --prompts ../shared/prompts --out "$DATA" --batch-size 64 --max-new-tokens 256 \
    --max-minutes "${DATA_MINUTES:-50}"
# 2. Drafter + Domino head: reduced draft vocabulary, base-logit loss at every depth, 64 anchors per sequence.
# Without a runs/ folder, --resume-from continues the shipped weights at the step recorded in their
# training.json (the optimiser's moments start afresh); with one, training resumes from its local
# checkpoint, optimiser state included. The shipped weights stopped at step 20800 of this 22500-step
# cosine schedule (their training.json has the data, steps and losses; docs/default-model.md the
# recipe). To train further, raise DRAFTER_STEPS: the cosine is recomputed for the new length, so the
# learning rate rises again from the resumed step. Training rescans --data every 200 steps, so it can
# run beside step 1 on the other core.
.venv/bin/dartree train drafter --data "$DATA" --out runs/drafter-v2 --steps "${DRAFTER_STEPS:-22500}" \
    --draft-vocab 8192 --anchors 64 --seqs-per-step 1 --eval-every 200 \
    --resume-from dartree/assets/smollm2-drafter-domino \
    --max-minutes "${DRAFTER_MINUTES:-95}" --export dartree/assets/smollm2-drafter-domino
# 3. Markov head on the frozen backbone; the export writes only the head and reads the backbone
# from the Domino drafter's file (config.json names it: backbone_weights).
.venv/bin/dartree train markov --data "$DATA" --out runs/markov-v2 --init-drafter runs/drafter-v2/checkpoint \
    --steps "${MARKOV_STEPS:-450}" --lr 3e-3 --anchors 64 --seqs-per-step 1 --eval-every 150 --max-minutes "${MARKOV_MINUTES:-8}" \
    --export dartree/assets/smollm2-drafter-markov --export-backbone ../smollm2-drafter-domino/model.safetensors
