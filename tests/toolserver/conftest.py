"""Start the tool server exactly as a sandbox does: bundle on PYTHONPATH, ``-m raas_toolserver``."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from raas.sandbox.client import ToolClient
from raas.toolserver.bundle import build_bundle
from raas.toolserver.protocol import READY_LINE


@dataclass
class RunningServer:
    proc: asyncio.subprocess.Process
    socket: str
    workdir: Path
    sandbox_id: str
    base: Path

    async def stop(self) -> int:
        """SIGTERM and wait: the server's own clean shutdown is what we test."""
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(20):
                return await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            raise

    def cleanup(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def processes_tagged(sandbox_id: str) -> list[int]:
    """Live processes whose environment carries ``RAAS_SANDBOX_ID=<sandbox_id>``."""
    needle = f"RAAS_SANDBOX_ID={sandbox_id}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != b"Z":
            found.append(int(name))
    return found


async def wait_gone(sandbox_id: str, limit_s: float = 10.0) -> list[int]:
    """Processes still tagged after a kill may need a moment to die; return those that never do."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while (left := processes_tagged(sandbox_id)) and loop.time() < end:  # noqa: ASYNC110 - /proc has no event
        await asyncio.sleep(0.05)
    return left


def path_exists(path: str) -> bool:
    return os.path.lexists(path)


@pytest.fixture(scope="session")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bundle(tmp_path_factory.mktemp("bundle"))[0]


async def start_server(
    bundle: Path, *, python: str = sys.executable, extra_args: tuple[str, ...] = (), stdin_pipe: bool = False
) -> RunningServer:
    # AF_UNIX paths are short: keep the socket directly under /tmp.
    base = Path(tempfile.mkdtemp(prefix="raas-ts-test-", dir="/tmp"))
    workdir = base / "work"
    workdir.mkdir()
    sock = str(base / "tool.sock")
    sandbox_id = f"test-{uuid.uuid4().hex[:12]}"
    tmp = base / "tmp"
    tmp.mkdir()
    # The server's own temp files go here, so tests can check they are removed.
    env = dict(os.environ, PYTHONPATH=str(bundle), RAAS_SANDBOX_ID=sandbox_id, TMPDIR=str(tmp))
    proc = await asyncio.create_subprocess_exec(
        python,
        "-m",
        "raas_toolserver",
        "--socket",
        sock,
        "--workdir",
        str(workdir),
        *extra_args,
        stdin=asyncio.subprocess.PIPE if stdin_pipe else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        line = await proc.stdout.readline()
    assert line.decode().strip() == READY_LINE, line
    return RunningServer(proc, sock, workdir, sandbox_id, base)


@pytest.fixture
async def fresh_server(bundle_dir: Path) -> AsyncIterator[RunningServer]:
    """A server of its own for tests that stop or break it; checked for leftovers afterwards."""
    srv = await start_server(bundle_dir)
    try:
        yield srv
    finally:
        if srv.proc.returncode is None:
            await srv.stop()
        leftovers = await wait_gone(srv.sandbox_id)
        srv.cleanup()
        assert leftovers == [], f"processes left behind: {leftovers}"


@pytest.fixture(scope="session")
async def shared_server(bundle_dir: Path) -> AsyncIterator[RunningServer]:
    srv = await start_server(bundle_dir)
    try:
        yield srv
    finally:
        code = await srv.stop()
        leftovers = processes_tagged(srv.sandbox_id)
        srv.cleanup()
        assert code == 0
        assert leftovers == [], f"processes left behind: {leftovers}"
        assert not path_exists(srv.socket)


@pytest.fixture(scope="session")
async def client(shared_server: RunningServer) -> AsyncIterator[ToolClient]:
    async with ToolClient(shared_server.socket, request_timeout_s=60) as c:
        yield c


@pytest.fixture
def session_name() -> str:
    """A bash session of the test's own, so tests sharing a server do not see each other's state."""
    return f"s-{uuid.uuid4().hex[:8]}"
