"""Through the real service: an inference read timeout and a verifier timeout are typed (``llm_timeout``,
``verifier_timeout``), end the job as ``failed`` and filtered, never as the job-budget ``timeout`` and never
with a reward. Real service, ledger and local sandboxes; a raw-socket vLLM double that never answers; the
scripted policy server; math-verify in its worker process."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from raas.llm.balancer import LLMBalancer
from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from raas.tasks import verify
from raas.tasks.math import MathHandler
from tests.agent.scripted import completions, tool_call
from tests.doubles.handlers import script_registry
from tests.doubles.scripted_llm import ScriptedLLM, replay
from tests.llm.wire_doubles import HeldVLLM
from tests.pipeline.conftest import RecordingSandboxManager, assert_no_leftovers, script, submit

pytestmark = pytest.mark.integration

Factory = Callable[..., Awaitable[RolloutService]]


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(prepare_tokenizer())


@pytest.fixture
async def service_with(tmp_path: Path, script_handler: Any) -> AsyncIterator[Factory]:
    """``await service_with(balancer, tokenizer=None)``: a started service on ``balancer``; shut down and
    leak-checked at teardown."""
    made: list[tuple[RolloutService, RecordingSandboxManager, LLMBalancer]] = []

    async def make(balancer: LLMBalancer, tokenizer: ChatTokenizer | None = None) -> RolloutService:
        state = tmp_path / f"svc{len(made)}"
        manager = RecordingSandboxManager(state / "sandboxes")
        svc = RolloutService(
            ServiceConfig(state_dir=state, shutdown_grace_s=0.0),
            sandbox_manager=manager,
            balancer=balancer,
            tokenizer=tokenizer,
            handlers=script_registry(),
        )
        await svc.start()
        made.append((svc, manager, balancer))
        return svc

    yield make
    for svc, manager, balancer in made:
        await svc.shutdown(0)
        assert_no_leftovers(manager)
        await manager.close_all()
        await balancer.aclose()


async def test_an_llm_read_timeout_is_llm_timeout_failed_and_filtered(service_with: Factory) -> None:
    async with HeldVLLM(hold={"/v1/completions"}) as silent:
        balancer = LLMBalancer(request_timeout_s=1.0, retries=0, health_interval_s=0)
        balancer.add(silent.url)
        svc = await service_with(balancer)
        job_id = await submit(svc, script(run={"generate": [1, 2, 3]}), timeout_s=600)
        result = await svc.wait(job_id, 60)
    assert result is not None and silent.received.is_set()
    assert result.error is not None and (result.error.stage, result.error.kind) == ("run", "llm_timeout")
    assert result.status == "failed" and result.filter and result.reward is None


async def test_a_hung_verifier_is_verifier_timeout_failed_and_filtered(
    service_with: Factory, tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy submits an answer sympy evaluates for minutes; the next job is scored normally."""
    monkeypatch.setattr(MathHandler, "verify_timeout_s", 2.0)
    texts = [tool_call("finish", answer="(10^{7})!"), tool_call("finish", answer="42")]
    problem = {"data_source": "math", "problem": "What is 6 times 7?", "answer": "42"}
    async with ScriptedLLM(replay(completions(tokenizer, texts))) as policy:
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(policy.url)
        svc = await service_with(balancer, tokenizer)
        hung = await svc.wait(await submit(svc, problem), 120)
        scored = await svc.wait(await submit(svc, problem), 120)
    assert hung is not None and hung.error is not None
    assert (hung.error.stage, hung.error.kind) == ("eval", "verifier_timeout")
    assert hung.status == "failed" and hung.filter and hung.reward is None
    assert scored is not None and scored.status == "completed" and scored.reward == 1.0
    await verify.shutdown()
