"""What a sandbox costs before raas's own code runs: the floors under the cold-start and throughput targets.

    .venv/bin/python bench/floors.py [--n 40] [--image ROOTFS]

Every sandbox today is a fresh interpreter started by a runtime, so no tool server, however lean, can
start for less than the runtime plus a bare interpreter. Measured here, each as the mean over ``--n``
runs of CPU time (user+sys of the reaped children, so every process of the run counts) and wall time:

* ``python_bare``: ``python -S -c pass``, for the service's own interpreter (what ``local`` runs) and for
  ``/usr/bin/python3`` (a distribution build, like an image's);
* ``bwrap_true``: ``bwrap`` with the image read-only and every namespace unshared, running ``/bin/true``;
* ``apptainer_true``: ``apptainer exec`` with raas's flags (``--containall --cleanenv --no-init --no-home
  --net --network none``, ``--userns`` as root) on the image dir, running ``/bin/true``;
* ``bash_true``: ``bash --norc --noprofile -c true`` (each sandbox's first bash call starts a shell).

Writes ``bench/results/floors.json`` and prints it. The image is the tests' rootfs (built if needed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(argv: list[str], n: int) -> dict[str, float]:
    """Mean CPU and wall milliseconds of running ``argv`` to completion, ``n`` times after one warm-up."""
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    cpu0, t0 = _children_cpu_s(), time.perf_counter()
    for _ in range(n):
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return {
        "cpu_ms": round((_children_cpu_s() - cpu0) / n * 1000, 2),
        "wall_ms": round((time.perf_counter() - t0) / n * 1000, 2),
    }


def default_image() -> Path:
    from tests.conftest import TEST_IMAGE_SPEC

    from raas.sandbox.images import build_rootfs

    return Path(build_rootfs(TEST_IMAGE_SPEC))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--image", type=Path, help="an unpacked rootfs (default: the tests' image)")
    args = ap.parse_args()
    image = args.image or default_image()
    out: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "n": args.n,
    }
    rows: dict[str, Any] = {}
    rows["python_bare_service"] = {
        "python": sys.executable,
        **measure([sys.executable, "-S", "-c", "pass"], args.n),
    }
    if Path("/usr/bin/python3").exists():
        rows["python_bare_distribution"] = {
            "python": "/usr/bin/python3",
            **measure(["/usr/bin/python3", "-S", "-c", "pass"], args.n),
        }
    rows["bash_true"] = measure(["bash", "--norc", "--noprofile", "-c", "true"], args.n)
    if shutil.which("bwrap"):
        rows["bwrap_true"] = measure(
            [
                "bwrap",
                "--ro-bind",
                str(image),
                "/",
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "--unshare-all",
                "--die-with-parent",
                "/bin/true",
            ],
            args.n,
        )
    if shutil.which("apptainer"):
        argv = ["apptainer", "-s", "exec", "--containall", "--cleanenv", "--no-init", "--no-home"]
        argv += ["--net", "--network", "none"] + (["--userns"] if os.geteuid() == 0 else [])
        rows["apptainer_true"] = measure([*argv, str(image), "/bin/true"], max(5, args.n // 4))
    out["floors"] = rows
    results = REPO / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    (results / "floors.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
