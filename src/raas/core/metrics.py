"""Prometheus metrics for raas: one process-wide registry any layer may record into.

It lives in :mod:`raas.core` and imports nothing else from raas, so the agent loop and the LLM balancer
record into it (:func:`observe_tool`, :func:`observe_llm_attempt`) without importing the pipeline above
them. Per-service gauges (queue depth, active jobs) are read at scrape time by
:class:`StageGaugeCollector` instead of being pushed. Every raas metric lives on :data:`REGISTRY`, the registry ``/metrics`` serves; none on prometheus_client's
default registry, which ``/metrics`` does not show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry(auto_describe=True)

_STAGE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
_CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

STAGE_DURATION = Histogram(
    "raas_stage_duration_seconds",
    "Time a job spent inside a pipeline stage",
    ["stage", "outcome"],
    buckets=_STAGE_BUCKETS,
    registry=REGISTRY,
)
QUEUE_WAIT = Histogram(
    "raas_queue_wait_seconds",
    "Time a job waited for a stage worker",
    ["stage"],
    buckets=_STAGE_BUCKETS,
    registry=REGISTRY,
)
TOOL_LATENCY = Histogram(
    "raas_tool_latency_seconds",
    "Latency of one sandbox tool call",
    ["tool", "ok"],
    buckets=_CALL_BUCKETS,
    registry=REGISTRY,
)
LLM_ATTEMPT = Histogram(
    "raas_llm_attempt_seconds",
    "Latency of every attempt the LLM balancer sent to a server, by outcome (ok, failover, error, cancelled)",
    ["server", "outcome"],
    buckets=_CALL_BUCKETS,
    registry=REGISTRY,
)
TOOL_CALLS = Counter(
    "raas_tool_calls",
    "Tool calls read from model output, by format and outcome (ok, malformed, unknown_tool)",
    ["format", "outcome"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "raas_errors_total", "Failed jobs by stage and error kind", ["stage", "kind"], registry=REGISTRY
)
JOBS_FINISHED = Counter(
    "raas_jobs_finished_total", "Jobs that reached a terminal status", ["status"], registry=REGISTRY
)


def observe_stage(stage: str, seconds: float, outcome: str) -> None:
    STAGE_DURATION.labels(stage=stage, outcome=outcome).observe(seconds)


def observe_queue_wait(stage: str, seconds: float) -> None:
    QUEUE_WAIT.labels(stage=stage).observe(seconds)


def observe_tool(tool: str, seconds: float, ok: bool = True) -> None:
    """Record one tool call (``tool`` like ``bash`` or ``ipython``)."""
    TOOL_LATENCY.labels(tool=tool, ok=str(ok).lower()).observe(seconds)


def observe_llm_attempt(server: str, seconds: float, outcome: str) -> None:
    """Record one attempt of a generate call against ``server``; ``outcome`` is ``ok``, ``failover`` (the
    server failed and the call moved on), ``error`` (the call failed with it) or ``cancelled``."""
    LLM_ATTEMPT.labels(server=server, outcome=outcome).observe(seconds)


def count_tool_call(fmt: str, outcome: str) -> None:
    """Count one tool call parsed out of model output (``fmt``: hermes, qwen_xml, llama, json)."""
    TOOL_CALLS.labels(format=fmt, outcome=outcome).inc()


def count_error(stage: str | None, kind: str) -> None:
    ERRORS.labels(stage=stage or "none", kind=kind).inc()


def count_finished(status: str) -> None:
    JOBS_FINISHED.labels(status=status).inc()


class StageGaugeCollector(Collector):
    """Reads queue depth and active jobs per stage from a live service at scrape time."""

    def __init__(
        self, snapshot: Callable[[], Mapping[str, Mapping[str, int]]], servers: Callable[[], int]
    ) -> None:
        self._snapshot = snapshot
        self._servers = servers

    def collect(self) -> Iterable[GaugeMetricFamily]:
        queued = GaugeMetricFamily("raas_stage_queued", "Jobs waiting for a stage worker", labels=["stage"])
        active = GaugeMetricFamily("raas_stage_active", "Jobs inside a stage", labels=["stage"])
        for stage, numbers in self._snapshot().items():
            queued.add_metric([stage], numbers.get("queued", 0))
            active.add_metric([stage], numbers.get("active", 0))
        servers = GaugeMetricFamily("raas_llm_servers", "Inference servers in the balancer")
        servers.add_metric([], self._servers())
        return [queued, active, servers]


def render(extra: CollectorRegistry | None = None) -> bytes:
    """The Prometheus text exposition of the process registry plus ``extra`` (a service's gauges)."""
    body = generate_latest(REGISTRY)
    if extra is not None:
        body += generate_latest(extra)
    return body
