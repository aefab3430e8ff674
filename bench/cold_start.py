"""Cold sandbox start: start-to-ready, CPU per start, first call, memory per sandbox — two raas trees, interleaved.

    .venv/bin/python bench/cold_start.py --before /path/to/other/raas [--after .] [--backends local,bwrap,apptainer]
        [--rounds 4] [--n 5] [--concurrent 32]

Each tree's numbers come from worker processes that import raas from ``<tree>/src`` (so each uses its own
tool server and launch commands); the trees alternate round by round, so both see the same machine load.
Per backend and tree:

* ``ready_ms``: start-to-ready (the host's ``manager.start`` until it returns: spawned, ready line, ping);
* ``cpu_ready_ms``: CPU time (user+sys, from ``/proc/PID/task/*/schedstat``, ns resolution) of the
  sandbox's processes alive at ready (runtime helpers that already exited are not counted) — robust on a
  loaded machine, unlike wall time;
* ``first_call_ms`` / ``cpu_first_call_ms``: the first ``bash echo`` after ready (a bash session starts
  there, and the tool server imports the bash tool), its wall time and the CPU it cost the sandbox;
* ``echo_ms``: warm ``bash echo`` calls (the server's event loop per call);
* ``idle_pss_kb`` / ``busy_pss_kb`` / ``procs_*``: PSS summed over the sandbox's processes (from
  ``/proc/PID/smaps_rollup``) and their number, idle after start and after one bash call;
* ``all_ready_<N>_ms``: N bwrap sandboxes started at once, the time until all are ready;
  ``idle_pss_kb_with_<N>_live``: PSS per sandbox while those N are idle (shared pages split among them).

Writes ``bench/results/cold_start.json`` and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ECHOES = 100  # warm ``echo`` calls per worker: the event loop's own cost per call


def percentile(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))] if s else float("nan")


def summary(xs: list[float]) -> dict[str, float]:
    return {"p50": round(percentile(xs, 50), 3), "p99": round(percentile(xs, 99), 3), "n": len(xs)}


# -- worker (runs inside one tree) ---------------------------------------------------------------------


def cpu_ns(pid: int) -> int:
    total = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total


def pss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


async def worker(backend: str, image: str | None, n: int, concurrent: int) -> dict[str, Any]:
    from raas.sandbox import SandboxManager, procs

    try:  # one config class per backend in newer trees
        from raas.sandbox import make_config
    except ImportError:
        from raas.sandbox import SandboxConfig as make_config  # type: ignore[attr-defined,no-redef]

    config = make_config(backend=backend, image=image, start_timeout_s=300)
    out: dict[str, Any] = {"ready_ms": [], "cpu_ready_ms": [], "first_call_ms": [], "cpu_first_call_ms": []}
    with tempfile.TemporaryDirectory(prefix="raas-cold-") as state:
        manager = SandboxManager(state)
        try:
            await (await manager.start(config, owner="warmup")).close()  # bundle, image, identity caches
            for i in range(n):
                t0 = time.perf_counter()
                sb = await manager.start(config, owner="cold")
                out["ready_ms"].append((time.perf_counter() - t0) * 1000)
                pids = procs.pids_with_env(sb.id)
                cpu_ready = sum(cpu_ns(p) for p in pids)
                out["cpu_ready_ms"].append(cpu_ready / 1e6)
                if i == 0:
                    await asyncio.sleep(0.5)
                    out["procs_idle"] = len(pids)
                    out["idle_pss_kb"] = sum(pss_kb(p) for p in pids)
                t1 = time.perf_counter()
                r = await sb.tools.bash("echo hello")
                out["first_call_ms"].append((time.perf_counter() - t1) * 1000)
                assert r.output == "hello\n", r
                cpu_after = sum(cpu_ns(p) for p in procs.pids_with_env(sb.id))
                out["cpu_first_call_ms"].append((cpu_after - cpu_ready) / 1e6)
                if i == 0:
                    await asyncio.sleep(0.5)
                    pids = procs.pids_with_env(sb.id)
                    out["procs_busy"] = len(pids)
                    out["busy_pss_kb"] = sum(pss_kb(p) for p in pids)
                    out["echo_ms"] = []
                    for _ in range(ECHOES):
                        t1 = time.perf_counter()
                        await sb.tools.bash("echo hello")
                        out["echo_ms"].append((time.perf_counter() - t1) * 1000)
                await sb.close()
            if concurrent:
                t0 = time.perf_counter()
                sbs = await asyncio.gather(*(manager.start(config, owner="burst") for _ in range(concurrent)))
                out[f"all_ready_{concurrent}_ms"] = (time.perf_counter() - t0) * 1000
                await asyncio.sleep(0.5)
                total = sum(pss_kb(p) for s in sbs for p in procs.pids_with_env(s.id))
                out[f"idle_pss_kb_with_{concurrent}_live"] = total / concurrent
                await asyncio.gather(*(s.close() for s in sbs))
        finally:
            await manager.close_all()
    return out


# -- driver -----------------------------------------------------------------------------------------------


def run_worker(tree: Path, backend: str, image: str | None, n: int, concurrent: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    cmd = [sys.executable, __file__, "--worker", backend, "--n", str(n), "--concurrent", str(concurrent)]
    if image:
        cmd += ["--image", image]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"worker {tree} {backend} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def bench_image() -> str:
    sys.path.insert(0, str(HERE))
    from raas.sandbox.images import build_rootfs, rootfs_path
    from tools_latency import BENCH_IMAGE

    path = rootfs_path(BENCH_IMAGE)
    return str(path if (path / "usr").is_dir() else build_rootfs(BENCH_IMAGE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="the raas tree to compare against (e.g. a main checkout)")
    ap.add_argument("--after", type=Path, default=HERE.parent)
    ap.add_argument("--backends", default="local,bwrap,apptainer")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--n", type=int, default=5, help="starts per round, backend and tree")
    ap.add_argument("--concurrent", type=int, default=32, help="bwrap starts at once (0: skip)")
    ap.add_argument("--image", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(HERE / "results" / "cold_start.json"))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(asyncio.run(worker(args.worker, args.image, args.n, args.concurrent))))
        return

    image = args.image or bench_image()
    trees = {"after": args.after.resolve()}
    if args.before:
        trees = {"before": args.before.resolve(), **trees}
    load = [round(x, 2) for x in os.getloadavg()]
    raw: dict[str, dict[str, dict[str, list[float]]]] = {}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for backend in args.backends.split(","):
            for name in order:
                burst = args.concurrent if backend == "bwrap" else 0
                got = run_worker(trees[name], backend, None if backend == "local" else image, args.n, burst)
                acc = raw.setdefault(backend, {}).setdefault(name, {})
                for k, v in got.items():
                    acc.setdefault(k, []).extend(v if isinstance(v, list) else [v])
                print(
                    f"round {r} {backend} {name}: ready p50 {percentile(got['ready_ms'], 50):.1f} ms, "
                    f"cpu {percentile(got['cpu_ready_ms'], 50):.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    results: dict[str, Any] = {}
    for backend, per_tree in raw.items():
        for name, acc in per_tree.items():
            row: dict[str, Any] = {}
            for k, v in acc.items():
                row[k] = summary(v) if k.endswith("_ms") else round(percentile(v, 50), 1)
            results.setdefault(backend, {})[name] = row
    doc = {
        "results": results,
        "trees": {k: str(v) for k, v in trees.items()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "load_avg_before": load,
            "load_avg_after": [round(x, 2) for x in os.getloadavg()],
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
