"""raas on a real 2-node Ray cluster on this machine: node services placed by Ray, the router in front.

One cluster for the module (starting Ray nodes costs seconds each); the test that kills a node runs last.
Jobs use the ``test.script`` handler with the ``local`` sandbox backend, so a job is cheap but still opens a
real sandbox (a tool server process) on its node.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray")

from raas.api import served
from raas.cluster import ray_nodes
from raas.cluster.router import ClusterRouter, RouterSettings
from raas.pipeline.config import ServiceConfig
from tests.cluster.raycluster import LocalRayCluster, free_port
from tests.doubles.scripted_llm import ScriptedLLM, fixed

# The module's cluster comes up in well under a minute; starting it (at most 240 s, raising with the nodes'
# logs) and placing the node services (at most 90 s each) are bounded below this.
pytestmark = [pytest.mark.integration, pytest.mark.ray_cluster, pytest.mark.timeout(600)]

HANDLERS = {"test.script": "tests.doubles.handlers:StageScriptHandler"}
CAPACITIES = [2, 2]


def job(i: int, run_s: float = 0.2, sandbox: bool = True) -> dict[str, Any]:
    return {
        "job_id": f"job-{i:04d}",
        "instance": {
            "data_source": "test.script",
            "instance_id": f"i{i}",
            "init": {"sandbox": sandbox},
            "run": {"sleep": run_s},
            "eval": {"reward": 1.0},
        },
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalRayCluster, dict[str, Any]]]:
    with LocalRayCluster(CAPACITIES) as c:
        base = ServiceConfig(
            state_dir=tmp_path_factory.mktemp("nodes"),
            port=0,
            sandbox={"backend": "local"},
            extra_handlers=HANDLERS,
            shutdown_grace_s=1.0,
        )
        placed = ray_nodes.place(base, start_timeout_s=90.0)
        assert len(placed) == len(CAPACITIES)
        by_host = {p.host: p for p in placed}
        yield c, {"placed": placed, "by_host": by_host}


@asynccontextmanager
async def router_at(
    c: LocalRayCluster, state_dir: Path, **settings: Any
) -> AsyncIterator[tuple[str, ClusterRouter]]:
    cfg = ServiceConfig(state_dir=state_dir, port=0, cancel_grace_s=2.0)
    router = ClusterRouter(
        cfg,
        ray_nodes.RayNodeSource(c.address, node_ip=c.head_ip),
        RouterSettings(poll_s=0.3, node_deadline_s=settings.get("node_deadline_s", 3.0)),
    )
    async with served(router) as url:
        await until(lambda: sum(1 for n in router.node_table() if n["healthy"]) == len(router.nodes) > 0)
        yield url, router


async def until(cond: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.1)


async def results_of(
    http: httpx.AsyncClient, ids: list[str], wait_s: float = 120.0
) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + wait_s
    for job_id in ids:
        while True:
            r = await http.get(f"/v1/jobs/{job_id}/result", params={"wait": 5})
            if r.status_code == 200:
                out[job_id] = r.json()
                break
            assert r.status_code == 202, r.text
            assert time.monotonic() < deadline, f"{job_id} did not finish"
    return out


async def node_get(url: str, path: str) -> httpx.Response:
    """A GET on one node's own API (not through the router)."""
    async with httpx.AsyncClient(base_url=url, timeout=10, trust_env=False) as http:
        return await http.get(path)


async def node_jobs_on(url: str, ids: list[str]) -> set[str]:
    """The jobs among ``ids`` that the node at ``url`` knows."""
    return {j for j in ids if (await node_get(url, f"/v1/jobs/{j}")).status_code == 200}


def sandbox_pids(c: LocalRayCluster) -> list[int]:
    """Live sandboxes (tool servers) started by this cluster's node services."""
    pids = []
    for pid in c.tagged_pids():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(b"RAAS_SANDBOX_ID=") for e in env):
            pids.append(pid)
    return pids


async def test_nodes_placed_one_per_ray_node_with_capacity(
    cluster: tuple[LocalRayCluster, dict[str, Any]],
) -> None:
    c, info = cluster
    records = await asyncio.to_thread(ray_nodes.discover)
    assert sorted(r.host for r in records if r.alive) == sorted(c.ips)
    assert all(r.capacity == 2 and r.url and r.url.startswith(f"http://{r.host}:") for r in records)
    # Re-running adds nothing: one service per node.
    again = await asyncio.to_thread(ray_nodes.place, ServiceConfig(port=0, sandbox={"backend": "local"}))
    assert not any(p.created for p in again)
    assert sorted(p.url for p in again) == sorted(p.url for p in info["placed"])


async def test_jobs_spread_over_all_nodes(
    cluster: tuple[LocalRayCluster, dict[str, Any]], tmp_path: Path
) -> None:
    c, info = cluster
    async with router_at(c, tmp_path / "router") as (url, _router):
        async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
            ids = []
            for i in range(12):
                r = await http.post("/v1/jobs", json=job(i))
                assert r.status_code == 202, r.text
                ids.append(r.json()["job_id"])
            res = await results_of(http, ids)
            assert {r["status"] for r in res.values()} == {"completed"}
            assert all(r["reward"] == 1.0 for r in res.values())
            # idempotent resubmit through the router: same job, nothing new
            again = await http.post("/v1/jobs", json=job(0))
            assert again.json() == {"job_id": "job-0000", "status": "completed", "created": False}
            status = (await http.get("/status")).json()
            assert len(status["nodes"]) == len(CAPACITIES) and status["pending"] == 0
    ran = {p.host: await node_jobs_on(p.url, ids) for p in info["placed"]}
    assert all(ran[h] for h in ran), f"some node got no job: {ran}"
    assert sum(len(v) for v in ran.values()) == len(ids)  # each job ran on exactly one node


async def test_prorl_flow_through_the_router(
    cluster: tuple[LocalRayCluster, dict[str, Any]], tmp_path: Path
) -> None:
    c, _ = cluster
    async with ScriptedLLM(fixed(4), host=c.ips[1]) as llm, router_at(c, tmp_path / "router") as (url, _r):
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False) as http:
            body = {"instance": job(900)["instance"], "sampling_params": {}}
            assert (await http.post("/process", json=body)).status_code == 503  # not started
            assert (await http.post("/start")).status_code == 200
            assert (await http.post("/process", json=body)).status_code == 503  # no LLM server
            assert (await http.post("/add_llm_server", json={"address": llm.url + "/v1"})).status_code == 200
            r = await http.post("/process", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["success"] is True and out["reward"] == 1.0 and out["instance_id"] == "i900"
            bad = await http.post("/process", json={"instance": {"data_source": "nope"}})
            assert bad.status_code == 400
            st = (await http.get("/status")).json()
            assert st["status"] == "running" and st["pending_jobs"] == 0
            assert (await http.post("/clear_llm_server")).status_code == 200
            assert (await http.post("/stop")).status_code == 200


async def test_llm_servers_attach_node_locally_and_pause_fans_out(
    cluster: tuple[LocalRayCluster, dict[str, Any]], tmp_path: Path
) -> None:
    c, info = cluster
    llms = [ScriptedLLM(fixed(2), host=ip) for ip in c.ips] + [ScriptedLLM(fixed(2), host="127.0.0.1")]
    for s in llms:
        await s.start()
    try:
        async with router_at(c, tmp_path / "router") as (url, _r):
            async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
                for s in reversed(llms):  # the order they come in must not matter
                    r = await http.post("/v1/llm/servers", json={"address": s.url})
                    assert r.status_code == 200, r.text
                for p in info["placed"]:
                    servers = (await node_get(p.url, "/v1/llm/servers")).json()["servers"]
                    on_node = {s["address"] for s in servers}
                    local = {s.url for s in llms if s.host == p.host}
                    assert local <= on_node, (p.host, on_node)
                extra = llms[-1].url
                holders = [
                    n for n in (await http.get("/status")).json()["nodes"] if extra in n["llm_servers"]
                ]
                assert len(holders) == 1  # the server on no raas node's host goes to exactly one node
                assert (await http.post("/v1/llm:pause")).status_code == 200
                for p in info["placed"]:
                    assert (await node_get(p.url, "/status")).json()["llm_paused"] is True
                assert (await http.post("/v1/llm:resume")).status_code == 200
                for p in info["placed"]:
                    assert (await node_get(p.url, "/status")).json()["llm_paused"] is False
                assert (await http.post("/v1/llm/servers:clear")).status_code == 200
                for p in info["placed"]:
                    assert (await node_get(p.url, "/v1/llm/servers")).json()["servers"] == []
    finally:
        for s in llms:
            await s.stop()


async def test_router_restart_on_the_same_ledger_continues(
    cluster: tuple[LocalRayCluster, dict[str, Any]], tmp_path: Path
) -> None:
    c, _ = cluster
    ids = [f"restart-{i}" for i in range(6)]
    async with router_at(c, tmp_path / "router") as (url, _r):
        async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
            for i, job_id in enumerate(ids):
                body = job(500 + i, run_s=2.0)
                body["job_id"] = job_id
                assert (await http.post("/v1/jobs", json=body)).status_code == 202
    # The router is gone while the jobs run on the nodes; a new one on the same ledger delivers them.
    await asyncio.sleep(2.5)
    async with router_at(c, tmp_path / "router") as (url, router):
        assert len(router.jobs) + sum(router.finished.values()) == len(ids)
        async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
            res = await results_of(http, ids)
    assert {r["status"] for r in res.values()} == {"completed"}


async def test_cli_status_and_router(cluster: tuple[LocalRayCluster, dict[str, Any]], tmp_path: Path) -> None:
    c, info = cluster
    cli = [sys.executable, "-m", "raas.cli", "cluster"]
    where = ["--address", c.address, "--node-ip", c.head_ip]
    st = await asyncio.to_thread(
        subprocess.run,
        [*cli, "status", *where, "--json"],
        env=c.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert st.returncode == 0, st.stderr
    nodes = json.loads(st.stdout)["nodes"]
    up = await asyncio.to_thread(
        subprocess.run,
        [*cli, "up", *where, "--port", "0", "--sandbox", "local"],
        env=c.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert up.returncode == 0, up.stderr
    assert up.stderr.count("running ") == len(CAPACITIES)  # one service per node already: nothing started
    assert sorted(n["url"] for n in nodes) == sorted(p.url for p in info["placed"])
    assert all(n["alive"] and n["capacity"] == 2 for n in nodes)
    port = free_port()
    env = {**c.env, "RAAS_HOME": str(tmp_path)}
    log = tmp_path / "router.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *cli, "router", *where, "--port", str(port), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=30, trust_env=False
        ) as http:
            deadline = time.monotonic() + 120
            while True:
                assert proc.returncode is None, log.read_text()
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get("/status")).json().get("nodes"):
                        break
                assert time.monotonic() < deadline
                await asyncio.sleep(0.5)
            r = await http.post("/v1/jobs", json=job(800))
            assert r.status_code == 202, r.text
            assert (await results_of(http, [r.json()["job_id"]]))[r.json()["job_id"]]["status"] == "completed"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 60)
    assert code == 0
    assert (tmp_path / "router" / "ledger.sqlite3").exists()


async def test_node_killed_mid_run_jobs_finish_elsewhere(
    cluster: tuple[LocalRayCluster, dict[str, Any]], tmp_path: Path
) -> None:
    c, info = cluster
    victim_host = c.ips[-1]
    victim = info["by_host"][victim_host]
    records = {r.host: r for r in await asyncio.to_thread(ray_nodes.discover)}
    n_jobs = 12
    async with router_at(c, tmp_path / "router", node_deadline_s=3.0) as (url, router):
        events: list[dict[str, Any]] = []

        async def collect() -> None:
            async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False) as h:
                async with h.stream("GET", "/v1/events", params={"terminal_only": "true"}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            events.append(json.loads(line[5:]))

        collector = asyncio.create_task(collect())
        async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
            ids = []
            for i in range(n_jobs):
                r = await http.post("/v1/jobs", json=job(700 + i, run_s=4.0))
                assert r.status_code == 202
                ids.append(r.json()["job_id"])
            await until(lambda: any(n["jobs"] for n in router.node_table() if n["host"] == victim_host))
            on_victim = {j for j, t in router.jobs.items() if t.node == victim.node_id}
            for j in on_victim:  # running there (asked through the router, which asks the node)
                for _ in range(300):
                    if (await http.get(f"/v1/jobs/{j}")).json()["status"] in ("run", "completed"):
                        break
                    await asyncio.sleep(0.1)
            on_victim = {j for j, t in router.jobs.items() if t.node == victim.node_id}  # unfinished there
            c.kill_node(
                len(CAPACITIES) - 1, extra_pids=[records[victim_host].pid] if records[victim_host].pid else []
            )
            res = await results_of(http, ids, wait_s=180)
            assert {r["status"] for r in res.values()} == {"completed"}, res
            assert on_victim
            for j in on_victim:  # each went to another node, and the router's ledger says why
                details = [d or "" for _s, _a, d in await router.ledger.transitions(j)]
                assert any(d.startswith(f"moved: node {victim.node_id} lost") for d in details), details
            await asyncio.sleep(0.5)
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
        terminal = [e["job_id"] for e in events if e["job_id"] in ids]
        assert sorted(terminal) == sorted(ids)  # each job reported finished exactly once
        assert victim.node_id not in router.nodes
    # Nothing of those jobs is left running on the survivors.
    await until(lambda: not sandbox_pids(c), 30)
    for p in info["placed"]:
        if p.host == victim_host:
            continue
        assert (await node_get(p.url, "/status")).json()["pending"] == 0


async def test_down_drains_a_node_and_up_adds_it_back(
    cluster: tuple[LocalRayCluster, dict[str, Any]], tmp_path: Path
) -> None:
    c, info = cluster  # after the kill test: one Ray node left alive
    survivor = info["by_host"][c.ips[0]]
    stopped = await asyncio.to_thread(ray_nodes.remove, survivor.node_id[:12], grace_s=5.0)
    assert stopped == [survivor.node_id]
    with pytest.raises(httpx.TransportError):
        await node_get(survivor.url, "/healthz")
    base = ServiceConfig(state_dir=tmp_path, port=0, sandbox={"backend": "local"}, extra_handlers=HANDLERS)
    again = await asyncio.to_thread(ray_nodes.place, base)
    assert [(p.node_id, p.created) for p in again] == [(survivor.node_id, True)]  # the dead node is not
    assert (await node_get(again[0].url, "/healthz")).status_code == 200
