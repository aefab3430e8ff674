"""The embedded llama-server: started, answered, and reaped on every exit path."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from raas.errors import RaasError
from raas.llm import embedded
from raas.llm.embedded import EmbeddedServer, ServerCrashed, reap_stale_dirs

pytestmark = pytest.mark.integration


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def test_context_manager_starts_and_reaps() -> None:
    async with EmbeddedServer(parallel=1, ctx_per_slot=256, threads=1) as srv:
        pid, tmp = srv.pid, srv._tmp
        assert pid is not None and tmp is not None and tmp.is_dir()
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{srv.url}/health")).status_code == 200
    assert _gone(pid) and not tmp.exists() and not srv.running


async def test_bad_model_is_a_typed_error_and_leaves_nothing(tmp_path: Path) -> None:
    bogus = tmp_path / "not-a-model.gguf"
    bogus.write_bytes(b"GGUF but not really")
    srv = EmbeddedServer(bogus, parallel=1, ctx_per_slot=256, threads=1, startup_timeout_s=30)
    with pytest.raises(RaasError) as err:
        await srv.start()
    assert err.value.kind == "llm_unavailable" and "did not start" in err.value.message
    assert isinstance(err.value, ServerCrashed) and err.value.signal_name is None
    assert "exited with status" in err.value.message and "not-a-model.gguf" in err.value.message
    assert srv.proc is None and srv._tmp is None


async def test_a_lost_port_race_is_retried_on_another_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real server cannot bind a port another process took after ``free_port`` picked it: raas
    starts it again on a fresh port (only this failure is retried)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks = iter([taken_port])
    real_free_port = embedded.free_port

    def racy_free_port(host: str = "127.0.0.1") -> int:
        return next(picks, None) or real_free_port(host)

    monkeypatch.setattr(embedded, "free_port", racy_free_port)
    try:
        async with EmbeddedServer(parallel=1, ctx_per_slot=256, threads=1) as srv:
            assert next(picks, None) is None and srv.port not in (None, taken_port)
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"{srv.url}/health")).status_code == 200
    finally:
        taken.close()


def test_bad_settings_are_bad_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RaasError) as err:
        EmbeddedServer(parallel=0)
    assert err.value.kind == "bad_request"
    monkeypatch.setenv("RAAS_LLAMA_THREADS", "many")
    with pytest.raises(RaasError) as err:
        EmbeddedServer()
    assert err.value.kind == "bad_request"
    monkeypatch.setenv("RAAS_LLAMA_THREADS", "3")
    assert EmbeddedServer().threads == 3
    monkeypatch.delenv("RAAS_LLAMA_THREADS")
    assert 1 <= EmbeddedServer().threads <= 2


async def test_cli_serve_prints_url_and_reaps_on_sigterm() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "raas.cli",
        "llm",
        "serve",
        "-np",
        "1",
        "--ctx-per-slot",
        "256",
        "-t",
        "1",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode().strip()
        assert line.startswith("http://127.0.0.1:")
        async with httpx.AsyncClient() as http:
            props = (await http.get(f"{line}/props")).json()
        children = _children(proc.pid)
        assert len(children) == 1
        assert props["default_generation_settings"]["n_ctx"] == 256
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert all(_gone(c) for c in children)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _temp_dirs_of(pid: int) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"raas-llama-{pid}-*"))


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, check=False
    )
    return [int(x) for x in out.stdout.split()]


_HOLDER = """
import asyncio, sys
from raas.llm import embedded
from raas.llm.embedded import EmbeddedServer, ServerCrashed, reap_stale_dirs
async def main():
    srv = EmbeddedServer(parallel=1, ctx_per_slot=256, threads=1)
    await srv.start()
    print(srv.pid, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_server_dies_with_a_killed_parent() -> None:
    """Even SIGKILL of the Python process (no atexit, no finally) takes llama-server down with it."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _HOLDER, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        child = int((await asyncio.wait_for(proc.stdout.readline(), 120)).decode())
        assert not _gone(child)
        proc.kill()
        await proc.wait()
        for _ in range(200):
            if _gone(child):
                break
            await asyncio.sleep(0.05)
        assert _gone(child)
        # its temp dir outlived it (no code ran in the killed process); the next start reaps it
        leftovers = _temp_dirs_of(proc.pid)
        assert len(leftovers) == 1
        assert set(leftovers) <= set(reap_stale_dirs()) and _temp_dirs_of(proc.pid) == []
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
