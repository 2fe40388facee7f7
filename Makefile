# spec-calibrate: `make quickstart` sets up and runs a small real calibration; `make test` runs the tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SHARED ?= ../shared
export CALIBRATE_TEST_MODELS ?= $(HOME)/.cache/calibrate-test-models

.PHONY: install models quickstart test test-fast clean

# torch first, pinned to the CPU build served locally; the project after it, so pip keeps that torch.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# Real small models (Qwen2.5-Coder 1.5B/0.5B, SmolLM2-135M, Gemma-3-270M); cached and idempotent.
# gguf/ keeps one .gguf file too, so loading a GGUF checkpoint is tested.
models: install
	$(PY) $(SHARED)/models/fetch-test-models.py
	$(PY) $(SHARED)/models/fetch-test-models.py --dest $(CALIBRATE_TEST_MODELS)/gguf --only smollm2-135m-instruct --keep-gguf

# The run alone is timed (setup above is not); a second `make quickstart` resumes and measures nothing.
quickstart: models
	time $(VENV)/bin/calibrate run examples/quickstart.toml --db tables/quickstart.duckdb

test: models
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache tables/*.duckdb
