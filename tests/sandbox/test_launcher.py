"""The launcher learns of a sandbox's exit through a pidfd: no thread per live sandbox, no fd left behind,
the exit code exact, and the same through the thread fallback where pidfds are refused."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from raas.sandbox import SandboxManager
from raas.sandbox.config import make_config
from raas.sandbox.launcher import ServerProcess
from tests.conftest import PIDFD, open_fds, unavailable

pytestmark = pytest.mark.integration

# Threads parked in waitpid: the launcher's fallback, and asyncio's own child watcher.
WAIT_THREADS = ("raas-wait-", "asyncio-waitpid-")


def waiting_threads(ignore: frozenset[str] = frozenset()) -> list[str]:
    """Exit-watch threads alive now, less ``ignore`` (those of processes an earlier test in this pytest
    process left running on purpose, e.g. a session-scoped server)."""
    return [t.name for t in threading.enumerate() if t.name.startswith(WAIT_THREADS) and t.name not in ignore]


def fd_kinds() -> dict[str, int]:
    return {"pidfd": open_fds(PIDFD), "pipe": open_fds("pipe:")}


@pytest.fixture(params=["pidfd", "thread"])
def exit_watch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both ways of learning of an exit: the pidfd, and the thread used where ``pidfd_open`` is refused."""
    if request.param == "pidfd":
        try:
            os.close(os.pidfd_open(os.getpid()))
        except OSError as e:
            unavailable(f"pidfd_open is refused here ({e}): sandboxes fall back to a thread each")
    if request.param == "thread":

        def refused(pid: int, flags: int = 0) -> int:
            raise OSError(errno.ENOSYS, "pidfd_open refused (test)")

        monkeypatch.setattr(os, "pidfd_open", refused)
    yield request.param


async def spawn(script: str, tmp_path: Path) -> ServerProcess:
    log = os.open(tmp_path / "stderr", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        return await ServerProcess.spawn(["/bin/sh", "-c", script], env={}, cwd=str(tmp_path), stderr=log)
    finally:
        os.close(log)


async def test_stdout_and_exit_code(tmp_path: Path, exit_watch: str) -> None:
    before = fd_kinds()
    proc = await spawn("echo ready; read line; exit 7", tmp_path)
    assert await proc.stdout.readline() == b"ready\n"
    assert proc.returncode is None
    waiter = asyncio.ensure_future(proc.wait())
    await asyncio.sleep(0.05)
    assert not waiter.done()  # stdin is open: the process waits on it
    proc.close_stdin()  # the process reads EOF and exits
    assert await asyncio.wait_for(waiter, 30) == 7
    assert proc.returncode == 7
    proc.close_pipes()
    await asyncio.sleep(0)  # the transport closes its pipe in a callback
    assert fd_kinds() == before


async def test_a_cancelled_waiter_leaves_the_exit_to_the_others(tmp_path: Path, exit_watch: str) -> None:
    proc = await spawn("read line; exit 3", tmp_path)
    first = asyncio.ensure_future(proc.wait())
    await asyncio.sleep(0.01)
    first.cancel()
    proc.close_stdin()
    assert await asyncio.wait_for(proc.wait(), 30) == 3
    assert first.cancelled()
    proc.close_pipes()


async def test_killed_process_reports_the_signal(tmp_path: Path, exit_watch: str) -> None:
    proc = await spawn("echo up; exec sleep 600", tmp_path)
    assert await proc.stdout.readline() == b"up\n"
    proc.kill()
    assert await asyncio.wait_for(proc.wait(), 30) == -9
    proc.kill()  # reaped already: a no-op, never a signal to a recycled pid
    proc.close_pipes()


async def test_a_launch_that_fails_is_an_oserror_and_leaves_nothing(tmp_path: Path) -> None:
    before = fd_kinds()
    log = os.open(tmp_path / "stderr", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        with pytest.raises(FileNotFoundError):
            await ServerProcess.spawn([str(tmp_path / "missing")], env={}, cwd=None, stderr=log)
    finally:
        os.close(log)
    assert fd_kinds() == before


async def test_live_sandboxes_hold_no_thread_each(tmp_path: Path, exit_watch: str) -> None:
    """With pidfds, eight more live sandboxes add no thread (asyncio's watcher would add eight); the
    fallback adds exactly one per sandbox, and every one ends with its sandbox."""
    earlier = frozenset(waiting_threads())
    manager = SandboxManager(tmp_path / "state")
    cfg = make_config(backend="local")
    try:
        first = await manager.start(cfg, owner="test")
        base = threading.active_count()
        more = [await manager.start(cfg, owner="test") for _ in range(8)]
        added = threading.active_count() - base
        waiting = waiting_threads(earlier)
        if exit_watch == "pidfd":
            assert not waiting
            assert added < 8  # (a pool may have grown by a worker)
        else:
            assert len(waiting) == 9
            assert added >= 8
        for sb in (first, *more):
            assert (await sb.tools.bash("echo $((6*7))")).output.strip() == "42"
        await more[0].close()
        assert await more[0].wait_exited() is not None
    finally:
        await manager.close_all()
    for _ in range(100):  # fallback threads end once their process is reaped
        if not waiting_threads(earlier):
            break
        await asyncio.sleep(0.05)
    assert not waiting_threads(earlier)
    assert fd_kinds()["pidfd"] == 0
