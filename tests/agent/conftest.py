"""Fixtures for agent-loop tests: the real SmolLM2 chat tokenizer and a real local sandbox whose manager
asserts at teardown that nothing was left behind."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer
from raas.sandbox import Sandbox, SandboxManager
from raas.sandbox.config import make_config


@pytest.fixture(scope="session")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(prepare_tokenizer())


@pytest.fixture
async def sandbox(sandbox_manager: SandboxManager) -> AsyncIterator[Sandbox]:
    sb = await sandbox_manager.start(make_config(backend="local"), owner="agent-test")
    try:
        yield sb
    finally:
        await sb.close()
