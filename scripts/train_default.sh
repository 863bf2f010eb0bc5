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
# 1b. The target answers the expanded prompt set too (20 permissively licensed files, every category;
# a held-out split of 40 prompts per file is never answered). Resumes at the first missing shard; the
# committed shards are what the shipped drafter saw, so by default (EXPANDED_MINUTES=0) none are added.
.venv/bin/dartree train data --prompt-set expanded --prompts ../shared/prompts --out data/smollm2-expanded \
    --batch-size 64 --max-new-tokens 256 --slots 64 --max-minutes "${EXPANDED_MINUTES:-0}"
# 2. Drafter + Domino head on both data folders: each step draws a category uniformly, then one of its
# sequences (math is 45 % of the sequences, writing 1 %); Alpaca's sequences (CC BY-NC) are never
# trained on; each category's first sequences are held out and evaluated apart (loss, and tau by
# replay of the decoder's round). Without a runs/ folder, --resume-from continues the shipped weights
# at the step recorded in their training.json (the optimiser's moments start afresh; the cosine is
# recomputed for --steps, so the learning rate rises again from the resumed step: --lr is the peak of
# that lengthened schedule); with one, training resumes from its local checkpoint, optimiser state
# included. Training rescans --data every 200 steps, so it can run beside step 1b on the other core.
.venv/bin/dartree train drafter --data "$DATA,data/smollm2-expanded" --out runs/drafter-v3 --steps "${DRAFTER_STEPS:-25600}" \
    --lr 3e-3 --draft-vocab 8192 --anchors 64 --seqs-per-step 1 --eval-every 400 \
    --resume-from dartree/assets/smollm2-drafter-domino \
    --max-minutes "${DRAFTER_MINUTES:-95}" --export dartree/assets/smollm2-drafter-domino
# 3. Markov head on the frozen backbone (step 2 exported it, so the shipped Domino drafter is the
# backbone trained on); the export writes only the head and reads the backbone from the Domino
# drafter's file (config.json names it: backbone_weights). 1,800 steps take about 61 min on one thread.
.venv/bin/dartree train markov --data "$DATA,data/smollm2-expanded" --out runs/markov-v4 --init-drafter dartree/assets/smollm2-drafter-domino \
    --steps "${MARKOV_STEPS:-1800}" --lr 3e-3 --anchors 64 --seqs-per-step 1 --eval-every 600 --max-minutes "${MARKOV_MINUTES:-70}" \
    --export dartree/assets/smollm2-drafter-markov --export-backbone ../smollm2-drafter-domino/model.safetensors
