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

.PHONY: venv test test-all test-portable report zoo lint bench docs clean

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

# The tests that touch numerics once per CPU capability this machine can emulate (ATEN_CPU_CAPABILITY default,
# avx2, then the machine's own; MKL and oneDNN held to the same instruction set): a result pinned to one CPU's
# rounding fails here before it fails on another machine (docs/testing.md).
test-portable: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m tools.portable_tests -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

test-all: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

report: venv
	$(BIN)/phaselens report --out report

# Retrain every zoo model from scratch, then regenerate docs/zoo.md from the new cards.
zoo: venv
	$(BIN)/python -m tools.train_zoo
	$(BIN)/python -m tools.gen_zoo_docs

# Regenerate the generated pages and the notebooks from what is on disk (zoo cards, docs/data/*.json,
# benchmarks/results/*.json); nothing is retrained or re-measured. docs/repair.md reruns its evaluations
# (`$(BIN)/python -m tools.gen_repair_docs`, cached in runs/repair_docs; over an hour on 2 cores uncached),
# so it is left out.
docs: venv
	$(BIN)/python -m tools.gen_zoo_docs
	$(BIN)/python -m tools.gen_benchmarks_doc
	$(BIN)/python -m tools.make_notebooks

lint: venv
	$(BIN)/ruff check .

bench: venv
	$(BIN)/python -m benchmarks.bench_model

clean:
	rm -rf $(VENV) report .pytest_cache
