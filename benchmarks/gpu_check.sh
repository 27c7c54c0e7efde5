#!/usr/bin/env bash
# The GPU path (issue 10) in one run, from the repository root of a machine with a CUDA
# GPU and Python (about 5 minutes on an H200; docs/gpu.md says how to run it):
#
#   1. what the machine has: GPU, torch/CUDA, transformers, peft, vllm
#   2. pytest -m gpu: bf16 learner on CUDA; vLLM group + log-probs + hot reload
#   3. actors on the GPU (transformers backend) write groups into a store
#   4. gagpo-learner --device cuda --precision bf16 trains on them: losses and the
#      behaviour/learner mismatch (mismatch_kl, mismatch_max_abs) are printed
#   5. throughput on one multi-turn workload (benchmarks/bench_vllm.py, 16 groups x 8 x 4
#      turns): bare vLLM with every prompt in one call (the saturating rate), bare vLLM a
#      call per group-turn and the gagpo vLLM backend on it (target >= 0.90), the actors
#      loop with K = 1, 4 and 16 groups in flight (target at K = 16: >= 0.8 of saturating),
#      the transformers backend; and the time of a hot reload into the running engine
#   6. publication and training state against update compute (issue 40,
#      benchmarks/bench_publish.py): random models of Qwen2.5-1.5B's and 7B's shapes built
#      on the GPU, 3 bf16 updates each (512 random tokens, AdamW), the learner's commit
#      path after each: update compute seconds, critical-path publication + state seconds,
#      bytes written (a shape whose versions and states the disk cannot hold is reported
#      as skipped: the 7B shape's AdamW state alone is 61 GB)
#
# Nothing is downloaded. Python packages the machine lacks travel as wheels in .whl/
# (benchmarks/gpu_wheels.sh fetches them on a machine with network); the repository is
# put on PYTHONPATH when gagpo is not installed. vLLM steps are reported as skipped where
# vllm is not installed. Output goes to $OUT (default: a new temporary folder):
# gpu_check.log, bench_vllm.json and bench_publish.json. Exit status 1 if any step failed.
#
#   bash benchmarks/gpu_check.sh            # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run  # anywhere: the same steps on the CPU, no bench

set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
DEVICE=cuda
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    DEVICE=cpu
fi
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
WORK=$(mktemp -d)
export GAGPO_CACHE="$WORK/cache"
failures=()
# shellcheck source=benchmarks/gpu_env.sh
source "$ROOT/benchmarks/gpu_env.sh"

step() {
    local name=$1
    shift
    local t0=$SECONDS
    echo "== $name"
    if "$@"; then
        echo "-- $name: ok ($((SECONDS - t0))s)"
    else
        echo "-- $name: FAILED ($((SECONDS - t0))s)"
        failures+=("$name")
    fi
}

machine() {
    if [ "$DRY_RUN" = 0 ]; then
        nvidia-smi -L || return 1
    fi
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda",
      torch.version.cuda, "| gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
for name in ("transformers", "peft", "vllm", "polars", "pydantic"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} not installed")
EOF
}

gpu_tests() {
    local files
    files=$(grep -l "mark.gpu" tests/test_*.py)
    # shellcheck disable=SC2086  # one argument per file
    "$PY" -m pytest -m gpu -q -p no:cacheprovider $files
}

actors() {
    "$PY" -m gagpo.actors.cli --store "$WORK/store" --policy tiny --env household --groups 4 \
        --group-size 8 --max-turns 4 --backend transformers --device "$DEVICE" --quiet
}

learner() {
    "$PY" -m gagpo.learner.cli --store "$WORK/store" --policy tiny --device "$DEVICE" \
        --precision bf16 --updates 2 --batch-groups 2 --idle-timeout 20 --poll-interval 0.2 \
        --quiet || return 1
    "$PY" - "$WORK/store" <<'EOF'
import sys
from gagpo.learner.metrics import read_metrics
from gagpo.storage.store import Store
m = read_metrics(Store(sys.argv[1])).sort("update")
print(m.select("update", "loss", "grad_norm", "tokens_per_s", "mismatch_kl", "mismatch_max_abs"))
assert m.height == 2 and m["loss"].is_finite().all()
EOF
}

bench() {
    if [ "$DRY_RUN" = 1 ]; then
        "$PY" benchmarks/bench_vllm.py --help >/dev/null
        return
    fi
    "$PY" benchmarks/bench_vllm.py --groups 16 --group-size 8 --max-turns 4 --max-new-tokens 64 \
        --repeats 3 --out "$OUT/bench_vllm.json"
}

publication() {
    if [ "$DRY_RUN" = 1 ]; then
        "$PY" benchmarks/bench_publish.py --device cpu --train-tokens 32 --settings after \
            --after-updates 3 --policy tiny
        return
    fi
    "$PY" benchmarks/bench_publish.py --device cuda --train-tokens 512 --settings after \
        --after-updates 3 --policy qwen2.5-1.5b-shape --policy qwen2.5-7b-shape \
        --json "$OUT/bench_publish.json"
}

step "setup" gpu_setup || true
step "machine" machine
step "pytest -m gpu" gpu_tests
step "actors on $DEVICE" actors
step "learner --device $DEVICE --precision bf16" learner
step "throughput: bare vllm (one call, per call), vllm backend, actors loop K=1/4/16, transformers" bench
step "publication + state vs update compute: Qwen2.5-1.5B and 7B shapes, bf16, 3 updates" publication

rm -rf "$WORK"
if [ ${#failures[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failures[*]} (log: $OUT/gpu_check.log)"
    exit 1
fi
echo "gpu_check: all steps ok (log: $OUT/gpu_check.log)"
