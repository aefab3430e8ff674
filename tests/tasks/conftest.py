"""Fixtures for task tests: the real SmolLM2 chat tokenizer (the embedded model's)."""

from __future__ import annotations

import pytest

from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer


@pytest.fixture(scope="session")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(prepare_tokenizer())


# The live HTTP service (uvicorn on a port, the real RolloutService) from the API tests.
from tests.api.conftest import make_api  # noqa: E402, F401
from tests.pipeline.conftest import script_handler  # noqa: E402, F401
