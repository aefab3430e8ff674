"""Scale-out of raas on a local Ray cluster: 1, 2 and 4 raas nodes behind the router.

Workload: sandbox-light and LLM-latency-bound, like a rollout fleet whose inference servers are the
bottleneck. Each Ray node runs one raas node service (capacity ``--capacity`` = its ``raas_sandbox``
resource = its RUN workers) and one scripted policy server on the node's own address (``--capacity``
slots, ``--tokens`` tokens per completion at ``--tokens-per-s`` per slot), which the router attaches to
that node (node-local assignment). A job is one generate call through the node's balancer, then a
constant reward. With N nodes the cluster has N times the inference capacity, so ideal throughput is
N times that of one node; ``efficiency = throughput(N) / (N * throughput(1))``.

All Ray nodes run on this machine (each its own ``ray start`` on its own loopback address), so the
router (a process of its own, as in a real deployment), every node service, every policy server and the
client share its cores: the load average is reported.

Router added latency: per job, the time from submit (at the client) to the router's terminal event (at
the client) minus the node's own ``timing.total_s`` (accept to end on the node) — what the front door
costs: admission into its ledger, hand-over, following the node's event stream, fetching and recording
the result. Measured under the burst (where it includes the time a job waits for the router itself)
and for ``--probes`` single jobs sent one at a time.

    python bench/cluster.py [--nodes 1 2 4] [--jobs-per-node 48] [--capacity 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.raycluster import LocalRayCluster, free_port  # noqa: E402

from raas.api import served  # noqa: E402
from raas.cluster import ray_nodes  # noqa: E402
from raas.cluster.nodes import NodeRecord  # noqa: E402
from raas.cluster.router import ClusterRouter, RouterSettings  # noqa: E402
from raas.pipeline.config import ServiceConfig  # noqa: E402

HANDLERS = {"test.script": "tests.doubles.handlers:StageScriptHandler"}


class FirstNodes:
    """The router's node source limited to the nodes on ``hosts`` (one Ray cluster serves every N)."""

    def __init__(self, inner: ray_nodes.RayNodeSource, hosts: set[str]) -> None:
        self.inner = inner
        self.hosts = hosts

    async def start(self) -> None:
        await self.inner.start()

    async def snapshot(self) -> list[NodeRecord]:
        return [r for r in await self.inner.snapshot() if r.host in self.hosts]

    async def close(self) -> None:
        await self.inner.close()


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def run_jobs(url: str, n: int, tag: str, tokens: int) -> dict[str, Any]:
    """Submit ``n`` jobs at once; wait for every terminal event on the router's stream."""
    ids = [f"{tag}-{i:05d}" for i in range(n)]
    submitted: dict[str, float] = {}
    ended: dict[str, float] = {}
    all_done = asyncio.Event()
    limits = httpx.Limits(max_connections=40, max_keepalive_connections=40)
    async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False, limits=limits) as http:
        opened = asyncio.Event()

        async def follow() -> None:
            async with http.stream("GET", "/v1/events", params={"terminal_only": "true"}) as r:
                async for line in r.aiter_lines():
                    opened.set()
                    if line.startswith("data:"):
                        ev = json.loads(line[5:])
                        if ev["job_id"] in submitted and ev["job_id"] not in ended:
                            ended[ev["job_id"]] = time.perf_counter()
                            if len(ended) == n:
                                all_done.set()

        follower = asyncio.create_task(follow())
        await asyncio.wait_for(opened.wait(), 30)
        t0 = time.perf_counter()

        async def submit(job_id: str) -> None:
            body = {
                "job_id": job_id,
                "instance": {
                    "data_source": "test.script",
                    "run": {"generate": [1, 2, 3], "max_tokens": tokens},
                    "eval": {"reward": 1.0},
                },
            }
            submitted[job_id] = time.perf_counter()
            r = await http.post("/v1/jobs", json=body)
            r.raise_for_status()

        sem = asyncio.Semaphore(32)

        async def limited(job_id: str) -> None:
            async with sem:
                await submit(job_id)

        await asyncio.gather(*(limited(j) for j in ids))
        await asyncio.wait_for(all_done.wait(), 900)
        wall = max(ended.values()) - t0
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        results = []
        for j in ids:
            r = await http.get(f"/v1/jobs/{j}/result")
            results.append(r.json())
    statuses = {r["status"] for r in results}
    added = [(ended[r["job_id"]] - submitted[r["job_id"]]) - r["timing"]["total_s"] for r in results]
    return {
        "jobs": n,
        "wall_s": round(wall, 3),
        "rollouts_per_s": round(n / wall, 3),
        "statuses": sorted(statuses),
        "router_added_ms_p50": round(1000 * percentile(added, 0.5), 2),
        "router_added_ms_p99": round(1000 * percentile(added, 0.99), 2),
        "node_total_s_p50": round(statistics.median(r["timing"]["total_s"] for r in results), 3),
    }


def start_llm(
    host: str, args: argparse.Namespace, env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port(host)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tests.doubles.scripted_llm", "--host", host, "--port", str(port),
            "--tokens", str(args.tokens), "--capacity", str(args.capacity),
            "--tokens-per-s", str(args.tokens_per_s),
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("SCRIPTED_LLM_READY"):
        proc.kill()
        raise RuntimeError(f"scripted LLM on {host} did not start: {line!r}")
    return proc, line.split()[1]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    max_n = max(args.nodes)
    load_start = os.getloadavg()[0]
    out: dict[str, Any] = {}
    with (
        tempfile.TemporaryDirectory(prefix="raas-bench-cluster-") as tmp,
        LocalRayCluster([args.capacity] * max_n) as c,
    ):
        base = ServiceConfig(
            state_dir=Path(tmp) / "nodes", port=0, sandbox={"backend": "local"}, extra_handlers=HANDLERS
        )
        placed = await asyncio.to_thread(ray_nodes.place, base)
        hosts = sorted(p.host for p in placed)
        llms = [start_llm(h, args, c.env) for h in hosts]
        try:
            for n in args.nodes:
                chosen = sorted(hosts[:n])
                port = free_port()
                log = Path(tmp) / f"router-{n}.log"
                with log.open("wb") as router_out:
                    router = await asyncio.create_subprocess_exec(
                        sys.executable, __file__, "--serve-router", ",".join(chosen), "--address", c.address,
                        "--node-ip", c.head_ip, "--port", str(port), "--state-dir", str(Path(tmp) / f"router-{n}"),
                        env=c.env, stdout=router_out, stderr=subprocess.STDOUT,
                    )  # fmt: skip
                url = f"http://127.0.0.1:{port}"
                try:
                    async with httpx.AsyncClient(base_url=url, timeout=30, trust_env=False) as http:
                        while True:
                            if router.returncode is not None:
                                raise RuntimeError(f"router exited: {log.read_text()[-3000:]}")
                            with contextlib.suppress(httpx.TransportError):
                                nodes = (await http.get("/status")).json().get("nodes") or []
                                if sum(1 for x in nodes if x["healthy"]) == n:
                                    break
                            await asyncio.sleep(0.2)
                        await http.post("/v1/llm/servers:clear")
                        for (_p, llm_url), host in zip(llms, hosts, strict=True):
                            if host in chosen:
                                (
                                    await http.post("/v1/llm/servers", json={"address": llm_url})
                                ).raise_for_status()
                    await run_jobs(url, n * args.capacity, f"warm{n}", args.tokens)  # one wave
                    out[str(n)] = await run_jobs(url, n * args.jobs_per_node, f"n{n}", args.tokens)
                    # The router's own cost without a burst queued in front: one job at a time.
                    single = [await run_jobs(url, 1, f"s{n}-{i}", args.tokens) for i in range(args.probes)]
                    added = [x["router_added_ms_p50"] for x in single]
                    out[str(n)]["single_job_router_added_ms_p50"] = round(statistics.median(added), 2)
                    out[str(n)]["single_job_router_added_ms_p99"] = round(percentile(added, 0.99), 2)
                    out[str(n)]["load_avg_end"] = round(os.getloadavg()[0], 2)
                finally:
                    router.terminate()
                    await asyncio.wait_for(router.wait(), 30)
                print(json.dumps({"nodes": n, **out[str(n)]}), file=sys.stderr, flush=True)
        finally:
            for proc, _ in llms:
                proc.terminate()
                proc.wait(10)
    one = out[str(min(args.nodes))]["rollouts_per_s"] / min(args.nodes)
    return {
        "workload": {
            "capacity_per_node": args.capacity,
            "tokens": args.tokens,
            "tokens_per_s": args.tokens_per_s,
            "llm_seconds_per_job": args.tokens / args.tokens_per_s,
            "jobs_per_node": args.jobs_per_node,
            "ideal_rollouts_per_s_per_node": round(args.capacity * args.tokens_per_s / args.tokens, 3),
        },
        "runs": out,
        "efficiency": {k: round(v["rollouts_per_s"] / (int(k) * one), 3) for k, v in out.items()},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_avg_start": round(load_start, 2),
        },
    }


async def serve_router(args: argparse.Namespace) -> None:
    """The router of one run, in a process of its own (as a trainer's router would be), limited to the
    run's nodes; until SIGTERM."""
    import signal

    router = ClusterRouter(
        ServiceConfig(state_dir=args.state_dir, max_pending=100_000),
        FirstNodes(
            ray_nodes.RayNodeSource(args.address, node_ip=args.node_ip), set(args.serve_router.split(","))
        ),
        RouterSettings(poll_s=1.0),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with served(router, port=args.port):
        await stop.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--jobs-per-node", type=int, default=48)
    p.add_argument("--capacity", type=int, default=4, help="sandboxes and LLM slots per node")
    p.add_argument("--tokens", type=int, default=20, help="tokens per completion")
    p.add_argument("--tokens-per-s", type=float, default=40.0, help="decode speed per LLM slot")
    p.add_argument("--probes", type=int, default=20, help="single jobs for the unloaded router latency")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cluster.json")
    p.add_argument("--serve-router", help=argparse.SUPPRESS)  # internal: the router process of one run
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--node-ip", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--state-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_router:
        asyncio.run(serve_router(args))
        return
    result = asyncio.run(bench(args))
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
