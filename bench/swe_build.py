"""Cost of `raas swe build`: the small CI set (or any packages) built from nothing but the base rootfs.

A fresh image cache is made in a temp dir with the base rootfs hard-linked in (debootstrap is a one-time
~60 s per machine, timed separately when the base is missing), so the sdist downloads, the environment
image, every sandbox test run and every instance image are paid for. Needs root.

    python bench/swe_build.py [--packages inflection,six,cachetools] [--per-package 4] [--jobs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from raas.sandbox.images import build_rootfs, image_cache_dir, rootfs_path
from raas.tasks.swe.build import BuildOptions, build
from raas.tasks.swe.envimage import SWE_BASE_SPEC
from raas.tasks.swe.packages import FAST_PACKAGES


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--packages", default=",".join(FAST_PACKAGES))
    ap.add_argument("--per-package", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("building images needs root")

    shared = image_cache_dir()
    t0 = time.monotonic()
    had_base = rootfs_path(SWE_BASE_SPEC, shared).is_dir()
    base = build_rootfs(SWE_BASE_SPEC, cache=shared)
    base_s = None if had_base else round(time.monotonic() - t0, 1)

    cache = Path(tempfile.mkdtemp(prefix="raas-swe-bench-", dir=shared.parent))
    try:
        os.chmod(cache, 0o755)
        subprocess.run(["cp", "-al", str(base), str(cache / base.name)], check=True)
        load = os.getloadavg()[0]
        opts = BuildOptions(
            packages=args.packages.split(","),
            per_package=args.per_package,
            jobs=args.jobs,
            seed=args.seed,
            cache=cache,
            use_cache=False,
        )
        t1 = time.monotonic()
        records, reports = asyncio.run(build(opts))
        build_s = round(time.monotonic() - t1, 1)
        t2 = time.monotonic()
        asyncio.run(build(BuildOptions(**{**opts.__dict__, "use_cache": True})))
        cached_s = round(time.monotonic() - t2, 2)
    finally:
        shutil.rmtree(cache, ignore_errors=True)

    result = {
        "packages": opts.packages,
        "per_package": opts.per_package,
        "jobs": opts.jobs,
        "cpus": os.cpu_count(),
        "load_average_at_start": round(load, 2),
        "base_rootfs_s": base_s,
        "build_s": build_s,
        "cached_rebuild_s": cached_s,
        "instances": len(records),
        "per_package_report": [r.__dict__ for r in reports],
    }
    text = json.dumps(result, indent=1)
    print(text)
    out = Path(__file__).parent / "results" / "swe_build.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text + "\n")


if __name__ == "__main__":
    main()
