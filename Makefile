# Two commands on a fresh machine: `make run` and `make test`.
# Each creates or updates .venv in the repo root when pyproject.toml changes.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)

.PHONY: run test lint typecheck unit venv clean

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

# The interpreter's kernel tests (tests/unit) run in one test process per core, at most 4; then
# the service, worker, PostgreSQL and end-to-end tests one at a time: they start servers and wait
# on leases and heartbeats, which a machine loaded by other tests would stretch. With PYTEST_ARGS
# (say -k) a half that selects nothing (pytest's exit 5) is not a failure.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
SERIAL_TESTS := tests/deploy tests/e2e tests/gpu tests/reliability tests/service tests/unit/test_worker.py
SELECTED_NONE_OK := || { rc=$$?; [ $$rc -eq 5 ] && [ -n "$(PYTEST_ARGS)" ]; }

test: lint typecheck
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) tests/unit --ignore=tests/unit/test_worker.py \
		$(PYTEST_ARGS) $(SELECTED_NONE_OK)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest $(SERIAL_TESTS) $(PYTEST_ARGS) $(SELECTED_NONE_OK)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
