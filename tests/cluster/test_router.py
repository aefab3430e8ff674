"""The router without Ray: real raas services on real sockets in this process, listed by a static node
source, behind a real router served over HTTP. Fast enough for every CI run; the Ray-backed membership is
covered by ``test_ray_cluster.py``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from raas.api import served
from raas.cluster.nodes import StaticNodeSource
from raas.cluster.router import ClusterRouter, RouterSettings
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService

pytestmark = pytest.mark.integration

HANDLERS = {"test.script": "tests.doubles.handlers:StageScriptHandler"}


def job(job_id: str, run_s: float = 0.1) -> dict[str, Any]:
    return {
        "job_id": job_id,
        "instance": {"data_source": "test.script", "run": {"sleep": run_s}, "eval": {"reward": 1.0}},
    }


def node_config(state_dir: Path) -> ServiceConfig:
    return ServiceConfig(
        state_dir=state_dir, sandbox={"backend": "local"}, extra_handlers=HANDLERS, shutdown_grace_s=0.0
    )


@contextlib.asynccontextmanager
async def router_over(
    urls: list[str], state_dir: Path, **kw: Any
) -> AsyncIterator[tuple[str, ClusterRouter]]:
    router = ClusterRouter(
        ServiceConfig(state_dir=state_dir, cancel_grace_s=2.0, max_pending=kw.pop("max_pending", 1024)),
        StaticNodeSource(urls, capacity=2),
        RouterSettings(
            poll_s=0.2,
            node_deadline_s=1.0,
            submit_wait_s=kw.pop("submit_wait_s", 10.0),
            reconcile_s=kw.pop("reconcile_s", 30.0),
        ),
    )
    async with served(router) as url:
        deadline = time.monotonic() + 30
        while urls and not all(n["healthy"] for n in router.node_table()):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        yield url, router


async def result(http: httpx.AsyncClient, job_id: str) -> dict[str, Any]:
    for _ in range(60):
        r = await http.get(f"/v1/jobs/{job_id}/result", params={"wait": 2})
        if r.status_code == 200:
            body: dict[str, Any] = r.json()
            return body
    raise AssertionError(f"{job_id} did not finish")


async def test_jobs_of_a_node_that_stops_answering_finish_on_another(tmp_path: Path) -> None:
    async with served(RolloutService(node_config(tmp_path / "b"))) as url_b:
        svc_a = RolloutService(node_config(tmp_path / "a"))
        cm_a = served(svc_a)
        url_a = await cm_a.__aenter__()
        try:
            async with router_over([url_a, url_b], tmp_path / "r") as (url, router):
                async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
                    ids = [f"j{i}" for i in range(6)]
                    for j in ids:
                        assert (await http.post("/v1/jobs", json=job(j, run_s=1.5))).status_code == 202
                    on_a = {j for j, t in router.jobs.items() if t.node == "static-0"}
                    assert on_a  # least-loaded placement used both nodes
                    await cm_a.__aexit__(None, None, None)  # node A goes away mid-run
                    url_a = ""
                    results = {j: await result(http, j) for j in ids}
                    assert {r["status"] for r in results.values()} == {"completed"}
                    for j in on_a:
                        details = [d or "" for _s, _a, d in await router.ledger.transitions(j)]
                        assert any(d.startswith("moved: node static-0") for d in details), details
                    assert sorted(router.finished.items()) == [("completed", 6)]
                    # The live dashboard is served by the router too, with its nodes as the node table.
                    snap = (await http.get("/dashboard/snapshot")).json()
                    assert url_b in {n["url"] for n in snap["nodes"]}
        finally:
            if url_a:
                await cm_a.__aexit__(None, None, None)


async def test_invalid_job_is_the_callers_400_and_cancel_reaches_the_node(tmp_path: Path) -> None:
    async with served(RolloutService(node_config(tmp_path / "a"))) as node_url:
        async with router_over([node_url], tmp_path / "r") as (url, _router):
            async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
                bad = await http.post("/v1/jobs", json={"job_id": "bad", "instance": {"data_source": "nope"}})
                assert bad.status_code == 400 and bad.json()["error"]["kind"] == "bad_request"
                assert (await result(http, "bad"))["error"]["kind"] == "bad_request"
                assert (await http.post("/v1/jobs", json=job("long", run_s=60))).status_code == 202
                for _ in range(100):
                    if (await http.get("/v1/jobs/long")).json()["status"] == "run":
                        break
                    await asyncio.sleep(0.05)
                info = (await http.delete("/v1/jobs/long")).json()
                assert info["status"] == "cancelled"
                assert (await result(http, "long"))["status"] == "cancelled"
            async with httpx.AsyncClient(base_url=node_url, timeout=10, trust_env=False) as node:
                assert (await node.get("/v1/jobs/long")).json()["status"] == "cancelled"
                assert (await node.get("/v1/jobs/bad")).status_code == 404


async def test_without_nodes_jobs_wait_queued_and_the_router_is_bounded(tmp_path: Path) -> None:
    async with router_over([], tmp_path / "r", max_pending=2, submit_wait_s=0.2) as (url, router):
        async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
            r = await http.post("/v1/jobs:batch", json={"jobs": [job("q1"), job("q2")]})
            assert r.status_code == 202 and [j["status"] for j in r.json()["jobs"]] == ["queued", "queued"]
            full = await http.post("/v1/jobs", json=job("q3"))
            assert full.status_code == 429
            assert (await http.get("/status")).json()["unassigned"] == 2
            assert (await http.delete("/v1/jobs/q1")).json()["status"] == "cancelled"
            assert (await result(http, "q1"))["error"]["kind"] == "cancelled"
            assert (await http.post("/v1/jobs", json=job("q2"))).json()["created"] is False
    assert not router.jobs or set(router.jobs) == {"q2"}


async def test_a_result_the_event_stream_missed_is_picked_up_by_the_periodic_reconcile(
    tmp_path: Path,
) -> None:
    async with served(RolloutService(node_config(tmp_path / "a"))) as node_url:
        async with router_over([node_url], tmp_path / "r", reconcile_s=0.5) as (url, router):
            node = next(iter(router.nodes.values()))
            assert node.follower is not None
            node.follower.cancel()  # the stream goes silent while the node still counts as connected
            await asyncio.gather(node.follower, return_exceptions=True)
            async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
                assert (await http.post("/v1/jobs", json=job("quiet", run_s=0.2))).status_code == 202
                assert (await result(http, "quiet"))["status"] == "completed"
