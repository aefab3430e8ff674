"""Everything raas measures is on the ``/metrics`` the service serves (not on prometheus_client's default
registry, which nothing serves): a math job with a tool call, submitted and scraped over real HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raas.api.app import create_app
from raas.llm.balancer import LLMBalancer
from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from tests.agent.scripted import completions, tool_call
from tests.api.conftest import Served
from tests.doubles.scripted_llm import ScriptedLLM, replay
from tests.pipeline.conftest import RecordingSandboxManager, assert_no_leftovers

pytestmark = pytest.mark.integration


async def _scrape(client: httpx.AsyncClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    r = await client.get("/metrics")
    assert r.status_code == 200
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def _delta(before: dict[Any, float], after: dict[Any, float], name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in after, f"{name}{labels} is not on /metrics"
    return after[key] - before.get(key, 0.0)


async def test_a_tool_call_shows_on_the_served_metrics(tmp_path: Path) -> None:
    tok = ChatTokenizer.from_pretrained(prepare_tokenizer())
    texts = [tool_call("bash", command="echo $((6*7))"), tool_call("finish", answer="42")]
    async with ScriptedLLM(replay(completions(tok, texts))) as policy:
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(policy.url)
        manager = RecordingSandboxManager(tmp_path / "sandboxes")
        config = ServiceConfig(state_dir=tmp_path, shutdown_grace_s=0.0)
        service = RolloutService(config, sandbox_manager=manager, balancer=balancer, tokenizer=tok)
        served = Served(create_app(service), config)
        await served.start()
        try:
            async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
                before = await _scrape(client)
                instance = {"data_source": "math", "problem": "What is 6 times 7?", "answer": "42"}
                job = (await client.post("/v1/jobs", json={"instance": instance})).json()["job_id"]
                result = (await client.get(f"/v1/jobs/{job}/result", params={"wait": 100})).json()
                assert result["status"] == "completed" and result["reward"] == 1.0, result
                after = await _scrape(client)
        finally:
            await served.stop()
            await balancer.aclose()
        assert_no_leftovers(manager)
        await manager.close_all()
    # two calls parsed from the policy's output (bash, finish), one of them run in the sandbox
    assert _delta(before, after, "raas_tool_calls_total", format="hermes", outcome="ok") == 2
    assert _delta(before, after, "raas_tool_latency_seconds_count", tool="bash", ok="true") == 1
    assert _delta(before, after, "raas_llm_attempt_seconds_count", server=policy.url, outcome="ok") == 2
