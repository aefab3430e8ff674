"""The service owns the LLM balancer it builds: health checks run while it serves (an unhealthy inference
server comes back once it answers), and shutdown stops them and closes the HTTP client. Real balancer,
real HTTP to a scripted vLLM-protocol server on a real socket."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.llm import LLMBalancer
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from tests.doubles.scripted_llm import ScriptedLLM, fixed
from tests.pipeline.conftest import ServiceFactory, script, submit

pytestmark = pytest.mark.integration

HEALTH_TASK = "raas-llm-health"


def health_tasks(ignore: frozenset[asyncio.Task[object]] = frozenset()) -> list[asyncio.Task[object]]:
    """Live health-check tasks on this loop, less ``ignore``: the loop is shared by the whole pytest
    process, so a task that an earlier test's service still runs must not count against this test."""
    return [
        t for t in asyncio.all_tasks() if t.get_name() == HEALTH_TASK and not t.done() and t not in ignore
    ]


async def healthy_becomes(svc: RolloutService, want: bool, limit_s: float = 30.0) -> None:
    """Wait until the service's only server reports ``healthy == want`` (the balancer has no event for it)."""

    async def watch() -> None:
        while svc.llm_servers()[0]["healthy"] is not want:  # noqa: ASYNC110 - no health-change event
            await asyncio.sleep(0.02)

    await asyncio.wait_for(watch(), limit_s)


async def test_shutdown_stops_health_checks_and_closes_the_client(tmp_path: Path) -> None:
    earlier = frozenset(health_tasks())
    async with ScriptedLLM(fixed(3)) as llm:
        svc = RolloutService(
            ServiceConfig(state_dir=tmp_path / "svc", llm_servers=[llm.url], shutdown_grace_s=0.0)
        )
        await svc.start()
        balancer = svc.balancer
        assert isinstance(balancer, LLMBalancer)
        assert len(health_tasks(earlier)) == 1, "the service did not start the balancer's health checks"
        assert not balancer.http.is_closed
        await svc.shutdown()
    assert health_tasks(earlier) == []
    assert balancer.http.is_closed
    assert not svc.ledger.running


async def test_an_injected_balancer_stays_open_for_its_owner(tmp_path: Path) -> None:
    async with LLMBalancer(health_interval_s=0) as balancer:
        svc = RolloutService(ServiceConfig(state_dir=tmp_path / "svc"), balancer=balancer)
        await svc.start()
        await svc.shutdown()
        assert not balancer.http.is_closed
    assert balancer.http.is_closed


async def test_a_failed_start_leaves_no_health_task_or_client(tmp_path: Path) -> None:
    earlier = frozenset(health_tasks())
    cfg = ServiceConfig(state_dir=tmp_path / "svc", tokenizer_dir=tmp_path / "no-such-tokenizer")
    svc = RolloutService(cfg)
    with pytest.raises(RaasError):
        await svc.start()
    assert health_tasks(earlier) == []
    assert isinstance(svc.balancer, LLMBalancer) and svc.balancer.http.is_closed
    assert not svc.ledger.running
    assert not svc.accepting


async def test_an_unhealthy_server_comes_back_through_the_health_check(make_service: ServiceFactory) -> None:
    llm = ScriptedLLM(fixed(3, token_id=9))
    await llm.start()
    port = llm.port
    try:
        svc = await make_service(llm_servers=[llm.url], llm_health_interval_s=0.05)
        await llm.stop()  # the server goes away: the periodic probe marks it unhealthy
        await healthy_becomes(svc, False)
        llm = ScriptedLLM(fixed(3, token_id=9), port=port)
        await llm.start()  # it is back on the same address: the periodic probe brings it back
        await healthy_becomes(svc, True)
        job_id = await submit(svc, script(run={"generate": [1, 2], "max_tokens": 3}))
        result = await svc.wait(job_id, 60)
        assert result is not None and result.status == "completed", result
        assert [t.output_ids for t in result.turns] == [[9, 9, 9]]
    finally:
        await llm.stop()
