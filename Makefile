# phaselens: set-up, tests and the report. Everything installs from this repository's own files.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Test workers (pytest-xdist, one thread each); CI has 2 cores. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
export OMP_NUM_THREADS ?= 2

.PHONY: venv test test-all report zoo lint bench docs clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU torch first: a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/python -c "import transformers; transformers.DeepseekV4Config; import phaselens"
	@if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then git config core.hooksPath hooks; fi
	touch $(STAMP)

test: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow" -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-all: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

report: venv
	$(BIN)/phaselens report --out report

zoo: venv
	$(BIN)/python scripts/train_zoo.py
	$(BIN)/python scripts/gen_zoo_docs.py

lint: venv
	$(BIN)/ruff check .

bench: venv
	$(BIN)/python benchmarks/bench_model.py

clean:
	rm -rf $(VENV) report .pytest_cache
