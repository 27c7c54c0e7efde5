# Sourced by the scripts run on a lent GPU machine (gpu_check.sh, learning/capacity_gpu.sh):
# `gpu_setup` makes gagpo importable there without network. Python packages the machine
# lacks are installed from the wheels in .whl/ (benchmarks/gpu_wheels.sh fetches them on a
# machine with network) into $WORK/site; the repository's layer folders are linked under the
# gagpo namespace when gagpo is not installed. Needs ROOT (the checkout), WORK (a scratch
# folder) and PY (the Python to use).

gpu_setup() {
    if ! "$PY" -c "import pydantic, polars, ulid, zarr" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$WORK/site" .whl/*.whl || return 1
        export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if ! "$PY" -c "import gagpo.learner.cli" 2>/dev/null; then
        # Not installed: the layer folders, under the gagpo namespace, from this checkout.
        mkdir -p "$WORK/src/gagpo"
        for layer in schemas actors pipeline learner workflows; do
            ln -s "$ROOT/$layer" "$WORK/src/gagpo/$layer"
        done
        export PYTHONPATH="$WORK/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "import gagpo.learner.cli, gagpo.actors.cli"
}

