"""Group-shared INIT for SWE: time per group of 8 samples of one instance, with and without sharing.

The SWE handler's real INIT (image, sandbox start, repository at the base commit, hidden paths removed)
for 8 jobs of one instance, on real sandboxes, with the service's group layers (one sample prepares and
publishes, seven start from private copies) and without (every sample prepares its own). Per group: wall
time until all 8 are ready, INIT p50 per sample, and the first ``git status`` each sample runs afterwards
(a copied repository has fresh inode numbers, so git re-reads the files once wherever the copy came from).

Instances: built SWE-style ones (``raas swe build``'s small set; tiny repositories of 1.6-2.5 MB whose
images are already at the base commit) and, as root, a derived "medium" instance: the same environment
with a 40 MB repository (CPython 3.11's standard library in one commit) left with a modified tracked file,
so INIT must reset it — closer to what a real SWE-bench image costs. INIT concurrency 8 (all at once) and
2 (two INIT workers); shared and unshared groups alternate, each repeated ``--reps`` times.

    python bench/swe_group_init.py [--backends bwrap,apptainer] [--reps 3] [--no-medium] [--out FILE]

Run it as root (layers are copied into each sandbox: every sandbox has a uid of its own) and as an
unprivileged user (layers are stacked read-only under a per-sample overlay); the JSON keeps both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from raas.core.jobs import Job  # noqa: E402
from raas.sandbox import SandboxManager  # noqa: E402
from raas.sandbox.config import make_config  # noqa: E402
from raas.sandbox.layers import LayerStore  # noqa: E402
from raas.tasks.base import JobSandboxes  # noqa: E402
from raas.tasks.swe.build import BuildOptions, build  # noqa: E402
from raas.tasks.swe.config import SweConfig  # noqa: E402
from raas.tasks.swe.handler import SweHandler  # noqa: E402
from raas.tasks.swe.packages import FAST_PACKAGES  # noqa: E402
from raas.tasks.swe.records import SweRecord  # noqa: E402
from raas.tasks.swe.repo import commit_tree  # noqa: E402

RESULTS = REPO / "bench" / "results" / "swe_group_init.json"
SMALL_SET = {"packages": list(FAST_PACKAGES), "per_package": 4, "seed": 0, "jobs": 2}
GROUP = 8


def medium_instance(base: SweRecord, work: Path) -> SweRecord:
    """``base``'s image (hard-linked) with /testbed replaced by a 40 MB repository, one file modified.
    Built once into ``work`` (root); later runs, also an unprivileged user's, reuse it."""
    image, meta = work / "image", work / "medium.json"
    if meta.is_file():
        return base.model_copy(update=json.loads(meta.read_text()))
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)
    subprocess.run(["cp", "-al", base.image, str(image)], check=True)
    shutil.rmtree(image / "testbed")  # unlinks only this copy's links
    src = Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}")
    shutil.copytree(
        src, image / "testbed", symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*-packages")
    )
    commit = commit_tree(image / "testbed", 1_700_000_000)
    with open(image / "testbed" / "os.py", "a") as f:
        f.write("# left behind by the environment set-up\n")
    subprocess.run(["chmod", "-R", "a+rX", str(image / "testbed")], check=True)
    fields = {"image": str(image), "base_commit": commit, "instance_id": "medium-stdlib"}
    meta.write_text(json.dumps(fields))
    return base.model_copy(update=fields)


def _p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 3)


async def one_group(
    handler: SweHandler,
    manager: SandboxManager,
    store: LayerStore | None,
    record: SweRecord,
    backend: str,
    concurrency: int,
    group_id: str,
) -> dict[str, Any]:
    default = make_config(backend=backend)
    instance = {**record.model_dump(mode="json"), "group_id": group_id}
    jobs = [Job(job_id=f"{group_id}.{i}", instance=instance, trajectory_id=str(i)) for i in range(GROUP)]
    boxes = [JobSandboxes(manager, default, j.job_id, store) for j in jobs]
    gate = asyncio.Semaphore(concurrency)

    async def sample(i: int) -> tuple[float, float, bool]:
        async with gate:
            t0 = time.perf_counter()
            env = await handler.init(jobs[i], boxes[i])
            init_s = time.perf_counter() - t0
        assert env.sandbox is not None
        t1 = time.perf_counter()
        res = await env.sandbox.tools.bash("git -C /testbed status --porcelain | wc -l", timeout=300)
        status_s = time.perf_counter() - t1
        assert res.output.strip().startswith("0"), res.output  # a clean tree at the base commit
        return init_s, status_s, bool(env.data["init"]["shared"])

    t0 = time.perf_counter()
    try:
        out = await asyncio.gather(*(sample(i) for i in range(GROUP)))
        wall = time.perf_counter() - t0
    finally:
        await asyncio.gather(*(b.close_all() for b in boxes))
    return {
        "wall_s": wall,
        "init_p50_s": statistics.median(o[0] for o in out),
        "first_git_status_p50_s": statistics.median(o[1] for o in out),
        "shared_samples": sum(o[2] for o in out),
    }


async def run_backend(
    backend: str, records: dict[str, SweRecord], reps: int, tmp: Path, handler: SweHandler
) -> dict[str, Any]:
    manager = SandboxManager(tmp / f"state-{backend}")
    store = LayerStore(manager.scratch_root / "layers")
    out: dict[str, Any] = {}
    try:
        for name, record in records.items():
            for concurrency in (GROUP, 2):
                runs: dict[str, list[dict[str, Any]]] = {"shared": [], "unshared": []}
                for rep in range(reps):
                    order = ("shared", "unshared") if rep % 2 == 0 else ("unshared", "shared")
                    for mode in order:
                        gid = f"{backend}-{name}-{concurrency}-{mode}-{rep}"
                        runs[mode].append(
                            await one_group(
                                handler,
                                manager,
                                store if mode == "shared" else None,
                                record,
                                backend,
                                concurrency,
                                gid,
                            )
                        )
                assert store.keys() == [], "a layer outlived its group"
                row = {
                    mode: {
                        "group_wall_s": _p50([r["wall_s"] for r in rs]),
                        "init_p50_s": _p50([r["init_p50_s"] for r in rs]),
                        "first_git_status_p50_s": _p50([r["first_git_status_p50_s"] for r in rs]),
                        "shared_samples": rs[0]["shared_samples"],
                    }
                    for mode, rs in runs.items()
                }
                row["speedup"] = round(row["unshared"]["group_wall_s"] / row["shared"]["group_wall_s"], 2)
                out[f"{name}/concurrency={concurrency}"] = row
                print(backend, name, concurrency, json.dumps(row), flush=True)
    finally:
        await store.close()
        await manager.close_all()
    out["layer_stats"] = store.stats
    return out


async def measure(backends: list[str], records: dict[str, SweRecord], reps: int, tmp: Path) -> dict[str, Any]:
    handler = SweHandler()
    handler.settings = SweConfig(share_init=True)  # the unshared groups get no layer store
    return {b: await run_backend(b, records, reps, tmp, handler) for b in backends}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="bwrap,apptainer")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-medium", action="store_true")
    ap.add_argument("--medium-dir", default="/var/tmp/raas-bench-medium-instance")
    ap.add_argument("--out", default=str(RESULTS), help="JSON results; an existing file gains this run")
    args = ap.parse_args()
    load_start = os.getloadavg()
    built, _ = asyncio.run(build(BuildOptions(**SMALL_SET)))  # type: ignore[arg-type]
    small = {r.repo.split("/")[-1]: r for r in built}  # one instance per package
    user = "root" if os.geteuid() == 0 else "rootless"
    out: dict[str, Any] = {
        "run_as": user,
        "layers": "copied into each sandbox"
        if user == "root"
        else "overlay (read-only under a per-sample upper)",
        "group_size": GROUP,
        "reps": args.reps,
        "load_avg_start": [round(x, 2) for x in load_start],
        "instances": {},
    }
    records = dict(small)
    medium = Path(args.medium_dir)
    if not args.no_medium and (os.geteuid() == 0 or (medium / "medium.json").is_file()):
        records["medium-stdlib-40MB"] = medium_instance(next(iter(small.values())), medium)
    for name, r in records.items():
        size = subprocess.run(["du", "-sm", f"{r.image}/testbed"], capture_output=True, text=True, check=True)
        out["instances"][name] = {"instance_id": r.instance_id, "repo_mb": int(size.stdout.split()[0])}
    with tempfile.TemporaryDirectory(prefix="raas-bench-group-", dir="/var/tmp") as tmp_name:
        os.chmod(tmp_name, 0o711)
        out["backends"] = asyncio.run(measure(args.backends.split(","), records, args.reps, Path(tmp_name)))
    out["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    path = Path(args.out)
    saved = json.loads(path.read_text()) if path.is_file() else {}
    saved[user] = out
    path.write_text(json.dumps(saved, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
