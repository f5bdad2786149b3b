# Quick start:  make demo   (train on 8 simulated CPU devices)
#               make test   (the test suite)
# Both create .venv with everything from pyproject.toml on first use.
# Another interpreter: make test PYTHON=python3.12 VENV=.venv-py312
# make test-slow runs the slow tier, make test-all both tiers (tests/README.md).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# pytest-xdist workers for the suite: one per core, at most 4 (each simulates 8 devices).
JOBS ?= $(shell $(PYTHON) -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
PYTEST = $(BIN)/python -m pytest -n $(JOBS) --dist worksteal

.PHONY: venv demo test test-slow test-all lint format docs clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@$(BIN)/python -c "import jax, optax, sys; print('venv', sys.version.split()[0], 'jax', jax.__version__, 'optax', optax.__version__)"
	touch $@

demo: venv
	$(BIN)/python -m zeroshard.demo $(ARGS)

test: venv
	$(PYTEST) $(ARGS)

test-slow: venv
	$(PYTEST) -m slow $(ARGS)

test-all: venv
	$(PYTEST) -m "" $(ARGS)

lint: venv
	$(BIN)/ruff check zeroshard tests benchmarks examples notebooks
	$(BIN)/ruff format --check zeroshard tests benchmarks examples notebooks

format: venv
	$(BIN)/ruff format zeroshard tests benchmarks examples notebooks
	$(BIN)/ruff check --fix zeroshard tests benchmarks examples notebooks

# The documentation site: Sphinx + myst-nb from docs/, offline, warnings as errors,
# into build/docs/html (git-ignored), with the notebooks executed first. Installs the docs extra into the venv once.
$(VENV)/.docs-installed: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[docs]"
	touch $@

docs: venv $(VENV)/.docs-installed
	$(BIN)/python docs/execute_notebooks.py
	$(BIN)/sphinx-build -b html -E -W --keep-going -q -d build/docs/doctrees docs build/docs/html
	@echo "docs: built with no warnings (-W) -> build/docs/html/index.html"

clean:
	rm -rf .venv .venv-* .pytest_cache .ruff_cache .cache *.egg-info
