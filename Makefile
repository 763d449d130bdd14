# Two commands: `make test` and `make demo`. Both set up .venv first (idempotent, fast when done).
PY := .venv/bin/python

.PHONY: venv test test-all demo lint
venv:
	@bash scripts/setup_venv.sh

test: venv
	$(PY) -m pytest -q tests

test-all: venv
	$(PY) -m pytest -q -m "" tests

demo: venv
	$(PY) -m megagrpo demo

lint: venv
	$(PY) -m ruff check megagrpo kernels tests benchmarks
