# minipar — every target builds and uses a local virtual environment in .venv.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: all setup train test test-slow lint bench clean

all: test

# The environment is rebuilt only when the package metadata or the pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The main job on the embedded default: a small Llama on CPU, 2 data-parallel ranks, built-in data.
train: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 2 scripts/train.py --dp 2

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The full 4D layout on 16 ranks through train.py: minutes on a laptop, so not in `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

lint: $(STAMP)
	$(BIN)/ruff check minipar scripts tests

bench: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 2 scripts/bench_dp.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
