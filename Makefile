# Two commands on a fresh machine: `make run` and `make test`.
# Each creates or updates .venv in the repo root when pyproject.toml changes.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
# Three test processes on CI's two cores (many tests wait on a served API, a worker or a child
# process: two kept 1.55 cores busy, three 1.74, and the suite with PostgreSQL's tests took the
# time two took without them), each file's tests in one of them so that a module's fixtures (a
# served API, a compiled model) are made once. PYTEST_ARGS= runs it serially.
PYTEST_ARGS ?= -n 3 --dist loadfile

.PHONY: run test lint typecheck unit venv clean corpus corpus-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[service,dev]'
	rm -f $(VENV)/.installed-*
	touch $@

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/opfuse serve

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

test: lint typecheck
	TRITON_INTERPRET=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# The corpus's CPU leg (bench/corpus/README.md): export, compile and verify every row (or ROWS,
# comma-separated names or globs) in the interpreter and rewrite bench/corpus/expected.csv.
# CORPUS_JOBS=N runs N shards at once; CORPUS_ARGS passes more options (e.g. --timeout 600).
CORPUS_JOBS ?= 1
corpus: $(STAMP)
	set -e; pids=; for i in $$(seq 0 $$(($(CORPUS_JOBS) - 1))); do \
		PYTHONPATH=. TRITON_INTERPRET=1 $(BIN)/python -m bench.corpus.run --force \
			$(if $(ROWS),--rows '$(ROWS)') --shard $$i/$(CORPUS_JOBS) $(CORPUS_ARGS) & pids="$$pids $$!"; \
	done; for p in $$pids; do wait $$p; done

# The quick check (bench/corpus/README.md): export and plan each row (or ROWS) without compiling
# and compare its planned launches with expected.csv's; fails where a row differs. Writes nothing.
corpus-check: $(STAMP)
	PYTHONPATH=. $(BIN)/python -m bench.corpus.run --check-plans $(if $(ROWS),--rows '$(ROWS)') $(CORPUS_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
