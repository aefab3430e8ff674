"""The event bus's bounded fan-out and the metrics module's exposition."""

from __future__ import annotations

import pytest

from raas.core import metrics
from raas.core.jobs import JobEvent
from raas.pipeline.events import EventBus

pytestmark = pytest.mark.unit


async def test_fan_out_and_end_of_stream() -> None:
    bus = EventBus()
    async with bus.subscribe() as a, bus.subscribe() as b:
        assert bus.subscribers == 2
        bus.publish(JobEvent(job_id="j", status="queued", at=1.0))
        assert (await a.get()).status == "queued"  # type: ignore[union-attr]
        assert (await b.get()).job_id == "j"  # type: ignore[union-attr]
        bus.close()
        assert [e async for e in a] == []
    assert bus.subscribers == 0


async def test_slow_subscriber_drops_oldest_and_counts() -> None:
    bus = EventBus(maxsize=3)
    async with bus.subscribe() as sub:
        for i in range(5):
            bus.publish(JobEvent(job_id=f"j{i}", status="queued", at=float(i)))
        got = [(await sub.get()).job_id for _ in range(3)]  # type: ignore[union-attr]
        assert got == ["j2", "j3", "j4"] and sub.dropped == 2


def test_metrics_exposition_includes_other_layers_and_gauges() -> None:
    from prometheus_client import CollectorRegistry

    metrics.observe_tool("bash", 0.002)
    metrics.observe_llm_attempt("http://x:1", 0.5, "failover")
    gauges = CollectorRegistry()
    gauges.register(metrics.StageGaugeCollector(lambda: {"run": {"queued": 3, "active": 2}}, lambda: 4))
    text = metrics.render(gauges).decode()
    assert 'raas_tool_latency_seconds_count{ok="true",tool="bash"}' in text
    assert 'raas_llm_attempt_seconds_count{outcome="failover",server="http://x:1"}' in text
    assert 'raas_stage_queued{stage="run"} 3.0' in text and 'raas_stage_active{stage="run"} 2.0' in text
    assert "raas_llm_servers 4.0" in text


def test_no_raas_metric_lives_on_the_default_registry() -> None:
    """``/metrics`` serves ``metrics.REGISTRY``; a metric on prometheus_client's default registry would be
    invisible there. Import every raas module that records anything, then look."""
    import importlib
    import pkgutil

    import prometheus_client

    import raas

    # raas.toolserver runs inside sandboxes; raas.integrations' trainer plugins run inside those trainers'
    # processes (verl, SkyRL, AReaL, not installed here): neither records anything.
    elsewhere = (
        "raas.toolserver",
        "raas.integrations.verl",
        "raas.integrations.skyrl",
        "raas.integrations.areal",
    )
    for mod in pkgutil.walk_packages(raas.__path__, "raas."):
        if not mod.name.startswith(elsewhere) or mod.name == "raas.integrations.verl_data":
            importlib.import_module(mod.name)
    stray = [
        name
        for name in prometheus_client.REGISTRY._names_to_collectors  # no public listing API
        if name.startswith("raas")
    ]
    assert stray == []
    served = {m.name for m in metrics.REGISTRY.collect()}
    assert {"raas_tool_calls", "raas_tool_latency_seconds", "raas_llm_attempt_seconds"} <= served
