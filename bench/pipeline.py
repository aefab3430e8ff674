"""Pipeline benchmarks; prints one JSON document and writes it to bench/results/pipeline.json.

1. ``overhead``: a trivial task (one generate call against an instant scripted policy, one ``echo`` in the
   sandbox) through the real service with ``local``, ``bwrap`` and ``apptainer`` sandboxes (and with no
   sandbox, to show the service's own cost), each without and with warm pools (``overhead.<backend>`` and
   ``overhead.<backend>.pool``): rollouts/s with everything submitted at once, the service process's own
   CPU time per rollout, the sandboxes' (``sandbox_cpu_ms_per_rollout``: the service's reaped child
   processes) and the whole machine's (``machine_cpu_ms_per_rollout``, from /proc/stat: everything,
   the scripted policy and anything else running included) and, where the benchmark can put itself in a
   cgroup-v1 ``cpuacct`` group (root), its whole process tree's (``tree_cpu_ms_per_rollout``: service,
   sandboxes and scripted policy, not other users of the machine), the load average when the run started, and the
   latency the service adds to one rollout (its total time minus the time spent inside the three stages),
   rollouts run one by one, and ``burst_32``: a trainer's next batch of 32 after a pause (with pools: once
   the pool refilled), the time until all are done. The scripted policy runs in a process of its own
   (``python -m tests.doubles.scripted_llm``).
2. ``decoupling`` (in ``pipeline_decoupling.py``): a scripted vLLM-protocol server with a fixed capacity (``capacity`` concurrent
   sequences at ``tokens_per_s`` each) and INIT/EVAL latencies drawn from log-normal distributions.
   raas's three pools versus a coupled baseline (one pool of workers each doing init → run → eval) with
   the same total number of workers. Reported: LLM slot utilization over the steady-state window (between
   10% and 90% of jobs finished) and rollouts/s.
3. ``rss``: resident memory every 1,000 rollouts over 10,000 trivial rollouts (no sandbox, no LLM).

Usage: ``python bench/pipeline.py [--quick] [--only overhead,decoupling,rss] [--backends none,local,bwrap,apptainer]
[--pools off,on] [--merge] [--out FILE]`` (``--merge`` keeps what the output file holds and this run did not
measure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline_common import REPO, BenchHandler, PolicyProcess, make_service, run_all
from pipeline_decoupling import decoupling
from raas.llm import LLMBalancer
from raas.pipeline.service import RolloutService
from raas.sandbox.images import image_cache_dir


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def default_bwrap_image() -> str | None:
    candidates = sorted(p for p in image_cache_dir().glob("rootfs-*") if p.is_dir())
    return str(candidates[0]) if candidates else None


# -- 1. overhead -------------------------------------------------------------------------------------------


WARM_POOL = {"enabled": True, "min_size": 8, "max_size": 32, "refill_concurrency": 2}
BURST = 32


async def pool_filled(service: RolloutService, n: int, limit_s: float = 600.0) -> int:
    """Wait until the service's pools hold ``n`` idle sandboxes (or ``limit_s`` passed); how many they hold."""

    def idle() -> int:
        return sum(p["idle"] for p in service.status()["warm_pools"]["pools"])

    deadline = time.monotonic() + limit_s
    while idle() < n and time.monotonic() < deadline:  # noqa: ASYNC110 - a benchmark's wait, polled
        await asyncio.sleep(0.1)
    return idle()


def cpu_s() -> float:
    """CPU seconds of the service's own process (the sandboxes' CPU: bench/tools_latency.py)."""
    t = os.times()
    return t.user + t.system


def children_cpu_s() -> float:
    """CPU seconds of the service's reaped child processes: the sandboxes (runtime, tool server, and the
    shells the tool server reaped), counted once each has exited."""
    t = os.times()
    return t.children_user + t.children_system


class TreeCpu:
    """CPU time of this process and everything it starts (sandboxes, the scripted policy), unaffected by
    whatever else runs on the machine: a cgroup-v1 ``cpuacct`` group of its own, where this process may
    create one (root on a cgroup-v1 host); otherwise unavailable (``seconds()`` is None)."""

    ROOT = Path("/sys/fs/cgroup/cpuacct")

    def __init__(self) -> None:
        self.group: Path | None = None
        self.parent: Path | None = None

    def __enter__(self) -> TreeCpu:
        try:
            rel = next(
                line.split(":", 2)[2]
                for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "cpuacct" in line.split(":")[1].split(",")
            )
            parent = self.ROOT / rel.lstrip("/")
            group = parent / f"raas-bench-{os.getpid()}"
            group.mkdir()
            (group / "cgroup.procs").write_text(str(os.getpid()))
            self.group, self.parent = group, parent
        except (OSError, StopIteration, IndexError):
            self.group = None
        return self

    def seconds(self) -> float | None:
        if self.group is None:
            return None
        return int((self.group / "cpuacct.usage").read_text()) / 1e9

    def __exit__(self, *exc: object) -> None:
        if self.group is not None and self.parent is not None:
            (self.parent / "cgroup.procs").write_text(str(os.getpid()))
            for _ in range(50):  # our children are gone; the group empties once they are reaped
                try:
                    self.group.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


TREE_CPU = TreeCpu()


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all processes, kernel included; from /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


async def overhead_one(
    root: Path, balancer: LLMBalancer, name: str, sandbox: dict[str, Any] | None, count: int, pool: bool
) -> dict[str, Any]:
    state = root / f"overhead-{name}-{'pool' if pool else 'cold'}"
    service = await make_service(
        state,
        balancer,
        sandbox or {"backend": "local"},
        init_workers=4,
        run_workers=8,
        eval_workers=4,
        warm_pool=WARM_POOL if pool else {"enabled": False},
    )
    try:
        instance = {"data_source": BenchHandler.name, "sandbox": sandbox is not None, "turns": 1, "tokens": 8}
        await run_all(service, [instance] * 5)  # warm-up (bundle build, connections)
        if pool:  # a service that has been up a while: its pool holds min_size
            await pool_filled(service, WARM_POOL["min_size"])
        load = round(os.getloadavg()[0], 2)
        c0, k0, m0, tree0 = cpu_s(), children_cpu_s(), machine_busy_s(), TREE_CPU.seconds()
        t0 = time.perf_counter()
        results = await run_all(service, [instance] * count)
        wall = time.perf_counter() - t0
        cpu = cpu_s() - c0
        await asyncio.sleep(0.2)  # the last sandboxes' processes are reaped
        kids, busy, tree1 = children_cpu_s() - k0, machine_busy_s() - m0, TREE_CPU.seconds()
        tree = None if tree0 is None or tree1 is None else round((tree1 - tree0) / count * 1000, 2)
        ok = sum(1 for r in results if r is not None and r.status == "completed")
        pools = service.status()["warm_pools"]["pools"]
        added, totals, inits = [], [], []
        for _ in range(max(10, count // 10)):  # one at a time: the latency the service adds
            (r,) = await run_all(service, [instance])
            t = r.timing
            added.append(t.total_s - t.init_s - t.run_s - t.eval_s)
            totals.append(t.total_s)
            inits.append(t.init_s)
        # A trainer's next batch after a pause (it trained meanwhile): BURST rollouts at once.
        ready = await pool_filled(service, BURST, 120.0) if pool else 0
        load_burst = round(os.getloadavg()[0], 2)
        t0 = time.perf_counter()
        burst = await run_all(service, [instance] * BURST)
        burst_s = time.perf_counter() - t0
        burst_inits = [r.timing.init_s for r in burst if r is not None]
        out = {
            "warm_pool": pool,
            "rollouts": count,
            "completed": ok,
            "wall_s": round(wall, 3),
            "rollouts_per_s": round(ok / wall, 1),
            "service_cpu_ms_per_rollout": round(cpu / count * 1000, 2),
            "sandbox_cpu_ms_per_rollout": round(kids / count * 1000, 2),
            "machine_cpu_ms_per_rollout": round(busy / count * 1000, 2),
            "tree_cpu_ms_per_rollout": tree,
            "load_avg_1m": load,
            "added_latency_ms_p50": round(statistics.median(added) * 1e3, 3),
            "added_latency_ms_p99": round(pct(added, 0.99) * 1e3, 3),
            "single_rollout_ms_p50": round(statistics.median(totals) * 1e3, 2),
            "init_ms_p50": round(statistics.median(inits) * 1e3, 2),
            f"burst_{BURST}": {
                "all_done_s": round(burst_s, 3),
                "init_ms_p50": round(statistics.median(burst_inits) * 1e3, 2),
                "pooled_ready_before": ready,
                "load_avg_1m": load_burst,
            },
        }
        if pools:
            p = pools[0]
            out["pool_stats"] = {k: p[k] for k in ("claims", "misses", "refills", "discarded", "target")}
        return out
    finally:
        await service.shutdown(0)
        await service.sandbox_manager.close_all()


async def overhead(
    root: Path, n: dict[str, int], image: str | None, backends: list[str], pools: list[bool]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with PolicyProcess({"tokens": 8}) as llm:  # instant: no capacity model
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(llm.url)
        for name in backends:
            sandbox: dict[str, Any] | None = None
            if name != "none":
                sandbox = {"backend": name}
                if name != "local":
                    if not image:
                        out[name] = {"skipped": "no rootfs image (build one with `raas image build`)"}
                        continue
                    sandbox["image"] = image
            row: dict[str, Any] = {}
            for pool in pools if sandbox is not None else [False]:
                figures = await overhead_one(root, balancer, name, sandbox, n[name], pool)
                print(json.dumps({name: figures}), file=sys.stderr, flush=True)
                if pool:
                    row["pool"] = figures
                else:
                    row = {**figures, **row}
            out[name] = row
        await balancer.aclose()
    return out


# -- 3. rss ------------------------------------------------------------------------------------------------


async def rss(root: Path, total: int) -> dict[str, Any]:
    service = await make_service(
        root / "rss", None, {"backend": "local"}, init_workers=4, run_workers=8, eval_workers=4
    )
    instance = {"data_source": BenchHandler.name, "sandbox": False, "turns": 0}
    series: list[tuple[int, float]] = [(0, round(rss_mb(), 1))]
    done = 0
    t0 = time.perf_counter()
    try:
        while done < total:
            batch = min(500, total - done)
            await run_all(service, [instance] * batch)
            done += batch
            if done % 1000 == 0 or done == total:
                series.append((done, round(rss_mb(), 1)))
    finally:
        await service.shutdown(0)
    wall = time.perf_counter() - t0
    warm = next((mb for n, mb in series if n >= total // 5), series[0][1])
    return {
        "rollouts": total,
        "rollouts_per_s": round(total / wall, 1),
        "rss_mb_series": series,
        "rss_mb_after_warmup": warm,
        "rss_mb_end": series[-1][1],
        "growth_after_warmup_mb": round(series[-1][1] - warm, 1),
    }


# -- main --------------------------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    only = set(args.only.split(",")) if args.only else {"overhead", "decoupling", "rss"}
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "quick": args.quick,
    }
    with tempfile.TemporaryDirectory(prefix="raas-bench-") as tmp:
        root = Path(tmp)
        if "overhead" in only:
            sizes = (
                {"none": 100, "local": 40, "bwrap": 20, "apptainer": 10}
                if args.quick
                else {"none": 1000, "local": 200, "bwrap": 200, "apptainer": 100}
            )
            backends = args.backends.split(",")
            pools = [{"off": False, "on": True}[p] for p in args.pools.split(",")]
            result["overhead"] = await overhead(root, sizes, args.bwrap_image, backends, pools)
        if "decoupling" in only:
            d = await decoupling(root, args.jobs or (150 if args.quick else 400))
            result["decoupling"] = d
            result["llm_utilization"] = d["raas"]["llm_utilization"]
            result["coupled_llm_utilization"] = d["coupled"]["llm_utilization"]
            result["rollouts_per_s"] = d["raas"]["rollouts_per_s"]
            result["coupled_rollouts_per_s"] = d["coupled"]["rollouts_per_s"]
        if "rss" in only:
            result["rss"] = await rss(root, 1000 if args.quick else 10_000)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--only", help="comma-separated subset: overhead,decoupling,rss")
    parser.add_argument("--jobs", type=int, help="jobs in the decoupling benchmark")
    parser.add_argument(
        "--bwrap-image", default=default_bwrap_image(), help="rootfs dir for the bwrap and apptainer runs"
    )
    parser.add_argument("--backends", default="none,local,bwrap,apptainer", help="overhead: sandbox backends")
    parser.add_argument(
        "--pools", default="off,on", help="overhead: without (off) and/or with (on) warm pools"
    )
    parser.add_argument(
        "--merge", action="store_true", help="keep results in --out that this run did not redo"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "pipeline.json")
    args = parser.parse_args()
    with TREE_CPU:
        result = asyncio.run(main_async(args))
    if args.merge and args.out and args.out.exists():
        old = json.loads(args.out.read_text())
        overhead_new = result.pop("overhead", {})
        merged_overhead = {**old.get("overhead", {}), **overhead_new}
        result = {**old, **result, "overhead": merged_overhead}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
