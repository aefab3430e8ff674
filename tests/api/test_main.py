"""``python -m raas.api`` refuses a bad configuration, a corrupt ledger and an open public address with a
clear message and exit status 2 (no traceback), and serves a public address with ``--insecure``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--config", "/nonexistent/raas.json"], "cannot read config"),
        (["--handler", "no-equals-sign"], "NAME=MODULE:CLASS"),
        (["--port", "70000"], "invalid service config"),
    ],
)
def test_bad_configuration_exits_2(tmp_path: Path, args: list[str], phrase: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "raas.api", "--state-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert phrase in proc.stderr and "Traceback" not in proc.stderr


def corrupt_ledger(state: Path) -> Path:
    """A ledger that held a job, then truncated to 0 bytes (its identity file remains)."""
    import asyncio

    from raas.pipeline.ledger import Ledger

    async def write() -> None:
        ledger = Ledger(state / "ledger.sqlite3")
        await ledger.open()
        await ledger.insert_job(
            job_id="j",
            request={},
            data_source="x",
            instance_id=None,
            trajectory_id=None,
            priority=0,
            retry_on_restart=False,
            at=1.0,
        )
        await ledger.close()

    asyncio.run(write())
    path = state / "ledger.sqlite3"
    path.write_bytes(b"")
    return path


def test_a_corrupt_ledger_is_refused_at_start(tmp_path: Path) -> None:
    path = corrupt_ledger(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "raas.api", "--state-dir", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"raas: the ledger {path} is unusable: the file is empty (0 bytes)" in proc.stderr
    assert "Restore it from a backup" in proc.stderr and "Traceback" not in proc.stderr
    assert "Uvicorn running" not in proc.stderr  # nothing listened


def test_a_public_address_without_a_token_is_refused(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAAS_API_TOKEN"}
    proc = subprocess.run(
        [sys.executable, "-m", "raas.api", "--state-dir", str(tmp_path), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "refusing to serve 0.0.0.0 without an API token" in proc.stderr
    assert "Set RAAS_API_TOKEN" in proc.stderr and "--insecure" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ledger.sqlite3").exists()  # refused before the service started


def test_insecure_serves_a_public_address_with_a_warning(tmp_path: Path) -> None:
    import signal
    import time

    import httpx

    from raas.llm.embedded import free_port

    env = {k: v for k, v in os.environ.items() if k != "RAAS_API_TOKEN"}
    port = free_port()
    cmd = [sys.executable, "-m", "raas.api", "--state-dir", str(tmp_path), "--host", "0.0.0.0"]
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--insecure", "--log-level", "warning"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        up = False
        while not up and proc.poll() is None and time.monotonic() < deadline:
            try:
                up = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.1)
        assert up, "the service did not come up"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "serving 0.0.0.0 WITHOUT an API token (--insecure)" in err, err[-2000:]
