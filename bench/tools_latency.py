"""Tool-call latency and sandbox start-up per backend, measured from the host API call to its return.

    .venv/bin/python bench/tools_latency.py [--backends local,bwrap,apptainer] [--n 200] [--n-start 20]

For each backend: p50/p90/p99 of bash ``true``, ``echo hello``, ``ls /``, ``python3 -c pass`` (n calls
after a warm-up); start-to-ready (n-start sandboxes, one at a time); 32 sandboxes started at once
(each one's start-to-ready, plus the time until all are ready); the memory of one idle sandbox (PSS,
summed over its processes). Writes ``bench/results/tools_latency.json`` (a list of rows: ``backend``,
``kind`` in ``true|echo|ls|python3|start|start_32``, ``p50_ms``, ``p90_ms``, ``p99_ms``, ``n``) and prints it.
Run it on a quiet machine: other load shows up directly in the numbers.
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
from raas.sandbox.images import ImageSpec, build_rootfs, rootfs_path

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


async def bench_backend(
    manager: SandboxManager, config: SandboxConfig, n: int, n_start: int, concurrent: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    backend = config.backend
    async with manager.sandbox(config, owner="bench") as sb:
        for kind, cmd in COMMANDS.items():
            for _ in range(max(10, n // 10)):
                await sb.tools.bash(cmd)
            samples = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = await sb.tools.bash(cmd)
                samples.append(time.perf_counter() - t0)
                if r.exit_code != 0:
                    raise SystemExit(f"{backend}: {cmd!r} failed: {r.output}")
            rows.append({"backend": backend, "kind": kind, **percentiles(samples), "n": n})
        await asyncio.sleep(1.0)  # let it settle before measuring idle memory
        memory = idle_memory_kb(sb)
    starts = []
    for _ in range(n_start):
        t0 = time.perf_counter()
        sb = await manager.start(config, owner="bench")
        starts.append(time.perf_counter() - t0)
        await sb.close()
    rows.append({"backend": backend, "kind": "start", **percentiles(starts), "n": n_start, **memory})

    ready: list[float] = []

    async def one(t0: float) -> Sandbox:
        sb = await manager.start(config, owner="bench32")
        ready.append(time.perf_counter() - t0)
        return sb

    t0 = time.perf_counter()
    sbs = await asyncio.gather(*(one(t0) for _ in range(concurrent)))
    all_ready = time.perf_counter() - t0
    await asyncio.gather(*(s.close() for s in sbs))
    rows.append(
        {
            "backend": backend,
            "kind": f"start_{concurrent}",
            **percentiles(ready),
            "n": concurrent,
            "all_ready_ms": round(all_ready * 1000, 3),
        }
    )
    return rows


def write_json(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="local,bwrap,apptainer")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--n-start", type=int, default=20)
    ap.add_argument("--concurrent", type=int, default=32)
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
                config = SandboxConfig(
                    backend=backend, image=None if backend == "local" else image, start_timeout_s=300
                )
                rows += await bench_backend(manager, config, args.n, args.n_start, args.concurrent)
                print(json.dumps(rows[-6:]), file=sys.stderr, flush=True)
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
    write_json(Path(args.out), rows)
    print(json.dumps(rows, indent=1))
    summary = {(r["backend"], r["kind"]): r["p50_ms"] for r in rows}
    print(json.dumps({f"{b}/{k}": v for (b, k), v in summary.items()}), file=sys.stderr)


if __name__ == "__main__":
    asyncio.run(main())
