"""The decoupling benchmark: raas's three stage pools against one pool of workers that each run a job's
init → run → eval, with a capacity-limited scripted policy and log-normal INIT/EVAL latencies."""

from __future__ import annotations

import asyncio
import math
import random
import time
from pathlib import Path
from typing import Any

from pipeline_common import BenchHandler, PolicyProcess, make_service
from raas.core.jobs import JobRequest
from raas.llm import LLMBalancer
from raas.sandbox import SandboxManager
from raas.sandbox.config import make_config
from raas.tasks.base import Job, JobSandboxes, LLMContext


def lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def decoupling_jobs(n: int, p: dict[str, Any], seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "data_source": BenchHandler.name,
            "sandbox": False,
            "turns": p["turns"],
            "tokens": p["tokens"],
            "init_s": lognormal(rng, p["init_median_s"], p["sigma"]),
            "eval_s": lognormal(rng, p["eval_median_s"], p["sigma"]),
        }
        for _ in range(n)
    ]


class Window:
    """Resets the policy's statistics when ``lo`` of the jobs are done and reads them when ``hi`` are."""

    def __init__(self, llm: PolicyProcess, total: int, lo: float = 0.1, hi: float = 0.9) -> None:
        self.llm, self.lo, self.hi = llm, max(1, int(total * lo)), max(2, int(total * hi))
        self.done = 0
        self._reset: asyncio.Task[None] | None = None
        self._stats: asyncio.Task[dict[str, float]] | None = None
        self.t_lo = self.t_hi = 0.0

    def finished(self) -> None:
        self.done += 1
        if self.done == self.lo:
            self._reset = asyncio.ensure_future(self.llm.reset())
            self.t_lo = time.perf_counter()
        elif self.done == self.hi:
            self._stats = asyncio.ensure_future(self.llm.stats())
            self.t_hi = time.perf_counter()

    async def report(self) -> dict[str, float]:
        assert self._reset is not None and self._stats is not None
        await self._reset
        stats = await self._stats
        span = self.t_hi - self.t_lo
        return {
            "llm_utilization": round(stats["utilization"], 4),
            "rollouts_per_s": round((self.hi - self.lo) / span, 2),
            "window_s": round(span, 2),
        }


async def decoupled_run(root: Path, jobs: list[dict[str, Any]], p: dict[str, Any]) -> dict[str, Any]:
    async with PolicyProcess(p) as llm:
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(llm.url)
        service = await make_service(
            root / "decoupled",
            balancer,
            {"backend": "local"},
            init_workers=p["raas_workers"]["init"],
            run_workers=p["raas_workers"]["run"],
            eval_workers=p["raas_workers"]["eval"],
        )
        window = Window(llm, len(jobs))
        try:
            async with service.events() as sub:
                t0 = time.perf_counter()
                await service.submit_many([JobRequest(instance=j) for j in jobs])
                async for ev in sub:
                    if ev.status in ("completed", "failed", "timeout", "cancelled"):
                        window.finished()
                        if window.done == len(jobs):
                            break
                wall = time.perf_counter() - t0
        finally:
            await service.shutdown(0)
            await balancer.aclose()
        return {**await window.report(), "total_wall_s": round(wall, 2)}


async def coupled_run(root: Path, jobs: list[dict[str, Any]], p: dict[str, Any]) -> dict[str, Any]:
    """The baseline: W workers, each doing init → run → eval for one job at a time (no separate pools)."""
    async with PolicyProcess(p) as llm:
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(llm.url)
        manager = SandboxManager(root / "coupled" / "sandboxes")
        handler = BenchHandler()
        from raas.agent.config import AgentConfig

        ctx = LLMContext(balancer=balancer, tokenizer=None, agent=AgentConfig())  # type: ignore[arg-type]
        queue: asyncio.Queue[tuple[int, dict[str, Any]]] = asyncio.Queue()
        for i, j in enumerate(jobs):
            queue.put_nowait((i, j))
        window = Window(llm, len(jobs))

        async def worker() -> None:
            while True:
                try:
                    i, instance = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                job = Job(job_id=f"c{i}", instance=instance, trajectory_id=f"c{i}")
                sandboxes = JobSandboxes(manager, make_config(backend="local"), job.job_id)
                env = await handler.init(job, sandboxes)
                env.run_output = await handler.run(job, env, ctx)
                await sandboxes.close_all()
                await handler.eval(job, env)
                await sandboxes.close_all()
                window.finished()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(p["total_workers"])))
        wall = time.perf_counter() - t0
        await balancer.aclose()
        await manager.close_all()
        return {**await window.report(), "total_wall_s": round(wall, 2)}


async def decoupling(root: Path, n_jobs: int) -> dict[str, Any]:
    p: dict[str, Any] = {
        "capacity": 8,
        "tokens_per_s": 100.0,
        "turns": 3,
        "tokens": 20,
        "init_median_s": 0.2,
        "eval_median_s": 0.5,
        "sigma": 0.8,
        "total_workers": 22,
        "raas_workers": {"init": 4, "run": 9, "eval": 9},
    }
    assert sum(p["raas_workers"].values()) == p["total_workers"]
    jobs = decoupling_jobs(n_jobs, p, seed=7)
    raas = await decoupled_run(root, jobs, p)
    coupled = await coupled_run(root, jobs, p)
    return {
        "params": {**p, "jobs": n_jobs, "llm_s_per_job": p["turns"] * p["tokens"] / p["tokens_per_s"]},
        "raas": raas,
        "coupled": coupled,
    }
