"""The scripted policy double speaks vLLM's protocol well enough for raas's real client, and its capacity
model and statistics behave as the benchmarks assume."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from raas.errors import RaasError
from raas.llm import LLMBalancer, SamplingParams
from tests.doubles.scripted_llm import Completion, ScriptedLLM, fixed, replay

pytestmark = pytest.mark.integration


async def test_real_client_reads_the_double() -> None:
    script = [Completion(token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3]), Completion(token_ids=[9])]
    async with ScriptedLLM(replay(script)) as llm:
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(llm.url)
        try:
            first = await balancer.generate([1, 2], SamplingParams(max_tokens=8), trajectory_id="t")
            second = await balancer.generate(
                [1, 2, 5, 6, 7, 3], SamplingParams(max_tokens=8), trajectory_id="t"
            )
            assert (first.output_ids, first.logprobs) == ([5, 6, 7], [-0.1, -0.2, -0.3])
            assert second.output_ids == [9] and second.server == llm.url
            assert [r.prompt_ids for r in llm.requests] == [[1, 2], [1, 2, 5, 6, 7, 3]]
            with pytest.raises(RaasError, match="exhausted"):  # a replayed script does not invent answers
                await balancer.generate([1], SamplingParams(max_tokens=8), trajectory_id="u")
        finally:
            await balancer.aclose()


async def test_capacity_and_statistics() -> None:
    async with ScriptedLLM(fixed(10), capacity=2, tokens_per_s=200.0) as llm:
        async with httpx.AsyncClient(base_url=llm.url) as c:
            await c.post("/_scripted/reset")
            body = {"prompt": [1, 2, 3], "max_tokens": 10, "return_token_ids": True}
            responses = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(6)))
            assert all(r.json()["choices"][0]["token_ids"] == [42] * 10 for r in responses)
            stats = (await c.get("/_scripted/stats")).json()
            assert stats["requests"] == 6 and stats["tokens"] == 60 and stats["max_active"] == 2
            assert stats["busy_slot_s"] >= 6 * 10 / 200.0 - 1e-6  # each held a slot for 50 ms
            assert 0 < stats["utilization"] <= 1.0
            assert (await c.post("/_scripted/reset")).json()["requests"] == 0
