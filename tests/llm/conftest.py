"""Shared LLM-test fixtures: the prepared SmolLM2 tokenizer, fixture-template tokenizers, and real
llama-server processes started once per test session."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from raas.llm.embedded import EmbeddedServer
from raas.llm.models import default_tokenizer_dir, prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer

FIXTURES = Path(__file__).parent / "fixtures"

# Llama-3's pre-tokenizer split (newline runs are their own pre-token); the fixture reuses SmolLM2's
# vocabulary with it so the Llama-3 template is exercised with Llama-3 boundary behaviour.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# name -> (special tokens, plain added tokens, bos, eos, pre-tokenizer override)
TEMPLATE_FIXTURES: dict[str, tuple[list[str], list[str], str | None, str, str | None]] = {
    "qwen2_5": (
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        None,
        "<|im_end|>",
        None,
    ),
    "qwen3": (
        ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        None,
        "<|im_end|>",
        None,
    ),
    "llama3": (
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        [],
        "<|begin_of_text|>",
        "<|eot_id|>",
        _LLAMA3_SPLIT,
    ),
}


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The embedded model's tokenizer dir, prepared at install time (``raas llm prepare``)."""
    path = default_tokenizer_dir()
    if not (path / "tokenizer.json").is_file():
        if importlib.util.find_spec("torch") is None:
            pytest.fail("run `raas llm prepare` (needs torch==2.13.0) before the LLM tests")
        prepare_tokenizer()
    return path


@pytest.fixture(scope="session")
def smol(smol_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def fixture_dir(smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Build a tokenizer dir for a fixture template: SmolLM2's vocabulary plus the template's special
    tokens (the point is the template logic, not the vocabulary)."""
    root = tmp_path_factory.mktemp("templates")

    def build(name: str) -> Path:
        out = root / name
        if out.exists():
            return out
        special, plain, bos, eos, split = TEMPLATE_FIXTURES[name]
        out.mkdir()
        tok = Tokenizer.from_file(str(smol_dir / "tokenizer.json"))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
        tok.save(str(out / "tokenizer.json"))
        if split is not None:
            data = json.loads((out / "tokenizer.json").read_text())
            data["pre_tokenizer"] = {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
                    {
                        "type": "ByteLevel",
                        "add_prefix_space": False,
                        "trim_offsets": True,
                        "use_regex": False,
                    },
                ],
            }
            (out / "tokenizer.json").write_text(json.dumps(data))
        config = {
            "chat_template": (FIXTURES / f"{name}.jinja").read_text(),
            "eos_token": eos,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        }
        if bos:
            config["bos_token"] = bos
        (out / "tokenizer_config.json").write_text(json.dumps(config))
        return out

    return build


def _threads() -> int:
    return int(os.environ.get("RAAS_TEST_LLAMA_THREADS", "1"))  # CI shares its cores with the tests


async def _llama_server() -> AsyncIterator[str]:
    server = EmbeddedServer(parallel=4, ctx_per_slot=1024, threads=_threads())
    await server.start()
    try:
        yield server.url
    finally:
        await server.stop()
    assert not server.running


@pytest.fixture(scope="session")
async def llama_url() -> AsyncIterator[str]:
    """One real llama-server with SmolLM2 for the whole session."""
    async for url in _llama_server():
        yield url


@pytest.fixture(scope="session")
async def llama_url_b() -> AsyncIterator[str]:
    """A second real llama-server, for balancing across two."""
    async for url in _llama_server():
        yield url
