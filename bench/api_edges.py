"""The HTTP server under abuse: slowloris connections and big pending jobs, against ``python -m raas.api``.

``slowloris``: opens ``--connections`` sockets that each send an unfinished request, holds them for
``--hold`` seconds and meanwhile asks ``/healthz`` over a fresh connection every half second. Reports
how many of the slow sockets the server closed and when, the most file descriptors the server process
held, and how ``/healthz`` fared.

``big-jobs``: submits ``--jobs`` jobs of ``--job-mb`` MB each that stay pending (their INIT sleeps) and
reports the server's RSS before and after, and the status codes it answered.

Runs against whatever ``raas`` is importable (so the same script measures an older checkout: pass
``--no-limits`` there, its config has no limit fields). Writes ``bench/results/api_edges.json`` (or
``--output``) and prints it. Usage:
``python bench/api_edges.py [--connections 3000] [--hold 30] [--jobs 20] [--job-mb 15]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "api_edges.json"
PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: raas\r\nX-Slow: "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def service(config: dict[str, Any]) -> Iterator[tuple[str, int]]:
    """``python -m raas.api`` on a free port with ``config``; yields (url, pid)."""
    with tempfile.TemporaryDirectory(prefix="raas-bench-") as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps(config))
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "RAAS_API_TOKEN"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)]))
        cmd = [
            sys.executable,
            "-m",
            "raas.api",
            "--config",
            str(cfg),
            "--port",
            str(port),
            "--state-dir",
            str(Path(tmp) / "state"),
            "--handler",
            "test.script=tests.doubles.handlers:StageScriptHandler",
            "--log-level",
            "warning",
        ]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, "the service exited during start-up"
                try:
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the service did not come up"
                time.sleep(0.1)
            yield url, proc.pid
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return -1.0


def healthz(url: str) -> float | None:
    """Seconds for /healthz over a new connection, None when it failed or took over 5 s."""
    start = time.perf_counter()
    try:
        with httpx.Client(timeout=5) as c:
            ok = c.get(url + "/healthz").status_code == 200
    except httpx.HTTPError:
        return None
    return time.perf_counter() - start if ok else None


def slowloris(url: str, pid: int, connections: int, hold_s: float) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    open_failed = 0
    fds_before = fds(pid)
    start = time.monotonic()
    for _ in range(connections):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((host, int(port)))
            s.sendall(PARTIAL)
        except OSError:
            open_failed += 1
            s.close()
            continue
        s.setblocking(False)
        socks.append(s)
    opened_s = time.monotonic() - start
    closed_at: dict[int, float] = {}
    latencies: list[float] = []
    failures = 0
    max_fds = fds(pid)
    next_probe = time.monotonic()
    end = start + hold_s
    while time.monotonic() < end:
        live = [s for s in socks if s.fileno() not in closed_at]
        for i in range(0, len(live), 512):  # select() takes at most FD_SETSIZE descriptors: poll instead
            poller = select.poll()
            for s in live[i : i + 512]:
                poller.register(s, select.POLLIN | select.POLLHUP)
            for fd, _ in poller.poll(0):
                sock = next(s for s in live[i : i + 512] if s.fileno() == fd)
                try:
                    data = sock.recv(4096)
                except OSError:
                    data = b""
                if not data or data.startswith(b"HTTP/1.1 408"):
                    closed_at[fd] = time.monotonic() - start
        max_fds = max(max_fds, fds(pid))
        if time.monotonic() >= next_probe:
            took = healthz(url)
            if took is None:
                failures += 1
            else:
                latencies.append(took)
            next_probe = time.monotonic() + 0.5
        time.sleep(0.05)
    for s in socks:
        s.close()
    times = sorted(closed_at.values())
    return {
        "connections": connections,
        "open_failed": open_failed,
        "opened_in_s": round(opened_s, 2),
        "hold_s": hold_s,
        "closed_by_server": len(closed_at),
        "still_open_at_end": len(socks) - len(closed_at),
        "all_closed_after_s": round(times[-1], 2) if times and len(times) == len(socks) else None,
        "server_fds_before": fds_before,
        "server_fds_max": max_fds,
        "healthz_ok": len(latencies),
        "healthz_failed": failures,
        "healthz_p50_ms": round(statistics.median(latencies) * 1000, 1) if latencies else None,
        "healthz_max_ms": round(max(latencies) * 1000, 1) if latencies else None,
    }


def big_jobs(url: str, pid: int, jobs: int, job_mb: float) -> dict[str, Any]:
    blob = "x" * int(job_mb * 1024 * 1024)
    before = rss_mb(pid)
    statuses: dict[int, int] = {}
    detail = None
    with httpx.Client(base_url=url, timeout=120) as c:
        for _ in range(jobs):
            body = {"instance": {"data_source": "test.script", "init": {"sleep": 3600}, "blob": blob}}
            r = c.post("/v1/jobs", json=body)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code >= 400 and detail is None:
                detail = r.json().get("detail")
    time.sleep(1.0)
    return {
        "jobs": jobs,
        "job_mb": job_mb,
        "statuses": statuses,
        "first_error": detail,
        "rss_before_mb": round(before, 1),
        "rss_after_mb": round(rss_mb(pid), 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connections", type=int, default=3000)
    p.add_argument("--hold", type=float, default=30.0)
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--job-mb", type=float, default=15.0)
    p.add_argument("--no-limits", action="store_true", help="send no limit settings (an older raas)")
    p.add_argument("--output", type=Path, default=OUT)
    args = p.parse_args()
    base: dict[str, Any] = {"init_workers": 1, "shutdown_grace_s": 0}
    results: dict[str, Any] = {"connections": {}, "big_jobs": {}}
    with service(base) as (url, pid):
        results["connections"]["defaults"] = slowloris(url, pid, args.connections, args.hold)
    with service(base) as (url, pid):
        results["big_jobs"]["defaults"] = big_jobs(url, pid, args.jobs, args.job_mb)
    if not args.no_limits:
        allow = {**base, "max_instance_bytes": 64 << 20, "max_request_bytes": 64 << 20}
        with service(allow) as (url, pid):
            results["big_jobs"]["caps_raised_to_64MiB"] = big_jobs(url, pid, args.jobs, args.job_mb)
    text = json.dumps(results, indent=2)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
