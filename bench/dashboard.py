"""What the dashboard costs a service; prints one JSON document and writes bench/results/dashboard.json.

1. ``sample``: the time to compute one snapshot (``ServiceStats``, once per second however many pages are
   open) with ``--pending`` jobs in the service and 20 recent failures with long messages, and the size of
   a snapshot event and of the full 600-point history sent when a page connects.
2. ``api_latency``: ``GET /status`` latency p50/p99 on a served service (``raas.api.served``, real HTTP)
   with no dashboard open and with ``--streams`` dashboard event streams open.

Usage: ``python bench/dashboard.py [--pending 1000] [--streams 8] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx

from raas.api.app import served
from raas.api.dashboard_stats import ServiceStats
from raas.core.jobs import JobRequest
from raas.core.trajectory import EvalOutput, RunOutput
from raas.errors import RaasError
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler
from raas.tasks.registry import HandlerRegistry


class DashBenchHandler(TaskHandler):
    """``run_s`` seconds in RUN; ``fail`` raises a ``tool_error`` with that message."""

    name: ClassVar[str] = "bench.dash"

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        return Env(job=job, sandboxes=sandboxes)

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        if job.instance.get("fail"):
            raise RaasError(str(job.instance["fail"]), kind="tool_error")
        await asyncio.sleep(float(job.instance.get("run_s", 0)))
        return RunOutput()

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        return EvalOutput(reward=1.0, resolved=True)


def _service(state: Path, pending: int) -> RolloutService:
    handlers = HandlerRegistry()
    handlers.register(DashBenchHandler, replace=True)
    config = ServiceConfig(state_dir=state, shutdown_grace_s=0, run_workers=64, max_pending=pending + 100)
    return RolloutService(config, handlers=handlers)


async def _fill(service: RolloutService, pending: int) -> None:
    for _ in range(20):
        await service.submit(JobRequest(instance={"data_source": "bench.dash", "fail": "x" * 3000}))
    held = [JobRequest(instance={"data_source": "bench.dash", "run_s": 3600}) for _ in range(pending)]
    await service.submit_many(held)
    while True:  # the 20 failures are recorded
        if sum(service.table.finished_counts.values()) >= 20:
            break
        await asyncio.sleep(0.05)


async def bench_sample(pending: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        service = _service(Path(d), pending)
        await service.start()
        stats = ServiceStats(service)
        await stats.start()
        try:
            await _fill(service, pending)
            times = []
            for _ in range(200):
                t = time.perf_counter()
                await stats._sample()
                times.append(time.perf_counter() - t)
            snap = await stats.snapshot()
            history = [snap["point"]] * 600
            return {
                "pending": snap["pending"],
                "sample_ms_p50": round(statistics.median(times) * 1e3, 3),
                "sample_ms_max": round(max(times) * 1e3, 3),
                "snapshot_event_bytes": len(json.dumps(snap)),
                "history_event_bytes_600_points": len(json.dumps(history)),
            }
        finally:
            await stats.aclose()
            await service.shutdown(0)


async def _status_latency(client: httpx.AsyncClient, n: int = 300) -> dict[str, float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        r = await client.get("/status")
        times.append(time.perf_counter() - t)
        assert r.status_code == 200
    times.sort()
    return {"p50_ms": round(times[n // 2] * 1e3, 3), "p99_ms": round(times[int(n * 0.99)] * 1e3, 3)}


async def _read_stream(url: str, events: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        async with client.stream("GET", "/dashboard/events") as response:
            async for line in response.aiter_lines():
                if line.startswith("event: snapshot"):
                    events.append(1)


async def bench_api_latency(pending: int, streams: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        service = _service(Path(d), pending)
        async with served(service, fit_fd_limit=False) as url:
            await _fill(service, pending)
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                await _status_latency(client, 50)  # warm up
                idle = await _status_latency(client)
                seen: list[int] = []
                readers = [asyncio.create_task(_read_stream(url, seen)) for _ in range(streams)]
                try:
                    while True:  # every stream has delivered a snapshot (about one each)
                        if len(seen) >= streams:
                            break
                        await asyncio.sleep(0.05)
                    watched = await _status_latency(client)
                finally:
                    for task in readers:
                        task.cancel()
                    for task in readers:
                        with contextlib.suppress(asyncio.CancelledError):
                            await task
        return {"streams": streams, "no_dashboard": idle, "with_dashboards": watched, "snapshots": len(seen)}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "sample": await bench_sample(args.pending),
        "api_latency": await bench_api_latency(args.pending, args.streams),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pending", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dashboard.json")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
