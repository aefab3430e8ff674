"""Fixtures for trainer-side tests: real raas services (in-process, on real ports) with the multi-turn
``test.group`` handler, in front of a scripted vLLM-protocol policy whose sampled token IDs encode the
weights it is serving (``token // 1000``), so a test can tell which weights really produced each turn."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from raas.cli.inprocess import service_in_process
from raas.pipeline.config import ServiceConfig
from tests.doubles.group_handler import GroupScriptHandler
from tests.doubles.scripted_llm import Completion, CompletionRequest, ScriptedLLM
from tests.pipeline.conftest import RecordingSandboxManager, assert_no_leftovers


@dataclass
class Weights:
    """What the scripted policy 'serves'; a weight sync changes it while the services are paused."""

    version: int = 0

    def respond(self, req: CompletionRequest) -> Completion:
        n = req.max_tokens or 3
        ids = [1000 * self.version + (req.index % 100) * 3 + k for k in range(n)]
        return Completion(token_ids=ids, logprobs=[-0.25] * n, finish_reason="length")


@dataclass
class Stack:
    llm: ScriptedLLM
    weights: Weights
    urls: list[str] = field(default_factory=list)
    managers: list[RecordingSandboxManager] = field(default_factory=list)


StackFactory = Callable[..., Awaitable[Stack]]

HANDLER = {"test.group": "tests.doubles.group_handler:GroupScriptHandler"}


def instance(iid: str, **fields: Any) -> dict[str, Any]:
    return {"data_source": "test.group", "instance_id": iid, **fields}


@pytest.fixture
async def make_stack(tmp_path: Path) -> AsyncIterator[StackFactory]:
    """``await make_stack(services=1, capacity=None, **config)``: everything torn down and leak-checked."""
    async with contextlib.AsyncExitStack() as exits:
        made: list[Stack] = []

        async def make(services: int = 1, capacity: int | None = None, **overrides: Any) -> Stack:
            weights = Weights()
            llm = ScriptedLLM(weights.respond, capacity=capacity, tokens_per_s=200.0 if capacity else None)
            await exits.enter_async_context(llm)
            stack = Stack(llm=llm, weights=weights)
            for k in range(services):
                state = tmp_path / f"svc{len(made)}-{k}"
                manager = RecordingSandboxManager(state / "sandboxes")
                config = ServiceConfig(
                    state_dir=state,
                    llm_servers=[llm.url],
                    extra_handlers=HANDLER,
                    # No warm pools: these tests count the sandboxes jobs hold (pools start more ahead).
                    **{
                        "shutdown_grace_s": 0.0,
                        "run_workers": 16,
                        "llm_health_interval_s": 0,
                        "warm_pool": {"enabled": False},
                        **overrides,
                    },
                )
                url = await exits.enter_async_context(service_in_process(config, sandbox_manager=manager))
                stack.urls.append(url)
                stack.managers.append(manager)
            made.append(stack)
            return stack

        GroupScriptHandler.attempts.clear()
        yield make
    for stack in made:
        for manager in stack.managers:
            assert_no_leftovers(manager)
            await manager.close_all()
