"""Exact weight sync: ``pause()`` returns only when no admitted ``generate()`` call can still send anything,
across retries, failover and the health check a call may run; nothing reaches any server until
``resume()``; results carry the weight version in force when the call was admitted. Real HTTP servers:
a raw-socket vLLM-protocol double that holds (or drops) a request until the test releases it, and the
scripted vLLM-protocol policy server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from raas.core import metrics
from raas.llm import LLMBalancer, LLMUnavailable, SamplingParams
from tests.doubles.scripted_llm import ScriptedLLM, fixed
from tests.llm.wire_doubles import HeldVLLM

pytestmark = pytest.mark.integration

PROMPT = [1, 2, 3, 4]
SHORT = SamplingParams(max_tokens=4)


class Sent:
    """httpx request hook: every request the balancer sends, to any server, in order."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []

    async def __call__(self, request: httpx.Request) -> None:
        self.requests.append((request.method, str(request.url)))


@pytest.fixture
async def sent_http() -> AsyncIterator[tuple[httpx.AsyncClient, Sent]]:
    sent = Sent()
    async with httpx.AsyncClient(event_hooks={"request": [sent]}) as http:
        yield http, sent


async def _settle(task: asyncio.Task[object], rounds: int = 50) -> None:
    """Let the event loop run (the tasks involved only wait on sockets and events the test controls)."""
    for _ in range(rounds):
        if task.done():
            return
        await asyncio.sleep(0.01)


def _attempts(server: str, outcome: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "raas_llm_attempt_seconds_count", {"server": server, "outcome": outcome}
    )
    return value or 0.0


async def test_pause_waits_for_the_failover_retry_and_nothing_is_sent_until_resume(
    sent_http: tuple[httpx.AsyncClient, Sent],
) -> None:
    http, sent = sent_http
    async with (
        HeldVLLM(hold={"/v1/completions"}, drop_completions=True) as doomed,
        ScriptedLLM(fixed(4)) as healthy,
    ):
        bal = LLMBalancer(http=http, retries=0, health_interval_s=0.02)
        bal.start_health_checks()
        try:
            bal.add(doomed.url, weight_version="v1")
            before = {
                (doomed.url, "failover"): _attempts(doomed.url, "failover"),
                (healthy.url, "ok"): _attempts(healthy.url, "ok"),
            }
            call = asyncio.create_task(bal.generate(PROMPT, SHORT, trajectory_id="traj"))
            await asyncio.wait_for(doomed.received.wait(), 30)  # the first attempt hangs in the server
            bal.add(healthy.url, weight_version="v1")
            assert bal.pinned_server("traj") == doomed.url

            pause = asyncio.create_task(bal.pause())
            await _settle(pause)
            assert not pause.done(), "pause() returned while a generate call was still running"

            doomed.healthy = False  # it stays down: health checks must not bring it back
            doomed.release.set()  # the pinned server drops the connection: the call fails over
            await asyncio.wait_for(pause, 30)
            assert call.done(), "pause() returned before the failed-over retry had finished"
            result = call.result()
            assert result.server == healthy.url and result.output_ids == [42] * 4
            assert result.weight_version == "v1"  # the version in force when the call was admitted
            assert bal.in_flight == 0 and bal.paused

            # The trainer swaps weights now: nothing may reach any server, not even a health probe.
            mark = len(sent.requests)
            bal.set_weight_version("v2")
            held = asyncio.create_task(bal.generate(PROMPT, SHORT, trajectory_id="late"))
            await _settle(held, rounds=20)
            assert not held.done()
            assert sent.requests[mark:] == []

            bal.resume()
            late = await asyncio.wait_for(held, 30)
            assert late.server == healthy.url and late.weight_version == "v2"
            assert [r for r in sent.requests[mark:] if r[0] == "POST"] == [
                ("POST", healthy.url + "/v1/completions")
            ]
            # Every attempt is visible in the metrics, the failed-over one too.
            assert _attempts(doomed.url, "failover") - before[(doomed.url, "failover")] == 1
            assert _attempts(healthy.url, "ok") - before[(healthy.url, "ok")] == 2
        finally:
            await bal.aclose()


async def test_pause_waits_for_a_call_stuck_in_its_health_check(
    sent_http: tuple[httpx.AsyncClient, Sent],
) -> None:
    """A call that finds no healthy server probes them all first; pause() must wait for it too."""
    http, sent = sent_http
    async with HeldVLLM(drop_completions=True, hold={"/v1/completions"}) as server:
        bal = LLMBalancer(http=http, retries=0, health_interval_s=0)
        try:
            bal.add(server.url, weight_version="v1")
            server.release.set()  # the first call fails at once: the server is marked unhealthy
            with pytest.raises(LLMUnavailable):
                await bal.generate(PROMPT, SHORT)
            assert bal.servers()[0]["healthy"] is False
            ok_before = _attempts(server.url, "ok")

            server.hold, server.drop_completions = {"/health"}, False
            server.received.clear()
            server.release.clear()
            call = asyncio.create_task(bal.generate(PROMPT, SHORT, trajectory_id="t"))
            await asyncio.wait_for(server.received.wait(), 30)  # the call's health probe is held
            pause = asyncio.create_task(bal.pause())
            await _settle(pause)
            assert not pause.done(), "pause() returned while a call was in its health check"

            server.release.set()
            await asyncio.wait_for(pause, 30)
            assert call.done() and call.result().weight_version == "v1"
            assert _attempts(server.url, "ok") - ok_before == 1
            mark = len(sent.requests)
            bal.resume()
            assert (await bal.generate(PROMPT, SHORT)).output_ids == [11, 12, 13]
            assert len(sent.requests) > mark
        finally:
            await bal.aclose()


async def test_a_call_admitted_before_pause_is_never_cut_short_and_new_ones_wait() -> None:
    """Several calls on one slow server: pause() returns after all of them, each counted once."""
    async with ScriptedLLM(fixed(4), prefill_s=0.2) as slow:
        async with LLMBalancer(health_interval_s=0, retries=0) as bal:
            bal.add(slow.url)
            calls = [
                asyncio.create_task(bal.generate(PROMPT, SHORT, trajectory_id=f"c{i}")) for i in range(3)
            ]
            for _ in range(500):
                if bal.in_flight == 3:
                    break
                await asyncio.sleep(0.01)
            assert bal.in_flight == 3
            await bal.pause()
            assert all(c.done() and c.exception() is None for c in calls)
            bal.resume()


async def test_unreachable_server_attempts_are_counted_as_errors() -> None:
    """With nothing to fail over to, the failed attempt is an ``error``, not a ``failover``."""
    dead = "http://127.0.0.1:9"
    before = _attempts(dead, "error")
    async with LLMBalancer(health_interval_s=0, retries=0) as bal:
        bal.add(dead, kind="vllm")
        with pytest.raises(LLMUnavailable):
            await bal.generate(PROMPT, SHORT)
    assert _attempts(dead, "error") - before == 1
    assert _attempts(dead, "failover") == 0
