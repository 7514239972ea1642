# The README's commands. `make train` and `make test` work on a fresh machine: they create .venv,
# install torch==2.13.0 first (the CPU wheel on disk; a looser pin would fetch a CUDA build),
# then ftcore with its test extra.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXP ?= tiny_lora
PYTEST_ARGS ?=
# pytest-xdist workers. One process keeps ~1.3 of 2 cores busy (the suite also waits on process
# starts, gloo and SLURM's schedule). A file runs on one worker (--dist loadfile: its module
# fixtures are built once; tests/slurm starts one SLURM), files in collection order, the heavy
# multi-process ones first. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

.PHONY: setup train test test-fast lint format bench clean gpu-check gpu-wheels

setup: $(STAMP)

# pip compiles every installed module to bytecode on one core; compile_dir does it on all of them
# (the install 114 -> 88-101 s on 2 cores). Like pip, it skips a file that does not compile (torch
# ships some in Python 3.12 syntax) instead of failing.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile torch==2.13.0
	$(BIN)/python -m pip install -q --no-compile -e ".[test]"
	$(BIN)/python -c "import compileall, sysconfig; \
	  compileall.compile_dir(sysconfig.get_paths()['purelib'], quiet=2, workers=0)"
	touch $(STAMP)

train: $(STAMP)
	$(BIN)/python -m ftcore.train +exp=$(EXP)

# compileall: the suite starts hundreds of Python processes; where PYTHONDONTWRITEBYTECODE is set
# (as on this project's VMs) each would compile ftcore's modules again (~0.2 s of CPU apiece).
# Not ftcore/assets: its package data is every file in it (test_house builds the wheel).
test: $(STAMP)
	$(BIN)/python -m compileall -q -x /assets/ ftcore launch tests
	$(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

# lint-imports: the layers of docs/design.md (pyproject.toml's [tool.importlinter] contracts)
lint: $(STAMP)
	$(BIN)/ruff check ftcore tests launch tools
	$(BIN)/ruff format --check ftcore tests launch tools
	$(BIN)/lint-imports --no-cache

format: $(STAMP)
	$(BIN)/ruff format ftcore tests launch tools
	$(BIN)/ruff check --fix ftcore tests launch tools

bench: $(STAMP)
	$(BIN)/python -m ftcore.bench +bench=layouts_cpu

# GPU machine: the machine's own python3 and CUDA torch (no .venv, no torch pin); missing packages
# come from .whl/ offline. Without CUDA it exits 2 at once. Report: docs/gpu/<date>-<gpu>.md.
GPU_PY ?= python3
WHEELS ?= .whl
GPU_ARGS ?=  # e.g. --out DIR --work DIR --budget SECONDS (python3 tools/gpu_check.py -h)
gpu-check:
	@$(GPU_PY) tools/gpu_check.py --wheels $(WHEELS) $(GPU_ARGS)

# Networked machine: `make gpu-wheels PY=3.12` downloads those wheels for that Python into .whl/
# (pinned to the versions of .venv when it exists: the CPU-tested ones).
gpu-wheels:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,python3) tools/gpu_wheels.py --python $(if $(filter 3.%,$(PY)),$(PY),3.12) --dest $(WHEELS)

clean:
	rm -rf outputs .pytest_cache
