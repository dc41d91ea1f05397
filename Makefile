# minipar — every target builds and uses a local virtual environment in .venv.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: all setup train train-ft test test-integration test-kernels test-slow test-gpu bench-gpu lint bench clean docs-check exercise

all: test

# The environment is rebuilt only when the package metadata or the pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The main job on the embedded default: a small Llama on CPU, 2 data-parallel ranks, built-in data.
# Through train.py's own launcher (torchrun's agent in-process: Ctrl-C ends in the run's one line);
# more flags in ARGS, e.g. make train ARGS="--steps 50"; the stop line's command keeps them.
train: $(STAMP)
	MINIPAR_MAKE_ARGS='$(ARGS)' $(BIN)/python scripts/train.py --standalone --nproc-per-node 2 --dp 2 $(ARGS)

# Fault tolerance on torchft (docs/10b_fault_tolerance.md): the lighthouse and two replica groups of
# one rank; group 1 is killed (once while it takes the survivor's state) and rejoins. About 20 s.
train-ft: $(STAMP)
	$(BIN)/python scripts/train_ft.py --kill-at 10,40 --kill-in-transfer

# Two tiers, every property in the first (README, "Tests"): `make test` runs the cheap tests and one
# representative layout of each property (minutes); `make test-integration` the rest of each layout
# matrix and the train.py runs in subprocesses (torchrun, restarts, timeouts). .ci/run runs both.
# Each target names its markers: a -m on the command line replaces pyproject's addopts' -m.
test: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not slow and not integration' tests --ignore=tests/gpu

test-integration: $(STAMP)
	$(BIN)/python -m pytest -q -m 'integration and not slow' tests --ignore=tests/gpu

# The float32 comparisons (marked float32) again on ATen's plain C++ kernels, not this CPU's vector
# ones: each sums in another order, so a tolerance tuned to one machine's kernels fails here first.
# Both tiers' float32 tests (CI runs it after them): every layout's tolerance, not only the fast ones.
test-kernels: $(STAMP)
	ATEN_CPU_CAPABILITY=default $(BIN)/python -m pytest -q -m 'float32 and not slow' tests --ignore=tests/gpu

# The course checks itself: each chapter's captured output (step scripts and train.py logs) against
# a fresh run, and every line anchor against its definition (minutes: not in `make test`).
docs-check: $(STAMP)
	$(BIN)/python scripts/tools/docs_check.py

# The full 4D layout on 16 ranks through train.py: minutes on a laptop, so not in `make test`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

# GPU checks use the Python that has CUDA torch: .venv's if there is one, else python3 (GPU_PY=...).
# Without CUDA both say "no GPU" and exit 0. Neither is part of `make test`.
GPU_PY  ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)

# NCCL collectives; DP, ZeRO 1-3, TP, PP (1F1B, ZB-V, interleaved), CP and EP against one GPU in
# float64; the estimator's bf16 figures against CUDA memory and the ledger; bf16 against fp32 over
# 50 steps; the largest layout; a report. Each test skips, saying why, when too few GPUs are here.
test-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -q -p no:cacheprovider tests/gpu

# 125m and 1b, bf16, seq 2048: minipar against PyTorch's own per strategy (DDP, ZeRO optimizer, FSDP2,
# DTensor TP, torch.distributed.pipelining, context_parallel); appends to docs/benchmarks.md.
# More flags for scripts/bench/bench_gpu.py in ARGS, e.g. make bench-gpu ARGS="--models 1b --strategies dp".
bench-gpu:
	PYTHONPATH=$(CURDIR) $(GPU_PY) scripts/bench/bench_gpu.py --compile --fused-adamw --append docs/benchmarks.md $(ARGS)

# The exercises of docs/exercises/: make exercise N=3.1 (chapter 3, exercise 1) checks
# docs/exercises/ex3_1_*.py against one device or the library's own figure (seconds); make exercise
# lists them. make exercise-3.1 is the same as N=3.1.
exercise: $(STAMP)
	PYTHONPATH=$(CURDIR) $(BIN)/python tests/exercises/run.py $(N)

exercise-%: $(STAMP)
	PYTHONPATH=$(CURDIR) $(BIN)/python tests/exercises/run.py $*

# ruff for style, mypy for types (configured in pyproject.toml): arguments are what signatures say.
lint: $(STAMP)
	$(BIN)/ruff check minipar scripts tests
	$(BIN)/mypy minipar

bench: $(STAMP)
	$(BIN)/torchrun --standalone --nproc-per-node 2 scripts/bench/bench_dp.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
