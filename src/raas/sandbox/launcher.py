"""Host side: start a sandbox's first process and learn of its exit without a thread per process.

asyncio's child watcher on Python 3.11 parks one thread in ``waitpid`` for every live child, so a node
with 256 live sandboxes runs 256 such threads and pays a thread start (and its hand-offs) per sandbox. A
pidfd (Linux 5.3+) becomes readable when its process exits, so the event loop watches it like any socket,
and ``Popen.poll`` then reaps the process. Where ``pidfd_open`` is refused (an older kernel, a seccomp
filter), one daemon thread per process waits instead, as asyncio would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import threading
from collections.abc import Sequence
from typing import Any


class ServerProcess:
    """A launched process: its pid, its stdout as a stream, its stdin held open, its exit as a future.

    The process's stdin is a pipe only we hold: the tool server exits when it closes, however we die."""

    def __init__(self, popen: subprocess.Popen[bytes], stdout: asyncio.StreamReader) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdout = stdout
        self._stdout_transport: asyncio.BaseTransport | None = None
        self._loop = asyncio.get_running_loop()
        self._exit: asyncio.Future[int] = self._loop.create_future()
        self._pidfd = -1

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str | None,
        stderr: int,
        pass_fds: Sequence[int] = (),
        user: dict[str, Any] | None = None,
    ) -> ServerProcess:
        """Start ``argv`` in a new session; ``OSError`` if it cannot be started."""
        # Popen forks (vfork where it can) and execs here, on the loop thread, as asyncio's own
        # subprocess support does; the exec has happened when it returns.
        popen = subprocess.Popen(  # noqa: ASYNC220 - what asyncio's subprocess_exec does too
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            cwd=cwd,
            start_new_session=True,
            pass_fds=tuple(pass_fds),
            bufsize=0,
            **(user or {}),
        )
        assert popen.stdout is not None
        reader = asyncio.StreamReader()
        self = cls(popen, reader)
        try:
            self._watch_exit()
            transport, _ = await self._loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), popen.stdout
            )
            self._stdout_transport = transport
        except BaseException:
            self.kill()
            self.close_pipes()
            raise
        return self

    # ---- exit --------------------------------------------------------------------------------------
    @property
    def returncode(self) -> int | None:
        return self._popen.returncode

    async def wait(self) -> int:
        """The exit code, once the process has exited and been reaped; waiting may be cancelled."""
        return await asyncio.shield(self._exit)

    def _watch_exit(self) -> None:
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except OSError:
            threading.Thread(target=self._wait_in_thread, name=f"raas-wait-{self.pid}", daemon=True).start()
            return
        self._loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        code = self._popen.poll()
        if code is None:  # readable means exited; never seen otherwise, but keep watching if so
            return
        self._stop_watching()
        if not self._exit.done():
            self._exit.set_result(code)

    def _stop_watching(self) -> None:
        if self._pidfd >= 0:
            pidfd, self._pidfd = self._pidfd, -1
            with contextlib.suppress(Exception):  # the loop may be closed already
                self._loop.remove_reader(pidfd)
            os.close(pidfd)

    def _wait_in_thread(self) -> None:
        code = self._popen.wait()

        def done() -> None:
            if not self._exit.done():
                self._exit.set_result(code)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(done)

    # ---- control -----------------------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL the process itself (not its group), if it has not been reaped yet."""
        if self._popen.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._popen.kill()

    def close_stdin(self) -> None:
        if self._popen.stdin is not None:
            with contextlib.suppress(OSError):
                self._popen.stdin.close()

    def close_pipes(self) -> None:
        """Close both pipes and stop watching; for a process that has exited (or is being abandoned)."""
        self.close_stdin()
        if self._stdout_transport is not None:
            self._stdout_transport.close()
        elif self._popen.stdout is not None:
            self._popen.stdout.close()
        if self._exit.done():
            self._stop_watching()
