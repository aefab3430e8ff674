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
from tests.agent.scripted import EOS, tool_call
from tests.doubles.scripted_llm import Completion, ScriptedLLM, replay

from raas.cli.inprocess import service_in_process
from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer
from raas.pipeline.config import ServiceConfig
from raas.sandbox import procs as sbprocs

pytestmark = pytest.mark.e2e

RAAS = [sys.executable, "-m", "raas.cli"]


def marked_env(mark: str) -> dict[str, str]:
    """The environment for a ``raas`` child, tagged so every process it starts can be found afterwards."""
    env = dict(os.environ)
    env["RAAS_TEST_MARK"] = mark
    return env


def run_raas(cwd: Path, *args: str, mark: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """``raas ARGS`` as a child in ``cwd``, tagged with ``mark`` (:func:`marked_env`); output captured."""
    return subprocess.run(
        [*RAAS, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=marked_env(mark),
        cwd=cwd,
        check=False,
    )


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
    data.write_text(
        json.dumps({"problem": "What is 2 + 3?", "answer": "5"})
        + "\n"
        + json.dumps({"problem": "What is 10 / 4?", "answer": "5/2"})
        + "\n"
    )
    out = tmp_path / "results.jsonl"
    mark = uuid.uuid4().hex
    args = ["--sandbox", "local", "--max-turns", "2", "--max-tokens", "16", "--n-samples", "2"]
    proc = run_raas(tmp_path, "run", str(data), *args, "-o", str(out), "--json", mark=mark, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)  # --json: stdout is the JSON document and nothing else
    assert summary["jobs"] == 4 and summary["status"].get("completed") == 4
    assert summary["scored"] == 4 and 0.0 <= summary["reward_mean"] <= 1.0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert row["status"] == "completed" and row["reward"] in (0.0, 1.0) and row["filter"] is False
        traj = row["token_trajectory"]
        assert traj["response_ids"] and len(traj["loss_mask"]) == len(traj["response_ids"])
    assert "reward mean" in proc.stderr  # the table goes to stderr with --json
    assert wait_gone(mark) == []


def test_run_bad_dataset_is_a_clear_error(tmp_path: Path) -> None:
    for dataset in ("builtin:nope", str(tmp_path / "missing.jsonl")):
        proc = subprocess.run(
            [*RAAS, "run", dataset], capture_output=True, text=True, timeout=120, check=False
        )
        assert proc.returncode == 2
        assert "bad_request" in proc.stderr and "Traceback" not in proc.stderr


def sandboxes_under(root: int) -> dict[int, str]:
    """Descendants of ``root`` that are sandbox processes (pid -> RAAS_SANDBOX_ID)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found: dict[int, str] = {}
    for pid in parents:
        p = pid
        while p in parents and p not in (0, 1):
            p = parents[p]
            if p == root:
                sid = sbprocs.environ_value(pid, "RAAS_SANDBOX_ID")
                if sid:
                    found[pid] = sid
                break
    return found


def still_running(procs: dict[int, str]) -> dict[int, str]:
    return {pid: sid for pid, sid in procs.items() if sbprocs.environ_value(pid, "RAAS_SANDBOX_ID") == sid}


def test_run_interrupted_shuts_everything_down(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    proc = subprocess.Popen(
        [*RAAS, "run", "builtin:math", "--sandbox", "local", "--max-tokens", "256"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=marked_env(mark),
        cwd=tmp_path,
    )
    sandboxes: dict[int, str] = {}
    try:
        # Wait until the model server and some sandboxes run, then interrupt like Ctrl-C.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            sandboxes = sandboxes_under(proc.pid)
            if sandboxes and len(processes_with_mark(mark)) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None and sandboxes, "raas run never got to running sandboxes"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err
    assert wait_gone(mark) == []
    assert still_running(sandboxes) == {}


async def test_run_against_a_running_server_scores_with_math_verify(tmp_path: Path) -> None:
    """``raas run --server``: a scripted policy always submits 5; the dataset's truths are 5 and 6."""
    import asyncio

    tok = ChatTokenizer.from_pretrained(prepare_tokenizer())
    answer = Completion.of_text(tool_call("finish", answer="5"), encode=tok.encode, eos_id=EOS)
    data = tmp_path / "two.jsonl"
    data.write_text(
        json.dumps({"problem": "2 + 3?", "answer": "5"})
        + "\n"
        + json.dumps({"problem": "2 + 4?", "answer": "6"})
        + "\n"
    )
    out = tmp_path / "out.jsonl"
    async with ScriptedLLM(replay([answer], cycle=True)) as llm:
        config = ServiceConfig(
            state_dir=tmp_path / "svc",
            sandbox={"backend": "local"},
            llm_servers=[llm.url],
            tokenizer_dir=prepare_tokenizer(),
            shutdown_grace_s=0.0,
        )
        async with service_in_process(config) as url:
            proc = await asyncio.create_subprocess_exec(
                *RAAS,
                "run",
                str(data),
                "--server",
                url,
                "--max-turns",
                "3",
                "-o",
                str(out),
                "--json",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            stdout, stderr = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    summary = json.loads(stdout.decode())  # --json: only the JSON document on stdout
    assert summary["reward_mean"] == 0.5 and summary["pass_rate"] == 0.5
    assert "pass rate" in stderr.decode()  # the summary table went to stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reward"] for r in rows] == [1.0, 0.0]
    assert all(r["turns"][0]["output_ids"] == answer.token_ids for r in rows)


def serve_command(*args: str) -> list[str]:
    """``raas serve`` with local sandboxes and the test tokenizer, plus ``args``."""
    return [*RAAS, "serve", "--sandbox", "local", "--tokenizer", str(prepare_tokenizer()), *args]


def test_serve_starts_and_stops_on_sigterm(tmp_path: Path) -> None:
    import httpx

    from raas.llm.embedded import free_port

    port = free_port()
    mark = uuid.uuid4().hex
    env = marked_env(mark)
    env["RAAS_HOME"] = str(tmp_path / "home")
    env["RAAS_IMAGE_CACHE"] = os.environ.get("RAAS_IMAGE_CACHE", str(Path.home() / ".cache/raas/images"))
    proc = subprocess.Popen(
        serve_command("--port", str(port), "--init-workers", "auto", "--run-workers", "3"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        ok = False
        while time.monotonic() < deadline and proc.poll() is None and not ok:
            try:
                ok = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.2)
        assert ok, proc.communicate(timeout=10)[1][-3000:] if proc.poll() is not None else "no /healthz"
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/jobs", json={"instance": {"data_source": "nope"}}, timeout=5
        )
        assert r.status_code == 400 and r.json()["error"]["kind"] == "bad_request"
        stages = httpx.get(f"http://127.0.0.1:{port}/status", timeout=5).json()["stages"]
        assert stages["run"]["workers"] == 3 and stages["init"]["workers"] >= 1  # auto: sized at start
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "home" / "service" / "ledger.sqlite3").exists()
    assert wait_gone(mark) == []


@pytest.fixture
async def running_service(tmp_path: Path) -> AsyncIterator[str]:
    config = ServiceConfig(state_dir=tmp_path / "svc", sandbox={"backend": "local"}, shutdown_grace_s=0.0)
    async with service_in_process(config) as url:
        yield url


async def test_status_command(running_service: str) -> None:
    import asyncio

    proc = await asyncio.create_subprocess_exec(
        *RAAS,
        "status",
        "--server",
        running_service,
        "--json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()[-2000:]
    body = json.loads(out)
    assert "status" in body and "servers" in body
    proc = await asyncio.create_subprocess_exec(
        *RAAS,
        "status",
        "--server",
        "http://127.0.0.1:9",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1 and b"unavailable" in err


async def _first_line(lines: AsyncIterator[str]) -> str:
    async for line in lines:
        if line:
            return line
    raise AssertionError("the event stream ended before its first line")


async def _rest(lines: AsyncIterator[str]) -> list[str]:
    """The non-empty lines up to the end of the stream (a stream cut mid-response raises instead; one
    that never ends is caught by the caller's bound, its keep-alives would keep any read timeout busy)."""
    return [line async for line in lines if line and not line.startswith(": keep-alive")]


async def test_in_process_service_ends_event_streams_when_it_stops(tmp_path: Path) -> None:
    """An open ``/v1/events`` stream ends cleanly when ``raas run``'s in-process service stops, instead of
    holding the server's stop until it is cut off."""
    import asyncio

    import httpx

    config = ServiceConfig(state_dir=tmp_path / "svc", sandbox={"backend": "local"}, shutdown_grace_s=0.0)
    async with httpx.AsyncClient(timeout=60) as http:
        async with service_in_process(config) as url:
            response = await http.send(http.build_request("GET", url + "/v1/events"), stream=True)
            assert response.status_code == 200
            lines = response.aiter_lines()
            assert await _first_line(lines) == ": connected"
        rest = await asyncio.wait_for(_rest(lines), 60)
        await response.aclose()
    assert rest == []


async def test_serve_sigterm_ends_open_event_streams_and_exits_0(tmp_path: Path) -> None:
    """``raas serve`` runs through ``raas.api.serve``: SIGTERM ends open event streams cleanly, the service
    drains, and the command exits 0 (not killed by the re-raised signal)."""
    import asyncio

    import httpx

    from raas.llm.embedded import free_port

    port = free_port()
    mark = uuid.uuid4().hex
    env = marked_env(mark)
    env["RAAS_HOME"] = str(tmp_path / "home")
    cfg = tmp_path / "svc.json"
    cfg.write_text(json.dumps({"shutdown_grace_s": 0}))
    proc = await asyncio.create_subprocess_exec(
        *serve_command("--config", str(cfg), "--port", str(port)),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:

            async def healthy() -> None:
                while proc.returncode is None:
                    try:
                        if (await http.get("/healthz", timeout=1)).status_code == 200:
                            return
                    except httpx.HTTPError:
                        await asyncio.sleep(0.2)
                raise AssertionError("raas serve exited before it was healthy")

            await asyncio.wait_for(healthy(), 60)
            async with http.stream("GET", "/v1/events") as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                assert await _first_line(lines) == ": connected"
                proc.send_signal(signal.SIGTERM)
                rest = await asyncio.wait_for(_rest(lines), 60)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rest == []
    assert proc.returncode == 0, err.decode()[-3000:]
    assert wait_gone(mark) == []


def test_serve_on_a_busy_port_fails_with_a_message(tmp_path: Path) -> None:
    import socket

    mark = uuid.uuid4().hex
    env = marked_env(mark)
    env["RAAS_HOME"] = str(tmp_path / "home")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            serve_command("--port", str(port)),
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"could not serve on 127.0.0.1:{port}" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr
    assert wait_gone(mark) == []


def _serve_refusal(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    mark = uuid.uuid4().hex
    env = marked_env(mark)
    env["RAAS_HOME"] = str(tmp_path / "home")
    env.pop("RAAS_API_TOKEN", None)
    proc = subprocess.run(
        serve_command(*args),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert wait_gone(mark) == []
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    return proc


def test_serve_refuses_a_corrupt_ledger_with_a_message(tmp_path: Path) -> None:
    import asyncio

    from raas.pipeline.ledger import Ledger

    ledger_file = tmp_path / "home" / "service" / "ledger.sqlite3"

    async def write() -> None:
        ledger = Ledger(ledger_file)
        await ledger.open()
        await ledger.close()

    asyncio.run(write())
    ledger_file.write_bytes(b"")
    proc = _serve_refusal(tmp_path, "--port", "0")
    assert proc.returncode == 1, proc.stderr[-3000:]
    said = "".join(proc.stderr.split())  # the console wraps long paths anywhere
    assert f"theledger{ledger_file}isunusable:thefileisempty(0bytes)" in said
    assert "Restoreitfromabackup" in said


def test_serve_refuses_a_public_address_without_a_token(tmp_path: Path) -> None:
    proc = _serve_refusal(tmp_path, "--host", "0.0.0.0", "--port", "0")
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = "".join(proc.stderr.split())  # the console wraps long lines anywhere
    assert "refusingtoserve0.0.0.0withoutanAPItoken" in said and "SetRAAS_API_TOKEN" in said
