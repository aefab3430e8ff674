"""The scripted vLLM-protocol policy server for tests and benchmarks. It ships in the package as
:mod:`raas.llm.scripted` (the server behind ``raas run --policy replay``); this module keeps the import
path and ``python -m tests.doubles.scripted_llm`` the tests and benchmarks use."""

from __future__ import annotations

from raas.llm.scripted import (
    MODEL_NAME,
    Completion,
    CompletionRequest,
    Responder,
    ScriptedLLM,
    fixed,
    main,
    replay,
)

__all__ = [
    "MODEL_NAME",
    "Completion",
    "CompletionRequest",
    "Responder",
    "ScriptedLLM",
    "fixed",
    "main",
    "replay",
]

if __name__ == "__main__":
    main()
