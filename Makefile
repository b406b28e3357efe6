# The two commands the README promises: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS ?= dev,examples,platform,optuna,docs,transformers
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: install horovod check lint typecheck docs test test-slow test-gpu demo demo-local bench clean up down deploy

# setuptools ends every editable install of this flat layout with an "Editable installation"
# notice (a BuildBackendWarning that is no problem here): the install filters that one out.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# Horovod 0.28.1 against the venv's torch (recipe in ../shared/FACTS.md); the built wheel is
# cached under ~/.cache/det_tasks/wheels, so a second install takes seconds.
horovod: install
	PYTHON=$(BIN)/python bash infra/build_horovod.sh

SOURCES := det_tasks registry cluster flows det_cli infra tests bench examples

lint: install
	$(BIN)/ruff check $(SOURCES) docs
	$(BIN)/ruff format --check $(SOURCES) docs
	$(BIN)/lint-imports --no-cache  # the layer contracts in pyproject.toml

typecheck: install
	$(BIN)/mypy

# The docs site (mkdocs.yml): strict, so a broken link, a missing page, a stale generated
# reference or a docstring mkdocstrings cannot render fails the build; output in site/.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

check: lint typecheck docs

# Depends on horovod: the README promises the distributed tests on both backends, so a fresh
# clone builds Horovod once (~12 min on 2 cores; the cached wheel makes later runs instant)
# instead of skipping its 4 tests.
test: install horovod
	$(BIN)/python -m pytest -m "not slow and not gpu" -q --durations=25

test-slow: install
	$(BIN)/python -m pytest -m "slow and not gpu" -q --durations=25

test-gpu: install
	$(BIN)/python -m pytest -m gpu -q

# The main job: start the stack (which registers the deployments), run experiment/const
# through a real Prefect server + worker, and say where to look. DO_NOT_TRACK: no telemetry
# notice from Prefect's first import in a terminal (as det sets it).
demo: install
	$(BIN)/python -m infra.stack up
	. .stack/env && PREFECT_HOME=$(CURDIR)/.stack/prefect DO_NOT_TRACK=$${DO_NOT_TRACK:-1} $(BIN)/prefect deployment run experiment/const --watch
	. .stack/env && $(BIN)/det-tasks checkpoints mnist-const
	@echo "Prefect UI: http://127.0.0.1:4200   MLflow UI: http://127.0.0.1:5001/#/experiments?workflowType=machine_learning   (make down to stop)"

demo-local: install
	$(BIN)/det-tasks run examples/mnist/const.yaml

bench: install
	$(BIN)/python bench/harness_overhead.py

# The stack on 127.0.0.1, with prefect.yaml's deployments registered (skipped when the server
# already has them as they are), and .stack/env: the clients' settings and det on PATH.
up: install
	$(BIN)/python -m infra.stack up

down: install
	$(BIN)/python -m infra.stack down

# Registers prefect.yaml's deployments again, whether or not they changed.
deploy: install
	$(BIN)/python -m infra.stack deploy

clean:
	rm -rf checkpoints runs site .pytest_cache .mypy_cache .ruff_cache
