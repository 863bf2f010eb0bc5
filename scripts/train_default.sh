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
# A new session has no runs/ folder: --resume-from continues the shipped weights at the step in their
# training.json (the optimiser's moments start afresh). Session 5 ran steps 1-2808 of a 6000-step
# schedule on 9 shards; session 6 continued it to step 6665 of a 7600-step schedule on 25 shards (the cosine is
# recomputed for the new length; bf16 autocast and the feature cache make a step ~2x cheaper); session 7 ran
# 6665-6800 (7600 schedule), 6800-8000 (9800 schedule, beside a 2-layer trial: --layers 2 grows the resumed
# drafter) and 8000-11400 (11400 schedule) while `dartree train data` wrote shards 27-39 on the other core
# (training rescans --data every 200 steps); session 8 ran 11400-16200 of an 18000-step schedule (stopped
# there, at 3 % of the peak rate) while the data job wrote shards 45-86; session 9 ran 16200-18400 of a
# 20400-step schedule (from its local run folder, optimiser state included) while the data job wrote
# shards 102-141, and stopped there: the held-out numbers had flattened; session 10 ran 18400-20800 of a
# 22500-step schedule while the data job wrote the last shards (176-194). To continue, raise DRAFTER_STEPS: the
# cosine is recomputed for the new length, so the learning rate rises again from the resumed step.
.venv/bin/dartree train drafter --data "$DATA" --out runs/drafter-v2 --steps "${DRAFTER_STEPS:-22500}" \
    --draft-vocab 8192 --anchors 64 --seqs-per-step 1 --eval-every 200 \
    --resume-from dartree/assets/smollm2-drafter-domino \
    --max-minutes "${DRAFTER_MINUTES:-95}" --export dartree/assets/smollm2-drafter-domino
# 3. Markov head on the frozen backbone.
.venv/bin/dartree train markov --data "$DATA" --out runs/markov-v2 --init-drafter runs/drafter-v2/checkpoint \
    --steps "${MARKOV_STEPS:-450}" --lr 3e-3 --anchors 64 --seqs-per-step 1 --eval-every 150 --max-minutes "${MARKOV_MINUTES:-8}" \
    --export dartree/assets/smollm2-drafter-markov
