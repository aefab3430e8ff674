"""The balancer across two real llama-server processes (and wire doubles for health transitions)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from collections.abc import Callable

import pytest

from raas.llm import ChatTokenizer, ContextWindowExceeded, LLMBalancer, LLMUnavailable, SamplingParams
from raas.llm.embedded import EmbeddedServer
from tests.llm.wire_doubles import SGLangDouble

pytestmark = pytest.mark.integration

SHORT = SamplingParams(max_tokens=4, seed=3)


async def _until(condition: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Poll a condition (bounded, so a broken balancer fails the test instead of hanging it)."""
    for _ in range(int(limit_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _prompt(tok: ChatTokenizer, text: str) -> list[int]:
    return tok.conversation([{"role": "user", "content": text}]).prompt_ids


async def test_trajectories_stick_to_their_server(
    llama_url: str, llama_url_b: str, smol: ChatTokenizer
) -> None:
    async with LLMBalancer(health_interval_s=0) as bal:
        bal.add(llama_url)
        bal.add(llama_url_b)
        for tid in ("t1", "t2", "t3"):
            servers = {
                (await bal.generate(_prompt(smol, f"hi {tid} {turn}"), SHORT, trajectory_id=tid)).server
                for turn in range(3)
            }
            assert servers == {bal.pinned_server(tid)}
        bal.release("t1")
        assert bal.pinned_server("t1") is None
        assert {s["kind"] for s in bal.servers()} == {"llamacpp"}


async def test_least_in_flight_spreads_and_ties_rotate(
    llama_url: str, llama_url_b: str, smol: ChatTokenizer
) -> None:
    async with LLMBalancer(health_interval_s=0) as bal:
        bal.add(llama_url)
        bal.add(llama_url_b)
        prompt = _prompt(smol, "Write a word.")
        results = await asyncio.gather(
            *(bal.generate(prompt, SHORT, trajectory_id=f"c{i}") for i in range(4))
        )
        assert Counter(r.server for r in results) == Counter({llama_url: 2, llama_url_b: 2})
        # nothing in flight: every request ties, and ties rotate between the two servers
        sequential = [(await bal.generate(prompt, SHORT)).server for _ in range(4)]
        assert sequential[0] != sequential[1] and sequential[0::2] == [sequential[0]] * 2
        assert bal.in_flight == 0 and all(s["in_flight"] == 0 for s in bal.servers())


async def test_failover_when_the_pinned_server_is_killed_mid_request(
    llama_url: str, smol: ChatTokenizer
) -> None:
    doomed = EmbeddedServer(parallel=2, ctx_per_slot=512, threads=1)
    await doomed.start()
    pid = doomed.pid
    try:
        async with LLMBalancer(health_interval_s=0, retries=1, backoff_s=0.05) as bal:
            bal.add(doomed.url, weight_version="v1")
            conv = smol.conversation([{"role": "user", "content": "Tell me a long story about boats."}])
            first = await bal.generate(conv.prompt_ids, SHORT, trajectory_id="traj")
            assert first.server == doomed.url
            conv.add_assistant(first.output_ids, first.logprobs)
            conv.add_messages([{"role": "user", "content": "Go on, at length."}])
            bal.add(llama_url, weight_version="v1")

            task = asyncio.create_task(
                bal.generate(conv.prompt_ids, SamplingParams(max_tokens=200, seed=1), trajectory_id="traj")
            )
            await _until(
                lambda: any(s["address"] == doomed.url and s["in_flight"] for s in bal.servers()),
                "the request to reach the doomed server",
            )
            assert doomed.proc is not None
            os.killpg(doomed.proc.pid, signal.SIGKILL)
            res = await task
            assert res.server == llama_url and res.output_ids and res.weight_version == "v1"
            assert bal.pinned_server("traj") == llama_url
            state = {s["address"]: s for s in bal.servers()}
            assert state[doomed.url]["healthy"] is False and state[doomed.url]["failures"] == 1
            # the trajectory goes on from the same token prefix on the new server
            conv.add_assistant(res.output_ids, res.logprobs)
            nxt = await bal.generate(conv.prompt_ids, SHORT, trajectory_id="traj")
            assert nxt.server == llama_url
            await bal.check_health()
            assert {s["address"]: s["healthy"] for s in bal.servers()}[doomed.url] is False
    finally:
        await doomed.stop()
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_pause_drains_in_flight_and_holds_new_requests(
    llama_url: str, llama_url_b: str, smol: ChatTokenizer
) -> None:
    async with LLMBalancer(health_interval_s=0) as bal:
        bal.add(llama_url)
        bal.add(llama_url_b)
        prompt = _prompt(smol, "Count to ten.")
        running = [
            asyncio.create_task(
                bal.generate(prompt, SamplingParams(max_tokens=24, seed=i), trajectory_id=f"p{i}")
            )
            for i in range(3)
        ]
        await _until(lambda: bal.in_flight == 3, "three requests in flight")
        await bal.pause()
        assert bal.paused and bal.in_flight == 0
        assert all(t.done() and t.exception() is None for t in running)
        held = asyncio.create_task(bal.generate(prompt, SHORT, trajectory_id="late"))
        await asyncio.sleep(0.3)
        assert not held.done() and bal.in_flight == 0
        bal.resume()
        assert (await held).output_ids


async def test_weight_version_stamps(llama_url: str, llama_url_b: str, smol: ChatTokenizer) -> None:
    async with LLMBalancer(health_interval_s=0) as bal:
        bal.add(llama_url, weight_version="step-1")
        bal.add(llama_url_b, weight_version="step-1")
        prompt = _prompt(smol, "Hi")
        assert {(await bal.generate(prompt, SHORT)).weight_version for _ in range(2)} == {"step-1"}
        await bal.pause()
        bal.set_weight_version("step-2")
        bal.resume()
        assert {(await bal.generate(prompt, SHORT)).weight_version for _ in range(2)} == {"step-2"}
        bal.add(llama_url, weight_version="step-3")  # re-adding updates one server
        stamps = {(r := await bal.generate(prompt, SHORT)).server: r.weight_version for _ in range(2)}
        assert stamps == {llama_url: "step-3", llama_url_b: "step-2"}


async def test_context_overflow_is_not_a_server_failure(llama_url: str) -> None:
    async with LLMBalancer(health_interval_s=0) as bal:
        bal.add(llama_url)
        with pytest.raises(ContextWindowExceeded):
            await bal.generate([1] * 2000, SHORT, trajectory_id="big")
        assert all(s["healthy"] and s["failures"] == 0 for s in bal.servers())


async def test_health_checks_bring_a_server_back() -> None:
    """A server that went away is unhealthy until a health check sees it answer again."""
    async with LLMBalancer(health_interval_s=0.05, retries=0) as bal:
        srv = SGLangDouble()
        port = srv.port
        async with srv:
            bal.add(srv.url, weight_version="w")
            assert (await bal.generate([1, 2], SHORT)).output_ids == [3, 4, 5, 6]
        with pytest.raises(LLMUnavailable):
            await bal.generate([1, 2], SHORT)
        assert bal.servers()[0]["healthy"] is False
        back = SGLangDouble()
        back.port = port
        async with back:
            await _until(lambda: bal.servers()[0]["healthy"], "the health check to see the server again")
            res = await bal.generate([1, 2], SHORT)
            assert res.server == back.url and res.weight_version == "w"


async def test_no_servers_and_bad_addresses() -> None:
    async with LLMBalancer(health_interval_s=0) as bal:
        with pytest.raises(LLMUnavailable):
            await bal.generate([1], SHORT)
        with pytest.raises(Exception) as err:
            bal.add("localhost:8000")
        assert getattr(err.value, "kind", None) == "bad_request"
        bal.add("http://127.0.0.1:9")  # nothing listens on the discard port
        with pytest.raises(LLMUnavailable):
            await bal.generate([1], SHORT)
        bal.remove("http://127.0.0.1:9")
        assert bal.servers() == []
    assert bal.http.is_closed  # the balancer owns and closes its HTTP client
