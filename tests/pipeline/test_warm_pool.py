"""Warm pools and ``auto`` workers in the service: jobs get pooled sandboxes (each its own, never one
twice), the pools show in the status JSON and on ``/metrics``, and service stop leaves no sandbox (the
``make_service`` fixture's leak check covers pooled ones too)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from raas.core import metrics
from raas.errors import RaasError
from raas.pipeline.autosize import Bounds, WorkerAutosizer, bounds_for
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from raas.sandbox import procs
from tests.pipeline.conftest import ServiceFactory, script, submit
from tests.pipeline.test_service import sandbox_for

POOL = {"enabled": True, "min_size": 2, "max_size": 8, "refill_concurrency": 2}


async def _pool_idle(svc: RolloutService, n: int, limit_s: float = 60.0) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + limit_s
    while True:
        pools = svc.status()["warm_pools"]["pools"]
        if pools and pools[0]["idle"] >= n:
            return pools[0]  # type: ignore[no-any-return]
        assert asyncio.get_running_loop().time() < deadline, pools
        await asyncio.sleep(0.05)


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["local", "bwrap"])
async def test_jobs_get_pooled_sandboxes_each_their_own(
    make_service: ServiceFactory, backend: str, request: pytest.FixtureRequest
) -> None:
    svc = await make_service(sandbox=sandbox_for(backend, request), warm_pool=POOL)
    await _pool_idle(svc, 2)
    manager = svc.sandbox_manager
    instance = script(
        init={"sandbox": True, "bash": "test ! -e ~/seen && touch ~/seen"}, run={"bash": "true"}
    )
    jobs = [await submit(svc, instance) for _ in range(12)]
    results = [await svc.wait(j, 120) for j in jobs]
    assert all(r is not None and r.status == "completed" for r in results), results
    opened: list[str] = []
    while not manager.opened.empty():  # type: ignore[union-attr]
        opened.append(manager.opened.get_nowait())  # type: ignore[union-attr]
    assert len(opened) == 12 and len(set(opened)) == 12, "a sandbox served two jobs"
    pool = svc.status()["warm_pools"]["pools"][0]
    assert pool["claims"] >= 2 and pool["claims"] + pool["misses"] == 12, pool
    for sid in opened:  # every job's sandbox closed with its job; none went back to the pool
        assert procs.pids_with_env(sid) == []
    idle_ids = {s.id for s in manager.list(owner="raas-pool")}  # type: ignore[union-attr]
    assert not idle_ids & set(opened)

    scraped = {
        (s.name, s.labels.get("backend")): s.value
        for family in text_string_to_metric_families(metrics.render(svc.gauges).decode())
        for s in family.samples
    }
    assert scraped[("raas_sandbox_pool_claims_total", backend)] == pool["claims"]
    assert ("raas_sandbox_pool_idle", backend) in scraped
    assert ("raas_sandbox_pool_refills_total", backend) in scraped
    await svc.shutdown(0)
    assert manager.list() == []  # type: ignore[union-attr]


@pytest.mark.integration
async def test_pools_fill_only_on_demand_by_default_and_extra_configs(make_service: ServiceFactory) -> None:
    svc = await make_service()  # on by default, min_size 0: nothing starts before a job asks
    await asyncio.sleep(1.5)  # a few of the pools' ticks
    (pool,) = svc.status()["warm_pools"]["pools"]
    assert pool["idle"] == pool["starting"] == pool["refills"] == 0
    assert svc.sandbox_manager.list() == []  # type: ignore[union-attr]
    job = await submit(svc, script(init={"sandbox": True}))
    result = await svc.wait(job, 60)
    assert result is not None and result.status == "completed"
    pool = await _pool_idle(svc, 1)  # demand seen: the pool holds what was asked for
    assert pool["misses"] == 1 and pool["target"] == 1
    off = await make_service(warm_pool={"enabled": False})
    assert off.status()["warm_pools"] == {"enabled": False, "pools": []}
    svc2 = await make_service(
        warm_pool={**POOL, "min_size": 1, "configs": [{"env": {"FLAVOUR": "b"}}]},
    )
    deadline = asyncio.get_running_loop().time() + 60
    while sum(p["idle"] for p in svc2.status()["warm_pools"]["pools"]) < 2:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)
    assert len(svc2.status()["warm_pools"]["pools"]) == 2


@pytest.mark.integration
async def test_a_bad_pooled_config_fails_the_start(tmp_path: Any) -> None:
    cfg = ServiceConfig(state_dir=tmp_path, warm_pool={"enabled": True, "configs": [{"workdir": "rel"}]})
    svc = RolloutService(cfg)
    with pytest.raises(RaasError) as info:
        await svc.start()
    assert info.value.kind == "bad_request"


# -- auto workers ------------------------------------------------------------------------------------------


class FakeStage:
    def __init__(self, workers: int, running: int, waiting: int) -> None:
        self.workers, self.running, self._waiting = workers, running, waiting

    def waiting(self) -> int:
        return self._waiting


@pytest.mark.unit
def test_autosizer_grows_with_headroom_and_shrinks_cpu_bound_stages_when_saturated() -> None:
    ticks = [(0, 0)]
    stages = {"init": FakeStage(4, 4, 10), "run": FakeStage(16, 16, 10), "eval": FakeStage(4, 1, 0)}
    bounds = {"init": Bounds(4, 2, 32), "run": Bounds(16, 4, 64), "eval": Bounds(4, 2, 32)}
    resized: list[str] = []
    sizer = WorkerAutosizer(stages, bounds, on_change=resized.append, ticks=lambda: ticks[-1])  # type: ignore[arg-type]
    ticks.append((50, 100))  # CPUs half busy: the saturated stages grow
    assert sizer.step() == {"init": 5, "run": 20}
    assert resized == ["init", "run"]
    ticks.append((150, 200))  # CPUs saturated: the CPU-bound stage at its limit shrinks, RUN stays
    stages["init"].running = 5
    assert sizer.step() == {"init": 4}
    for i in range(3, 30):
        ticks.append((i * 100, i * 100))
        sizer.step()
    assert stages["init"].workers == 2  # never under its floor
    for i in range(1, 30):
        stages["run"].running = stages["run"].workers  # always full, jobs waiting
        ticks.append((2900 + i * 10, 2900 + i * 100))  # 10% busy
        sizer.step()
    assert stages["run"].workers == 64  # never over its ceiling


@pytest.mark.unit
def test_auto_bounds_follow_cpus_and_memory() -> None:
    assert bounds_for("init", 2, float("inf"), 16) == Bounds(start=4, low=2, high=32)
    assert bounds_for("run", 2, float("inf"), 16) == Bounds(start=16, low=4, high=4096)
    # 1 GB available, half of it at 16 MB per sandbox: at most 32 jobs in any stage
    assert bounds_for("run", 8, 1024, 16) == Bounds(start=32, low=16, high=32)


@pytest.mark.integration
async def test_auto_workers_in_the_service(make_service: ServiceFactory) -> None:
    svc = await make_service(init_workers="auto", run_workers=3, eval_workers="auto")
    stages = svc.status()["stages"]
    assert stages["run"]["workers"] == 3
    assert stages["init"]["workers"] >= 1 and stages["eval"]["workers"] >= 1
    job = await submit(svc, script(init={"sandbox": True}))
    result = await svc.wait(job, 60)
    assert result is not None and result.status == "completed"
    with pytest.raises(ValueError):
        ServiceConfig(init_workers="many")
    with pytest.raises(ValueError):
        ServiceConfig(run_workers=0)
