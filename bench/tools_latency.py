"""Tool-call latency and sandbox start-up per backend, measured from the host API call to its return.

    .venv/bin/python bench/tools_latency.py [--backends local,bwrap,apptainer] [--n 200] [--n-start 20]
        [--concurrent 32,128] [--live 256] [--busy 64] [--only calls,start,claim,concurrent,live,busy]

For each backend: p50/p90/p99 of bash ``true``, ``echo hello``, ``ls /``, ``python3 -c pass`` (n calls
after a warm-up); start-to-ready (``start``: n-start sandboxes, one at a time, cold; with the CPU time one
start costs, this process plus the sandbox's processes as read from /proc when it is ready, which other
load inflates far less than wall time); the
claim from a warm pool (``claim``: n-start sandboxes taken one at a time from a filled pool — what INIT
pays with pools on); ``start_<k>``: k sandboxes started cold at once (each one's start-to-ready, and the
time until all are ready); ``live_<N>``: PSS per idle sandbox (summed over each sandbox's processes from
``/proc/PID/smaps_rollup``) with N live at once; ``busy_<N>``: ``echo`` latency while N sandboxes each run
echo calls back to back, all at once. Writes ``bench/results/tools_latency.json`` (a list of rows:
``backend``, ``kind``, ``p50_ms``, ``p90_ms``, ``p99_ms``, ``n``, ``load_avg_1m`` when the row started) and
prints it. Run it on a quiet machine: other load shows up directly in the wall-clock numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raas.sandbox import Sandbox, SandboxConfig, SandboxManager, procs
from raas.sandbox.config import make_config
from raas.sandbox.images import ImageSpec, build_rootfs, rootfs_path
from raas.sandbox.pool import PoolSettings, config_key

COMMANDS = {"true": "true", "echo": "echo hello", "ls": "ls /", "python3": "python3 -c pass"}
BENCH_IMAGE = ImageSpec(suite="bookworm", packages=("python3", "python3-ipykernel", "python3-jupyter-client"))


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """p50/p90/p99 in milliseconds (nearest-rank on the sorted samples)."""
    xs = sorted(samples_s)

    def rank(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))] * 1000

    return {"p50_ms": round(rank(50), 3), "p90_ms": round(rank(90), 3), "p99_ms": round(rank(99), 3)}


def idle_memory_kb(sb: Sandbox) -> dict[str, int]:
    """PSS (shared pages split fairly) and RSS summed over every process of the sandbox."""
    pss = rss = 0
    for pid in procs.pids_with_env(sb.id):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss += int(line.split()[1])
        except OSError:
            continue
    return {"idle_pss_kb": pss, "idle_rss_kb": rss}


def mem_available_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return -1


def load() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_s() -> float:
    """CPU seconds of this process (the host side of starting and closing)."""
    me = os.times()
    return me.user + me.system


def sandbox_cpu_s(sb: Sandbox) -> float:
    """CPU seconds the sandbox's live processes used so far, from /proc (children's times are lost when a
    runtime is killed before it reaps them, so they are read while the sandbox lives)."""
    total = 0
    for pid in procs.pids_with_env(sb.id):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


async def bench_calls(manager: SandboxManager, config: SandboxConfig, n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async with manager.sandbox(config, owner="bench") as sb:
        for kind, cmd in COMMANDS.items():
            for _ in range(max(10, n // 10)):
                await sb.tools.bash(cmd)
            samples = []
            la = load()
            for _ in range(n):
                t0 = time.perf_counter()
                r = await sb.tools.bash(cmd)
                samples.append(time.perf_counter() - t0)
                if r.exit_code != 0:
                    raise SystemExit(f"{config.backend}: {cmd!r} failed: {r.output}")
            rows.append(
                {"backend": config.backend, "kind": kind, **percentiles(samples), "n": n, "load_avg_1m": la}
            )
        await asyncio.sleep(1.0)  # let it settle before measuring idle memory
        rows[-1].update(idle_memory_kb(sb))
    return rows


async def bench_start(manager: SandboxManager, config: SandboxConfig, n_start: int) -> dict[str, Any]:
    starts = []
    la = load()
    c0 = cpu_s()
    inside = 0.0
    for _ in range(n_start):
        t0 = time.perf_counter()
        sb = await manager.start(config, owner="bench")
        starts.append(time.perf_counter() - t0)
        inside += sandbox_cpu_s(sb)
        await sb.close()
    cpu_ms = (cpu_s() - c0 + inside) / n_start * 1000
    return {
        "backend": config.backend,
        "kind": "start",
        **percentiles(starts),
        "n": n_start,
        "cpu_ms_per_start": round(cpu_ms, 1),
        "load_avg_1m": la,
    }


async def bench_claim(manager: SandboxManager, config: SandboxConfig, n_start: int) -> dict[str, Any]:
    """Claims from a warm pool filled beforehand (refills run in the background meanwhile)."""
    manager.pools.configure(PoolSettings(enabled=True, min_size=n_start, max_size=n_start), [config])
    pool = manager.pools._pools[config_key(config)]
    while len(pool.idle) < n_start:  # noqa: ASYNC110 - a benchmark's wait, polled
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    claims, held = [], []
    la = load()
    for _ in range(n_start):
        t0 = time.perf_counter()
        sb = await manager.start(config, owner="bench")
        claims.append(time.perf_counter() - t0)
        held.append(sb)
    stats = pool.stats
    await manager.pools.stop()
    await asyncio.gather(*(s.close() for s in held))
    return {
        "backend": config.backend,
        "kind": "claim",
        **percentiles(claims),
        "n": n_start,
        "claims": stats.claims,
        "misses": stats.misses,
        "load_avg_1m": la,
    }


async def bench_concurrent(manager: SandboxManager, config: SandboxConfig, concurrent: int) -> dict[str, Any]:
    ready: list[float] = []
    inside: list[float] = []

    async def one(t0: float) -> Sandbox:
        sb = await manager.start(config, owner=f"bench{concurrent}")
        ready.append(time.perf_counter() - t0)
        inside.append(sandbox_cpu_s(sb))
        return sb

    la = load()
    c0 = cpu_s()
    t0 = time.perf_counter()
    sbs = await asyncio.gather(*(one(t0) for _ in range(concurrent)))
    all_ready = time.perf_counter() - t0
    await asyncio.gather(*(s.close() for s in sbs))
    return {
        "backend": config.backend,
        "kind": f"start_{concurrent}",
        **percentiles(ready),
        "n": concurrent,
        "all_ready_ms": round(all_ready * 1000, 3),
        "cpu_ms_per_start": round((cpu_s() - c0 + sum(inside)) / concurrent * 1000, 1),
        "load_avg_1m": la,
    }


async def start_many(manager: SandboxManager, config: SandboxConfig, n: int, owner: str) -> list[Sandbox]:
    limit = asyncio.Semaphore(8)

    async def one() -> Sandbox:
        async with limit:
            return await manager.start(config, owner=owner)

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def bench_live(manager: SandboxManager, config: SandboxConfig, n: int) -> dict[str, Any]:
    """PSS per idle sandbox with ``n`` live at once (pages shared between sandboxes are split among them)."""
    sbs = await start_many(manager, config, n, "bench-live")
    try:
        await asyncio.sleep(2.0)
        la = load()
        per = [idle_memory_kb(sb) for sb in sbs]
        nprocs = sum(len(procs.pids_with_env(sb.id)) for sb in sbs) / n
        pss = sorted(p["idle_pss_kb"] for p in per)
        rss = sorted(p["idle_rss_kb"] for p in per)
        available = mem_available_mb()
    finally:
        await asyncio.gather(*(s.close() for s in sbs))
    return {
        "backend": config.backend,
        "kind": f"live_{n}",
        "n": n,
        "pss_kb_per_sandbox_p50": pss[n // 2],
        "pss_kb_per_sandbox_mean": round(sum(pss) / n),
        "rss_kb_per_sandbox_p50": rss[n // 2],
        "processes_per_sandbox": round(nprocs, 2),
        "mem_available_mb_while_live": available,
        "load_avg_1m": la,
    }


async def bench_busy(
    manager: SandboxManager, config: SandboxConfig, n: int, calls: int = 20
) -> dict[str, Any]:
    """``echo`` latency while ``n`` sandboxes each run ``calls`` echo calls back to back, all at once."""
    sbs = await start_many(manager, config, n, "bench-busy")
    samples: list[float] = []

    async def drive(sb: Sandbox) -> None:
        await sb.tools.bash("echo warm")
        for _ in range(calls):
            t0 = time.perf_counter()
            await sb.tools.bash("echo hello")
            samples.append(time.perf_counter() - t0)

    try:
        la = load()
        t0 = time.perf_counter()
        await asyncio.gather(*(drive(sb) for sb in sbs))
        wall = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(s.close() for s in sbs))
    return {
        "backend": config.backend,
        "kind": f"busy_{n}",
        **percentiles(samples),
        "n": len(samples),
        "calls_per_s": round(len(samples) / wall, 1),
        "load_avg_1m": la,
    }


async def bench_backend(
    manager: SandboxManager, config: SandboxConfig, args: argparse.Namespace
) -> list[dict[str, Any]]:
    only = set(args.only.split(","))
    rows: list[dict[str, Any]] = []
    if "calls" in only:
        rows += await bench_calls(manager, config, args.n)
    if "start" in only:
        rows.append(await bench_start(manager, config, args.n_start))
    if "claim" in only:
        rows.append(await bench_claim(manager, config, args.n_start))
    if "concurrent" in only:
        for k in (int(x) for x in args.concurrent.split(",") if x):
            rows.append(await bench_concurrent(manager, config, k))
    if "live" in only and args.live and config.backend in args.live_backends.split(","):
        rows.append(await bench_live(manager, config, args.live))
    if "busy" in only and args.busy and config.backend in args.live_backends.split(","):
        rows.append(await bench_busy(manager, config, args.busy))
    return rows


def write_json(path: Path, rows: list[dict[str, Any]], *, merge: bool = False) -> list[dict[str, Any]]:
    """Write ``rows``; with ``merge``, after the rows of the existing file that this run did not measure."""
    if merge and path.exists():
        fresh = {(r["backend"], r["kind"]) for r in rows}
        rows = [r for r in json.loads(path.read_text()) if (r["backend"], r["kind"]) not in fresh] + rows
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        kinds = [*COMMANDS, "start", "claim", "start_", "live_", "busy_"]

        def order(r: dict[str, Any]) -> tuple[int, int, int]:
            kind = r["kind"]
            k = kinds.index(kind) if kind in kinds else kinds.index(kind.split("_")[0] + "_")
            n = int(kind.split("_")[1]) if "_" in kind else 0
            return backends.index(r["backend"]), k, n

        rows.sort(key=order)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="local,bwrap,apptainer")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--n-start", type=int, default=20)
    ap.add_argument("--concurrent", default="32,128", help="comma-separated counts of simultaneous starts")
    ap.add_argument(
        "--live", type=int, default=256, help="PSS per idle sandbox with this many live (0: skip)"
    )
    ap.add_argument(
        "--busy", type=int, default=64, help="echo latency with this many busy sandboxes (0: skip)"
    )
    ap.add_argument("--live-backends", default="bwrap", help="backends the live/busy rows run on")
    ap.add_argument("--only", default="calls,start,claim,concurrent,live,busy")
    ap.add_argument("--merge", action="store_true", help="keep rows of the output file not measured now")
    ap.add_argument("--image", default=None, help="rootfs dir (default: the test image, built if missing)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tools_latency.json"))
    args = ap.parse_args()

    load_before = os.getloadavg()[0]  # at the end it mostly shows the benchmark's own 32-sandbox burst
    image = args.image
    if image is None:
        path = rootfs_path(BENCH_IMAGE)
        image = str(path if (path / "usr").is_dir() else build_rootfs(BENCH_IMAGE))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="raas-bench-") as state:
        manager = SandboxManager(state)
        try:
            for backend in args.backends.split(","):
                config = make_config(
                    backend=backend, image=None if backend == "local" else image, start_timeout_s=300
                )
                new = await bench_backend(manager, config, args)
                rows += new
                print(json.dumps(new), file=sys.stderr, flush=True)
        finally:
            await manager.close_all()
    meta = {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_avg_1m_before": round(load_before, 2),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for row in rows:
        row["machine"] = meta
    rows = write_json(Path(args.out), rows, merge=args.merge)
    print(json.dumps(rows, indent=1))
    summary = {(r["backend"], r["kind"]): r.get("p50_ms", r.get("pss_kb_per_sandbox_p50")) for r in rows}
    print(json.dumps({f"{b}/{k}": v for (b, k), v in summary.items()}), file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
