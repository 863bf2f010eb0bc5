#!/usr/bin/env bash
# Reproduce the drafters shipped in dartree/assets/ for SmolLM2-135M-Instruct (2-core CPU recipe).
# Each step resumes from its checkpoint when run again; --max-minutes stops a step cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
.venv/bin/dartree train data --prompts ../shared/prompts --out runs/data \
    --num-prompts 1536 --batch-size 48 --max-new-tokens 256 --max-minutes "${DATA_MINUTES:-24}"
.venv/bin/dartree train drafter --data runs/data --out runs/drafter --steps "${DRAFTER_STEPS:-900}" \
    --max-minutes "${DRAFTER_MINUTES:-40}" --export dartree/assets/smollm2-drafter-domino
.venv/bin/dartree train markov --data runs/data --out runs/markov --init-drafter runs/drafter/checkpoint \
    --steps "${MARKOV_STEPS:-300}" --max-minutes "${MARKOV_MINUTES:-12}" --export dartree/assets/smollm2-drafter-markov
