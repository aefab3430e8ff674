"""Fixtures for task tests: the real SmolLM2 chat tokenizer (the embedded model's)."""

from __future__ import annotations

import pytest

from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer


@pytest.fixture(scope="session")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(prepare_tokenizer())
