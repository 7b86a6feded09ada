# Every target sets itself up: a fresh clone needs only Python 3.11+ and these commands.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
export XDG_RUNTIME_DIR ?= $(CURDIR)/.runtime

.PHONY: demo test lint bench chaos clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(XDG_RUNTIME_DIR):
	mkdir -p -m 0700 $(XDG_RUNTIME_DIR)

demo: $(STAMP) | $(XDG_RUNTIME_DIR)
	$(BIN)/outbox demo $(ARGS)

test: $(STAMP) | $(XDG_RUNTIME_DIR)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP) | $(XDG_RUNTIME_DIR)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python -m benchmarks $(ARGS)

chaos: $(STAMP) | $(XDG_RUNTIME_DIR)
	$(BIN)/outbox chaos

clean:
	rm -rf $(VENV) .runtime .pytest_cache .mypy_cache .ruff_cache
