#!/usr/bin/env bash
# benchmarks/learning/capacity.py on a lent GPU machine, from the repository root:
# the household warm start (small room, pick-and-place) for three policy shapes at once.
# The demonstrations are recorded beforehand on any machine and carried in
# benchmarks/learning/runs/capacity/demos (they depend only on the environment and the
# `tiny` tokenizer):
#
#   python benchmarks/learning/capacity.py --env household \
#       --options '{"room": "small", "goals": ["pick_place"]}' --shapes "" --demos 3072 \
#       --max-turns 15 --history-window 1 --out benchmarks/learning/runs/capacity
#   bash benchmarks/learning/capacity_gpu.sh          # on the GPU machine
#
# SHAPES, DEMOS and EVAL_GROUPS override the defaults (a quick dry run: DEMOS=64 EVAL_GROUPS=2).
# capacity.json is copied to $OUT after each shape (a run cut short keeps what finished).

set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 GAGPO_CACHE="$WORK/cache"
# shellcheck source=benchmarks/gpu_env.sh
source "$ROOT/benchmarks/gpu_env.sh"
gpu_setup || exit 1

RUN="$WORK/capacity"
mkdir -p "$RUN" "$OUT"
cp -r benchmarks/learning/runs/capacity/demos "$RUN/demos" || exit 1
(while sleep 5; do cp "$RUN/capacity.json" "$OUT/" 2>/dev/null; done) &
copier=$!
"$PY" benchmarks/learning/capacity.py --env household \
    --options '{"room": "small", "goals": ["pick_place"]}' --shapes "${SHAPES:-2x64,4x256,6x384}" \
    --demos "${DEMOS:-3072}" --max-turns 15 --history-window 1 --eval-groups "${EVAL_GROUPS:-32}" \
    --jobs 3 --out "$RUN" \
    2>&1 | grep -v "it/s\]" | tee "$OUT/capacity.log"
status=${PIPESTATUS[0]}
kill "$copier"
cp "$RUN/capacity.json" "$OUT/" 2>/dev/null
rm -rf "$WORK"
exit "$status"
