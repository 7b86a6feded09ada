# Every target sets itself up: a fresh clone needs only Python 3.11+ and these commands.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The oldest ORM versions supported: tests/contrib also runs on them, in a venv of its own.
COMPAT       := .venv-compat
COMPAT_STAMP := $(COMPAT)/.installed
COMPAT_PINS  := 'sqlalchemy[asyncio]==2.0.*' 'django==4.2.*'
export XDG_RUNTIME_DIR ?= $(CURDIR)/.runtime
# Three test processes, a file each at a time (a module's fixtures are set up once): the
# suite often waits on real servers, processes and leases, so on two cores a third process
# fills the waits (the main suite 529 to 561 s against 747 with two, measured on the
# same tree). PYTEST_PARALLEL= runs it in one.
PYTEST_PARALLEL ?= -n 3 --dist loadfile

.PHONY: demo test test-compat test-pg15 dist lint bench chaos clean docs docs-serve docs-screenshots

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# The distribution was named outbox before outbox-pg: a venv still holding that
	@# install would register the pytest plug-ins and the commands twice.
	$(BIN)/python -m pip uninstall --quiet --yes outbox 2>/dev/null || true
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

$(COMPAT_STAMP): pyproject.toml
	$(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install --quiet --upgrade pip
	$(COMPAT)/bin/python -m pip uninstall --quiet --yes outbox 2>/dev/null || true
	$(COMPAT)/bin/python -m pip install --quiet -e '.[dev]' $(COMPAT_PINS)
	touch $(COMPAT_STAMP)

$(XDG_RUNTIME_DIR):
	mkdir -p -m 0700 $(XDG_RUNTIME_DIR)

demo: $(STAMP) | $(XDG_RUNTIME_DIR)
	$(BIN)/outbox demo $(ARGS)

test: $(STAMP) | $(XDG_RUNTIME_DIR)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest $(PYTEST_PARALLEL)
	$(MAKE) --no-print-directory docs
	$(MAKE) --no-print-directory dist
	$(MAKE) --no-print-directory test-compat

# The ORM integrations on SQLAlchemy 2.0 and Django 4.2 LTS (the main suite has the newest).
test-compat: $(COMPAT_STAMP) | $(XDG_RUNTIME_DIR)
	@$(COMPAT)/bin/python -c "import django, sqlalchemy; print('tests/contrib on SQLAlchemy', \
	    sqlalchemy.__version__, 'and Django', django.__version__)"
	$(COMPAT)/bin/python -m pytest tests/contrib -q -p no:cacheprovider $(PYTEST_PARALLEL)

# The core of the suite on Debian's PostgreSQL 15 (apt-get install postgresql-15; .ci/run
# installs it), in a throwaway cluster (tests/callers/cluster.py): enqueue from Python and
# SQL, the dispatcher sync and async, migrations (online too), the crash windows, claim
# races, hooks, limits and the inbox. About a minute in three processes.
PG15_BIN   ?= /usr/lib/postgresql/15/bin
PG15_TESTS := tests/callers tests/integration/test_enqueue.py \
	tests/integration/test_dispatcher.py tests/integration/test_async_dispatcher.py \
	tests/integration/test_migrate.py tests/integration/test_online_migrate.py \
	tests/integration/test_shipped_sql.py tests/integration/test_effect_windows.py \
	tests/integration/test_inbox.py tests/crash/test_windows.py \
	tests/crash/test_claim_races.py tests/flows/test_hooks.py \
	tests/limits/test_add_limits.py tests/groups/test_group_limits.py
test-pg15: $(STAMP) | $(XDG_RUNTIME_DIR)
	$(BIN)/python -m tests.callers.cluster $(PG15_BIN) -- \
	    $(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_PARALLEL) $(PG15_TESTS)

# The release check: the sdist and the wheel as they would be uploaded, their metadata and
# README checked as PyPI checks them. Offline, a few seconds.
dist: $(STAMP)
	rm -rf dist
	$(BIN)/hatchling build -d dist
	$(BIN)/twine check --strict dist/*

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP) | $(XDG_RUNTIME_DIR)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	$(BIN)/python -m benchmarks $(ARGS)

# The docs site (docs/, mkdocs.yml) into site/: offline, warnings are errors (about 5 s).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Retake the dashboard screenshots of the docs in chromium, from the tests' own runs.
docs-screenshots: $(STAMP) | $(XDG_RUNTIME_DIR)
	OUTBOX_DOCS_SCREENSHOTS=1 $(BIN)/python -m pytest tests/docs/test_tutorial.py -q
	OUTBOX_SCREENSHOTS=docs/images $(BIN)/python -m pytest tests/web/test_browser.py -q \
	    -k "test_the_overview_renders or test_the_picker_switches_between_targets"

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

chaos: $(STAMP) | $(XDG_RUNTIME_DIR)
	$(BIN)/outbox chaos

clean:
	rm -rf $(VENV) $(COMPAT) site dist .runtime .pytest_cache .mypy_cache .ruff_cache
