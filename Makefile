# flotilla: the two commands are `make demo` and `make test`; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flotilla-installed

.PHONY: setup demo test lint test-all bench-quick clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/flotilla run examples/demo.yaml --report runs/demo

# static checks: lint + format (one line length, pyproject [tool.ruff]) and types ([tool.mypy])
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Tests run in TEST_JOBS processes (pytest-xdist, one test file per process at a time: a file's
# module fixtures run once); the suite waits for events, not durations, so it passes as well with
# TEST_JOBS=1 (serial) or on a busier machine.  pytest exit code 5 (no tests) is a failure.
TEST_JOBS ?= 2
XDIST := -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

test: lint
	@$(PY) -m pytest -q $(XDIST) --durations=25 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

test-all: setup
	$(PY) -m pytest -q $(XDIST) -m "slow or not slow" tests

bench-quick: setup
	$(PY) benchmarks/ssgd_vs_ddp.py --quick

clean:
	rm -rf runs .pytest_cache .hypothesis
