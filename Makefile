# Two entry points, as in the README: `make demo` and `make test`.
# Each creates .venv on first use and installs torch first, so a machine with
# the CPU wheel of torch 2.13.0 never pulls CUDA packages. GPU users:
#   make demo TORCH="torch --index-url https://download.pytorch.org/whl/cu124"
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test lint setup

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml package-lock.json
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[server,dev]"
	@# Dashboard charts (uPlot) and live updates (htmx) come from npm, pinned by
	@# package-lock.json; postinstall copies them into the app's static folder.
	@if command -v npm >/dev/null; then npm ci --no-audit --no-fund --loglevel=error; \
	else echo "warning: npm not found: the dashboard will have no charts; install Node.js and rerun 'make setup'"; fi
	touch $@

# The main job: a whole DiPaCo run on this machine (server, workers, summary).
demo: setup
	$(BIN)/dipaco demo

# The suite on TEST_WORKERS processes (pytest-xdist), each test file kept on one of them
# so its module-scoped servers start once; TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	@# The alert rules (deploy/prometheus); tests/test_prometheus_rules.py runs them too.
	@if command -v promtool >/dev/null; then promtool check rules deploy/prometheus/alerts.yml \
	  && promtool test rules deploy/prometheus/alerts_test.yml; \
	else echo "warning: promtool not found (apt-get install prometheus): alert rules unchecked"; fi
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
