"""Named bash sessions: created on first use (race-free against the session limit), closed on request."""

from __future__ import annotations

import os

from . import bashproto, ptyctl
from . import loop as aio
from .bash import BashSession
from .procs import Reaper
from .protocol import DEFAULT_INPUT_WAIT_S, DEFAULT_TIMEOUT_S, TOOL_ERROR, ProtocolError

TYPE_CHECKING = False  # typing is not imported at run time: it costs a sandbox's first call
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional


class BashTool:
    """Named bash sessions, created on first use."""

    def __init__(
        self,
        workdir: str,
        env: Dict[str, str],
        tmpdir: str,
        reaper: Reaper,
        max_sessions: int,
        default_timeout_s: Optional[float] = DEFAULT_TIMEOUT_S,
        input_wait_s: Optional[float] = DEFAULT_INPUT_WAIT_S,
    ) -> None:
        self.workdir = workdir
        self.env = env
        self.tmpdir = tmpdir
        self.reaper = reaper
        self.max_sessions = max_sessions
        self.default_timeout_s = default_timeout_s
        self.input_wait_s = input_wait_s
        self.sessions: Dict[str, BashSession] = {}
        # Sessions being started count against the limit too, so concurrent first calls cannot overshoot.
        self._starting: Dict[str, aio.Future] = {}
        self._runner_fd = -1

    def _runner_path(self) -> str:
        if self._runner_fd < 0:
            fd = ptyctl.memory_file("raas-runner", self.tmpdir)
            ptyctl.write_file(fd, bashproto.RUNNER.encode("ascii"))
            self._runner_fd = fd
        return bashproto.proc_fd_path(os.getpid(), self._runner_fd)

    async def _get(self, name: str) -> BashSession:
        while True:
            session = self.sessions.get(name)
            if session is not None:
                return session
            pending = self._starting.get(name)
            if pending is None:
                break
            await aio.wait({pending})  # another call is starting it: use that one
        if len(self.sessions) + len(self._starting) >= self.max_sessions:
            raise ProtocolError(
                TOOL_ERROR,
                "too many bash sessions (limit %d: %d open, %d starting); close one first"
                % (self.max_sessions, len(self.sessions), len(self._starting)),
            )
        started = aio.get_running_loop().create_future()
        self._starting[name] = started
        try:
            session = BashSession(name, self.workdir, self.env, self.tmpdir, self.reaper, self._runner_path())
            await session.start()
            self.sessions[name] = session
            return session
        finally:
            del self._starting[name]
            started.set_result(None)

    def limits(self, timeout_s: Optional[float], no_output_s: Optional[float]) -> bashproto.Limits:
        """A call's limits: without ``timeout`` and ``no_output_timeout`` the server's default timeout applies.

        With only ``no_output_timeout`` there is no overall limit: the command runs as long as it prints.
        """
        if timeout_s is None and no_output_s is None:
            timeout_s = self.default_timeout_s
        return bashproto.Limits(timeout_s, no_output_s, self.input_wait_s)

    async def run(
        self,
        command: str,
        session: str,
        timeout_s: Optional[float],
        no_output_timeout_s: Optional[float],
        cap: int,
    ) -> Dict[str, Any]:
        sess = await self._get(session)
        async with sess.lock:
            limits = self.limits(timeout_s, no_output_timeout_s)
            return await self._call(sess, lambda: sess.run(command, limits, cap, sess.start))

    async def send(
        self,
        session: str,
        text: str,
        interrupt: bool,
        timeout_s: Optional[float],
        no_output_timeout_s: Optional[float],
        cap: int,
    ) -> Dict[str, Any]:
        sess = self.sessions.get(session)
        if sess is None:
            raise ProtocolError(TOOL_ERROR, "no bash session %r (start one with bash.run)" % session)
        async with sess.lock:
            limits = self.limits(timeout_s, no_output_timeout_s)
            return await self._call(sess, lambda: sess.send(text, interrupt, limits, cap, sess.start))

    async def _call(self, sess: BashSession, op: Callable[[], Any]) -> Dict[str, Any]:
        if sess.retired:
            raise ProtocolError(TOOL_ERROR, "bash session %r was closed" % sess.name)
        was_dead = not sess.alive
        if was_dead:
            sess.close()
            await sess.start()
        result = await op()
        if was_dead:
            result["restarted"] = True
        return result

    def close(self, name: str, kill: bool = True) -> bool:
        sess = self.sessions.pop(name, None)
        if sess is None:
            return False
        sess.retired = True
        sess.close(kill)
        return True

    def list(self) -> List[Dict[str, Any]]:
        return [
            {
                "session": s.name,
                "alive": s.alive,
                "busy": s.lock.locked() or s.running,
                "cwd": s.cwd,
                "pid": s.pid,
            }
            for s in self.sessions.values()
        ]

    def close_all(self, kill: bool = True) -> None:
        """``kill=False``: release the sessions but leave their processes to the caller's sweep."""
        for name in list(self.sessions):
            self.close(name, kill)
        if self._runner_fd >= 0:
            os.close(self._runner_fd)
            self._runner_fd = -1
