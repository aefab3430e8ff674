"""Does a big file transfer in one sandbox slow down tool calls in another? (One host event loop.)

    .venv/bin/python bench/transfer.py [--backend bwrap] [--n 300] [--mb 100] [--rounds 5]

Two sandboxes, one ``SandboxManager``, one event loop. Sandbox A answers ``echo hello`` through the bash
tool, one call after another: n calls alone, then for as long as sandbox B writes and reads back a file of
``--mb`` MB ``--rounds`` times (``write_file`` then ``read_file``, raw bytes both ways, checked). A
ticker measures how late a 1 ms timer fires, i.e. how long the loop was blocked at a stretch. Writes
``bench/results/transfer.json`` (``alone`` and ``during_transfer``: p50/p90/p99/max of A's echo in ms,
the loop's worst stall; B's rounds and MB/s; the machine and its load average) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from raas.sandbox import Sandbox, SandboxManager
from raas.sandbox.config import make_config
from raas.sandbox.images import ImageSpec, build_rootfs, rootfs_path

BENCH_IMAGE = ImageSpec(suite="bookworm", packages=("python3", "python3-ipykernel", "python3-jupyter-client"))


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """p50/p90/p99/max in milliseconds (nearest-rank on the sorted samples)."""
    xs = sorted(samples_s)

    def rank(p: float) -> float:
        return xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))] * 1000

    return {
        "p50_ms": round(rank(50), 3),
        "p90_ms": round(rank(90), 3),
        "p99_ms": round(rank(99), 3),
        "max_ms": round(xs[-1] * 1000, 3),
    }


async def echo_samples(sb: Sandbox, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = await sb.tools.bash("echo hello")
        samples.append(time.perf_counter() - t0)
        if r.output.strip() != "hello":
            raise SystemExit(f"echo answered {r.output!r}")
    return samples


async def worst_stall(stop: asyncio.Event) -> float:
    """The longest a 1 ms sleep overslept while ``stop`` is unset: how long the loop was blocked."""
    worst = 0.0
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        worst = max(worst, time.perf_counter() - t0 - 0.001)
    return worst


async def measure(a: Sandbox, n: int, traffic: Any | None) -> dict[str, Any]:
    """A's echo latency: ``n`` calls alone, or for as long as ``traffic`` runs (at least ``n`` calls)."""
    stop = asyncio.Event()
    ticker = asyncio.create_task(worst_stall(stop))
    load = os.getloadavg()[0]
    other = asyncio.create_task(traffic()) if traffic is not None else None
    samples: list[float] = []
    try:
        while len(samples) < n or (other is not None and not other.done()):
            samples += await echo_samples(a, 10)
    finally:
        stop.set()
    row: dict[str, Any] = {
        **percentiles(samples),
        "n": len(samples),
        "loop_worst_stall_ms": round(await ticker * 1000, 3),
    }
    if other is not None:
        row.update(await other)
    row["load_avg_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    return row


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data).digest()


def transfer_loop(b: Sandbox, payload: bytes, rounds: int) -> Any:
    expected = digest(payload)

    async def run() -> dict[str, Any]:
        t0 = time.perf_counter()
        for _ in range(rounds):
            await b.tools.write_file("/tmp/blob", payload)
            back = await b.tools.read_file("/tmp/blob")
            # Checked by digest on a thread (hashlib releases the GIL; comparing 100 MB here would not, and
            # would stall A's calls in the benchmark itself).
            if await asyncio.to_thread(digest, back) != expected:
                raise SystemExit(f"read back {len(back)} bytes that differ from the {len(payload)} written")
            del back
        took = time.perf_counter() - t0
        moved_mb = 2 * rounds * len(payload) / 1e6
        return {"transfer_rounds": rounds, "transfer_mb_per_s": round(moved_mb / took, 1)}

    return run


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="bwrap")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="write + read-back rounds of B")
    ap.add_argument("--image", default=None, help="rootfs dir (default: the test image, built if missing)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "transfer.json"))
    args = ap.parse_args()

    image = args.image
    if image is None:
        path = rootfs_path(BENCH_IMAGE)
        image = str(path if (path / "usr").is_dir() else build_rootfs(BENCH_IMAGE))
    payload = os.urandom(args.mb * 1_000_000)
    config = make_config(
        backend=args.backend,
        image=None if args.backend == "local" else image,
        disk_mb=max(1024, 3 * args.mb),
        start_timeout_s=300,
    )
    with tempfile.TemporaryDirectory(prefix="raas-bench-") as state:
        manager = SandboxManager(state)
        try:
            async with manager.sandbox(config, owner="a") as a, manager.sandbox(config, owner="b") as b:
                await echo_samples(a, 30)  # warm-up
                alone = await measure(a, args.n, None)
                during = await measure(a, args.n, transfer_loop(b, payload, args.rounds))
        finally:
            await manager.close_all()
    result = {
        "backend": args.backend,
        "payload_mb": args.mb,
        "alone": alone,
        "during_transfer": during,
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    }
    write_json(Path(args.out), result)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
