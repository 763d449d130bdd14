# Two commands: `make test` and `make demo`. Both set up .venv first (idempotent, fast when done).
PY := .venv/bin/python

.PHONY: venv test test-all demo lint
venv:
	@bash scripts/setup_venv.sh

# the suite's processes (pytest-xdist): each takes whole test modules, or the modules of one
# shared launch (tests/conftest.py); TEST_WORKERS=1 runs it in this process
TEST_WORKERS ?= 2
XDIST = $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

test: venv
	$(PY) -m pytest -q $(XDIST) tests

test-all: venv
	$(PY) -m pytest -q -m "" tests

demo: venv
	$(PY) -m megagrpo demo

lint: venv
	$(PY) -m ruff check megagrpo kernels tests benchmarks
