"""``raas run`` and ``raas status`` as a user runs them: real subprocesses, the embedded model server, the
in-process service; afterwards nothing the command started may still be running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from raas.cli import service_in_process
from raas.pipeline.config import ServiceConfig

pytestmark = pytest.mark.e2e

RAAS = [sys.executable, "-m", "raas.cli"]


def marked_env(mark: str) -> dict[str, str]:
    """The environment for a ``raas`` child, tagged so every process it starts can be found afterwards."""
    env = dict(os.environ)
    env["RAAS_TEST_MARK"] = mark
    return env


def processes_with_mark(mark: str) -> list[int]:
    needle = f"RAAS_TEST_MARK={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def wait_gone(mark: str, timeout_s: float = 15.0) -> list[int]:
    """PIDs still carrying ``mark`` after ``timeout_s`` (children may take a moment to be reaped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = processes_with_mark(mark)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_run_tiny_dataset_end_to_end(tmp_path: Path) -> None:
    data = tmp_path / "tiny.jsonl"
    data.write_text(json.dumps({"problem": "What is 2 + 3?", "answer": "5"}) + "\n"
                    + json.dumps({"problem": "What is 10 / 4?", "answer": "5/2"}) + "\n")
    out = tmp_path / "results.jsonl"
    mark = uuid.uuid4().hex
    proc = subprocess.run(
        [*RAAS, "run", str(data), "--sandbox", "local", "--max-turns", "2", "--max-tokens", "24",
         "--n-samples", "2", "-o", str(out), "--json"],
        capture_output=True, text=True, timeout=600, env=marked_env(mark), cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["jobs"] == 4 and summary["status"].get("completed") == 4
    assert summary["scored"] == 4 and 0.0 <= summary["reward_mean"] <= 1.0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert row["status"] == "completed" and row["reward"] in (0.0, 1.0) and row["filter"] is False
        traj = row["token_trajectory"]
        assert traj["response_ids"] and len(traj["loss_mask"]) == len(traj["response_ids"])
    assert "reward mean" in proc.stderr + proc.stdout
    assert wait_gone(mark) == []


def test_run_bad_dataset_is_a_clear_error(tmp_path: Path) -> None:
    for dataset in ("builtin:nope", str(tmp_path / "missing.jsonl")):
        proc = subprocess.run([*RAAS, "run", dataset], capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 2
        assert "bad_request" in proc.stderr and "Traceback" not in proc.stderr


def test_run_interrupted_shuts_everything_down(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [*RAAS, "run", "builtin:math", "--sandbox", "local", "--max-tokens", "256"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=marked_env(mark), cwd=tmp_path)
    try:
        # Wait until the model server and sandboxes exist, then interrupt like Ctrl-C.
        deadline = time.monotonic() + 120
        while len(processes_with_mark(mark)) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    assert wait_gone(mark) == []


@pytest.fixture
async def running_service(tmp_path: Path) -> AsyncIterator[str]:
    config = ServiceConfig(state_dir=tmp_path / "svc", sandbox={"backend": "local"}, shutdown_grace_s=0.0)
    async with service_in_process(config) as url:
        yield url


async def test_status_command(running_service: str) -> None:
    import asyncio

    proc = await asyncio.create_subprocess_exec(
        *RAAS, "status", "--server", running_service, "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    body = json.loads(out)
    assert "status" in body and "servers" in body
    proc = await asyncio.create_subprocess_exec(
        *RAAS, "status", "--server", "http://127.0.0.1:9", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and b"unavailable" in err
