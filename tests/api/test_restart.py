"""The service as a real process (``python -m raas.api``) killed with SIGKILL mid-work and restarted.

Proves, on the process table and in the ledger: no accepted job is lost, finished results survive, a job
inside RUN comes back as ``failed``/``interrupted`` with no reward (or runs again when it asked for
``retry_on_restart``), a job that had generated nothing (in INIT) runs again, and no sandbox process or
scratch dir outlives the crash. (What resumes where: ``tests/api/test_resume.py``.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from raas.sandbox import procs

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def durable_status(service_dir: Path, job_id: str) -> str | None:
    """The job's status as the ledger committed it (read-only, beside the running service)."""
    db = sqlite3.connect(f"file:{service_dir / 'ledger.sqlite3'}?mode=ro", uri=True, timeout=10)
    try:
        row = db.execute("SELECT status FROM jobs WHERE job_id=?", (job_id,)).fetchone()
    finally:
        db.close()
    return None if row is None else str(row[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    def __init__(self, state: Path, port: int) -> None:
        self.state = state
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = state.parent / f"service-{port}.log"

    def command(self) -> list[str]:
        """``python -m raas.api`` with the test handler on this state dir and port."""
        cmd = [sys.executable, "-m", "raas.api", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--state-dir", str(self.state), "--shutdown-grace", "0", "--log-level", "warning"]
        cmd += ["--init-workers", "2", "--run-workers", "4", "--eval-workers", "2"]
        return [*cmd, "--handler", "test.script=tests.doubles.handlers:StageScriptHandler"]

    def start(self, *, wait: bool = True) -> None:
        """Start it (same state dir and port every time) and, unless not ``wait``, wait until it answers."""
        env = {k: v for k, v in os.environ.items() if k != "RAAS_API_TOKEN"}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        if not wait:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("service did not come up: " + self.log.read_text()[-3000:])

    def kill(self, sig: int) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(60)


@pytest.fixture
def service_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"


def sandbox_ids(state: Path) -> set[str]:
    records = state / "sandboxes" / "records"
    return {p.stem for p in records.glob("sb-*.json")} if records.exists() else set()


def test_sigkill_and_restart(service_dir: Path) -> None:
    svc = ServiceProcess(service_dir, free_port())
    svc.start()
    client = httpx.Client(base_url=svc.url, timeout=60)
    try:

        def submit(job_id: str, instance: dict[str, object], **kw: object) -> None:
            r = client.post(
                "/v1/jobs",
                json={"instance": {"data_source": "test.script", **instance}, "job_id": job_id, **kw},
            )
            assert r.status_code == 202, r.text

        submit("done", {"eval": {"reward": 0.25}})
        assert client.get("/v1/jobs/done/result", params={"wait": 60}).json()["reward"] == 0.25
        # opted out of resuming: a restart fails it (what resumes and how: tests/api/test_resume.py)
        submit("in-run", {"init": {"sandbox": True}, "run": {"bash": "sleep 600"}}, resume_on_restart=False)
        submit("in-init", {"init": {"sleep": 600}})
        submit("retry", {"run": {"sleep": 1.0}}, retry_on_restart=True)
        deadline = time.monotonic() + 60
        while (
            client.get("/v1/jobs/in-run").json()["status"] != "run"
            or client.get("/v1/jobs/retry").json()["status"] != "run"
            or durable_status(service_dir, "in-run") != "run"
        ):
            # The ledger commits stage changes in the background: the crash must come after the durable
            # state says RUN, or the recovered error rightly names the last committed stage.
            assert time.monotonic() < deadline, "jobs did not reach RUN"
            time.sleep(0.05)
        ids = sandbox_ids(service_dir)  # the RUN sandbox, and what the warm pool started after it
        assert ids
        assert any(procs.pids_with_env(sid) for sid in ids), (
            "the RUN sandbox should be alive before the crash"
        )

        assert svc.kill(signal.SIGKILL) == -signal.SIGKILL
        client.close()

        svc.start()  # same state dir and port
        client = httpx.Client(base_url=svc.url, timeout=60)
        for sid in ids:
            assert procs.pids_with_env(sid) == [], "a sandbox process outlived the crash and the restart"
        assert sandbox_ids(service_dir) == set()
        assert not any((service_dir / "sandboxes" / "sb").glob("sb-*"))

        done = client.get("/v1/jobs/done/result").json()
        assert done["status"] == "completed" and done["reward"] == 0.25
        res = client.get("/v1/jobs/in-run/result").json()
        assert res["status"] == "failed" and res["reward"] is None and res["filter"] is True
        assert res["error"]["kind"] == "interrupted" and res["error"]["stage"] == "run", res["error"]
        # INIT had generated nothing: it runs again (and is inside its 600 s INIT once more)
        info = client.get("/v1/jobs/in-init").json()
        assert info["status"] in ("queued", "init") and info["attempts"] == 1
        retried = client.get("/v1/jobs/retry/result", params={"wait": 60}).json()
        assert retried["status"] == "completed" and retried["reward"] == 1.0
        assert client.get("/v1/jobs/retry").json()["attempts"] == 2

        # An open event stream must end cleanly when the service stops (not be cut when the server's
        # graceful-shutdown timeout runs out, which a client sees as a broken chunked response).
        stream_outcome: list[str] = []
        connected = threading.Event()

        def follow_events() -> None:
            try:
                with httpx.stream("GET", svc.url + "/v1/events", timeout=120) as r:
                    for line in r.iter_lines():
                        if line.startswith(": connected"):
                            connected.set()
                stream_outcome.append("ended")
            except httpx.HTTPError as exc:
                stream_outcome.append(f"broken: {exc!r}")
            finally:
                connected.set()

        follower = threading.Thread(target=follow_events)
        follower.start()
        assert connected.wait(30)
        # Graceful stop of the restarted service (uvicorn re-raises SIGTERM after its shutdown completes).
        assert svc.kill(signal.SIGTERM) in (0, -signal.SIGTERM)
        follower.join(60)
        assert stream_outcome == ["ended"]
    finally:
        client.close()
        if svc.proc is not None and svc.proc.poll() is None:
            svc.proc.kill()
            svc.proc.wait()

    # The ledger was closed cleanly: its last connection checkpointed and removed the write-ahead log.
    assert not (service_dir / "ledger.sqlite3-wal").exists()
    db = sqlite3.connect(service_dir / "ledger.sqlite3")
    rows = db.execute("SELECT job_id, status, result FROM jobs ORDER BY job_id").fetchall()
    db.close()
    assert [r[0] for r in rows] == ["done", "in-init", "in-run", "retry"]  # nothing accepted was lost
    # stopped gracefully inside INIT: left queued for the next start, not failed
    assert rows[1][1:] == ("queued", None)
    for job_id, status, result in rows[:1] + rows[2:]:
        body = json.loads(result)
        assert body["status"] == status
        assert (body["reward"] is not None) == (status == "completed"), job_id  # no fabricated rewards
    assert procs.pids_with_env(sid) == []
