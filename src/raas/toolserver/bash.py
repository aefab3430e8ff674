"""Persistent bash sessions on a pseudo-terminal.

Each command is written to a file and run with one ``source`` line, so multi-line input, heredocs and
syntax errors behave as in a script while cwd, variables and functions persist. Completion is detected
by a per-session sentinel that ``PROMPT_COMMAND`` prints (with the command's sequence number, ``$?``
and ``$PWD``) whenever bash is back at its prompt; the pty is read through the event loop, never by
sleeping or polling.
"""

from __future__ import annotations

import asyncio
import errno
import os
import secrets
import shutil
import signal
import termios
from typing import Any, Callable, Dict, List, Optional, Tuple

from .output import OutputBuffer
from .procs import Reaper, kill_tree
from .protocol import TOOL_ERROR, TOOL_UNAVAILABLE, ProtocolError

SENTINEL_START = b"\x1e"
SENTINEL_END = b"\x1e"
_MAX_SENTINEL_BODY = 16384
# How long an interrupted command gets to return to the prompt before harsher steps.
INTERRUPT_GRACE_S = 1.0
START_TIMEOUT_S = 30.0

_RC_TEMPLATE = r"""
PS1=''
PS2=''
PS0=''
PS4='+ '
set +H
set +o history 2>/dev/null
unset HISTFILE PROMPT_DIRTRIM
export TERM=dumb PAGER=cat GIT_PAGER=cat SYSTEMD_PAGER=cat MANPAGER=cat
__raas_seq=0
PROMPT_COMMAND='printf "\036%s %s %s %s\036" @TOKEN@ "$__raas_seq" "$?" "$PWD"'
"""


class SentinelScanner:
    """Splits the pty byte stream into command output and sentinels, across read boundaries."""

    def __init__(self, token: bytes) -> None:
        self.prefix = SENTINEL_START + token + b" "
        self._carry = b""

    def feed(self, data: bytes) -> List[Tuple[str, Any]]:
        """Return a list of ``("out", bytes)`` and ``("sentinel", (seq, rc, pwd))`` events."""
        events: List[Tuple[str, Any]] = []
        if self._carry:
            data = self._carry + data
            self._carry = b""
        prefix = self.prefix
        while data:
            i = data.find(prefix)
            if i < 0:
                # Hold back a possible partial prefix at the end.
                keep = 0
                j = data.rfind(SENTINEL_START, max(0, len(data) - len(prefix) + 1))
                if j >= 0 and prefix.startswith(data[j:]):
                    keep = len(data) - j
                out = data[: len(data) - keep]
                if out:
                    events.append(("out", out))
                self._carry = data[len(data) - keep :]
                break
            if i:
                events.append(("out", data[:i]))
            body_start = i + len(prefix)
            j = data.find(SENTINEL_END, body_start)
            if j < 0:
                if len(data) - body_start > _MAX_SENTINEL_BODY:
                    events.append(("out", data[i:body_start]))
                    data = data[body_start:]
                    continue
                self._carry = data[i:]
                break
            parsed = _parse_sentinel(data[body_start:j])
            if parsed is None:
                events.append(("out", data[i:body_start]))
                data = data[body_start:]
                continue
            events.append(("sentinel", parsed))
            data = data[j + 1 :]
        return events


def _parse_sentinel(body: bytes) -> Optional[Tuple[int, int, str]]:
    parts = body.split(b" ", 2)
    if len(parts) != 3:
        return None
    try:
        return int(parts[0]), int(parts[1]), parts[2].decode("utf-8", "replace")
    except ValueError:
        return None


def _child_setup() -> None:
    """Undo what the Python parent changed but a shell must not inherit."""
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
    except (OSError, ValueError, AttributeError):
        pass


class SessionDead(Exception):
    """The shell exited (``exit``, killed) while we waited on it."""

    def __init__(self, returncode: Optional[int]) -> None:
        super().__init__("bash exited")
        self.returncode = returncode


class BashSession:
    """One bash process on a pty; commands run one at a time, in order."""

    def __init__(
        self,
        name: str,
        workdir: str,
        env: Dict[str, str],
        tmpdir: str,
        reaper: Reaper,
        rows: int = 50,
        cols: int = 200,
    ) -> None:
        self.name = name
        self.workdir = workdir
        self.cwd = workdir
        self._env = env
        self._tmpdir = tmpdir
        self._reaper = reaper
        self._dims = (rows, cols)
        self._index = 0
        self.lock = asyncio.Lock()
        self.proc: Any = None
        self.pid = -1
        self.fd = -1
        self.alive = False
        self.returncode: Optional[int] = None
        self._exited: Optional[asyncio.Future] = None
        self._seq = 0
        self._waiting_seq = -1
        self._done: Optional[asyncio.Future] = None
        self._scanner: Optional[SentinelScanner] = None
        self._buffer = OutputBuffer(4096)
        self.last_output = 0.0
        self._script = ""
        self._script_fd = -1
        self._rcfile = ""
        self.retired = False

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, index: int) -> None:
        """Spawn bash and wait for its first prompt."""
        import ptyprocess  # stdlib-only environments still import the rest of the server

        bash = find_bash()
        if bash is None:
            raise ProtocolError(TOOL_UNAVAILABLE, "bash is unavailable: the sandbox has no bash")
        self._index = index
        loop = asyncio.get_running_loop()
        token = secrets.token_hex(8)
        self._scanner = SentinelScanner(token.encode("ascii"))
        self._script = os.path.join(self._tmpdir, "cmd-%d.sh" % index)
        self._rcfile = os.path.join(self._tmpdir, "rc-%d.sh" % index)
        self._seq = 0
        self._waiting_seq = 0
        self._done = loop.create_future()
        self._buffer = OutputBuffer(4096)
        env = dict(self._env)
        env.setdefault("PS1", "")
        try:
            _write_small_file(self._rcfile, _RC_TEMPLATE.replace("@TOKEN@", token))
            self._script_fd = os.open(self._script, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self.proc = ptyprocess.PtyProcess.spawn(
                [bash, "--noprofile", "--rcfile", self._rcfile, "--noediting", "-i"],
                cwd=self.workdir,
                env=env,
                echo=False,
                preexec_fn=_child_setup,
                dimensions=self._dims,
            )
        except (OSError, ValueError) as exc:
            self._done = None
            self.close()
            raise ProtocolError(TOOL_ERROR, "cannot start bash: %s" % exc) from None
        self.pid = self.proc.pid
        self.fd = self.proc.fd
        self.alive = True
        self.returncode = None
        self._exited = loop.create_future()
        pid = self.pid
        self._reaper.watch(pid, lambda code: self._on_exit(pid, code))
        os.set_blocking(self.fd, False)
        self._reset_tty()
        loop.add_reader(self.fd, self._on_readable)
        self.last_output = loop.time()
        try:
            done, _ = await asyncio.wait({self._done}, timeout=START_TIMEOUT_S)
            if not done:
                raise ProtocolError(TOOL_ERROR, "bash did not start within %ss" % START_TIMEOUT_S)
            self._done.result()
        except SessionDead:
            self.close()
            raise ProtocolError(TOOL_ERROR, "bash exited while starting") from None
        except BaseException:
            self.close()
            raise
        finally:
            self._done = None

    def close(self) -> None:
        """Kill the shell with everything it started, and release the pty."""
        if self.fd >= 0:
            try:
                asyncio.get_running_loop().remove_reader(self.fd)
            except RuntimeError:
                pass
        if self.pid > 0:
            # Once reaped, the pid may belong to someone else; its session id cannot be reused
            # while the session's members live, so those are still safe to kill.
            kill_tree(self.pid, include_root=self.returncode is None)
            self.pid = -1
        if self.proc is not None:
            try:
                self.proc.fileobj.close()
            except OSError:
                pass
            # ptyprocess would otherwise try to terminate and wait on a child we reap ourselves.
            self.proc.closed = True
            self.proc = None
        self.fd = -1
        self.alive = False
        self._fail(SessionDead(self.returncode))
        if self._script_fd >= 0:
            os.close(self._script_fd)
            self._script_fd = -1
        for path in (self._script, self._rcfile):
            if path:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    # -- pty events ----------------------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno not in (errno.EIO, errno.EBADF):
                raise
            data = b""
        if not data:
            self._on_eof()
            return
        assert self._scanner is not None
        for kind, value in self._scanner.feed(data):
            if kind == "out":
                self._buffer.feed(value)
                self.last_output = asyncio.get_running_loop().time()
            else:
                seq, rc, pwd = value
                self.cwd = pwd
                if seq == self._waiting_seq and self._done is not None and not self._done.done():
                    self._done.set_result(rc)

    def _on_eof(self) -> None:
        try:
            asyncio.get_running_loop().remove_reader(self.fd)
        except (RuntimeError, ValueError):
            pass
        self.alive = False
        self._fail(SessionDead(self.returncode))

    def _on_exit(self, pid: int, returncode: int) -> None:
        """bash is gone; take what it left in the pty, then end the session.

        Waiting for EOF is not enough: a background job can hold the pty open long after bash exited.
        """
        if pid != self.pid:
            return  # a shell this session already replaced
        self.returncode = returncode
        if self._exited is not None and not self._exited.done():
            self._exited.set_result(returncode)
        if self.fd >= 0:
            for _ in range(64):
                try:
                    data = os.read(self.fd, 65536)
                except OSError:
                    break
                if not data:
                    break
                assert self._scanner is not None
                for kind, value in self._scanner.feed(data):
                    if kind == "out":
                        self._buffer.feed(value)
            try:
                asyncio.get_running_loop().remove_reader(self.fd)
            except (RuntimeError, ValueError):
                pass
        self.alive = False
        self._fail(SessionDead(returncode))

    def _fail(self, exc: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    # -- commands --------------------------------------------------------------------------

    def _reset_tty(self) -> None:
        """No echo, and no ``\n`` -> ``\r\n`` translation, so output bytes are what the program wrote.

        Programs killed mid-way (editors, REPLs) can leave other settings; the master side resets them.
        """
        try:
            attrs = termios.tcgetattr(self.fd)
            if attrs[3] & termios.ECHO or attrs[1] & termios.ONLCR:
                attrs[3] &= ~termios.ECHO
                attrs[1] &= ~termios.ONLCR
                termios.tcsetattr(self.fd, termios.TCSANOW, attrs)
        except termios.error:
            pass

    async def run(
        self,
        command: str,
        timeout_s: Optional[float],
        no_output_timeout_s: Optional[float],
        cap: int,
        restart: Callable[[], Any],
    ) -> Dict[str, Any]:
        """Run one command; the caller holds ``self.lock``. ``restart`` respawns this session."""
        loop = asyncio.get_running_loop()
        self._write_script(command)
        pending_head, pending_tail, _ = self._buffer.raw()
        self._buffer = OutputBuffer(cap)
        # Output of background jobs that arrived between commands belongs to this one.
        self._buffer.feed(pending_head + pending_tail)
        self._seq += 1
        self._waiting_seq = self._seq
        done = loop.create_future()
        self._done = done
        self._reset_tty()
        self.last_output = loop.time()
        line = " __raas_seq=%d; . %s\n" % (self._seq, _shell_quote(self._script))
        os.write(self.fd, line.encode("utf-8"))

        timed_out = interrupted = restarted = False
        exit_code: Optional[int] = None
        reason = await self._wait(done, timeout_s, no_output_timeout_s)
        if reason != "done":
            timed_out = True
            interrupted = True
            if await self._interrupt(done):
                reason = "done"
        if reason == "done":
            exc = done.exception()
            if isinstance(exc, SessionDead):
                if self.returncode is None and self._exited is not None:
                    # EOF on the pty can come just before the exit status.
                    await asyncio.wait({self._exited}, timeout=INTERRUPT_GRACE_S)
                # The shell's own exit status (``exit 3``); none when a signal killed it.
                exit_code = self.returncode if self.returncode is not None and self.returncode >= 0 else None
                restarted = True
            elif exc is not None:
                raise exc
            else:
                exit_code = done.result()
        else:
            restarted = True
        self._done = None
        output, truncated = self._buffer.text()
        self._buffer = OutputBuffer(cap)
        if restarted:
            self.close()
            if self.retired:
                raise ProtocolError(
                    TOOL_ERROR, "bash session %r was closed while the command ran" % self.name
                )
            await restart()
        return {
            "output": output,
            "exit_code": exit_code,
            "timed_out": timed_out,
            "interrupted": interrupted,
            "restarted": restarted,
            "truncated": truncated,
            "cwd": self.cwd,
            "session": self.name,
        }

    def _write_script(self, command: str) -> None:
        """Overwrite the session's command file in place.

        Rewriting through one open descriptor and shrinking with ftruncate(len) costs microseconds;
        truncating to zero on open makes ext4 flush the file on every command (milliseconds).
        """
        data = command.encode("utf-8", errors="replace")
        if not data.endswith(b"\n"):
            data += b"\n"
        os.pwrite(self._script_fd, data, 0)
        os.ftruncate(self._script_fd, len(data))

    async def _wait(
        self, done: asyncio.Future, timeout_s: Optional[float], no_output_timeout_s: Optional[float]
    ) -> str:
        """Wait for the sentinel; return ``done``, ``timeout`` or ``no_output``. Timers only, no polling."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        if timeout_s is None and no_output_timeout_s is None:
            await asyncio.wait({done})
            return "done"
        while not done.done():
            now = loop.time()
            deadline, reason = float("inf"), ""
            if timeout_s is not None:
                deadline, reason = start + timeout_s, "timeout"
            if no_output_timeout_s is not None and self.last_output + no_output_timeout_s < deadline:
                deadline, reason = self.last_output + no_output_timeout_s, "no_output"
            if deadline <= now:
                return reason
            await asyncio.wait({done}, timeout=deadline - now)
        return "done"

    async def _interrupt(self, done: asyncio.Future) -> bool:
        """Ctrl-C, then SIGKILL the foreground job; True if bash came back to its prompt."""
        try:
            os.write(self.fd, b"\x03")
        except OSError:
            return done.done()
        if await self._settle(done):
            return True
        for _ in range(3):
            try:
                pgrp = os.tcgetpgrp(self.fd)
            except OSError:
                return done.done()
            if pgrp <= 1 or pgrp == self.pid:
                break
            try:
                os.killpg(pgrp, signal.SIGKILL)
            except OSError:
                pass
            if await self._settle(done):
                return True
        return done.done()

    async def _settle(self, done: asyncio.Future) -> bool:
        await asyncio.wait({done}, timeout=INTERRUPT_GRACE_S)
        return done.done()


def find_bash() -> Optional[str]:
    if os.access("/bin/bash", os.X_OK):
        return "/bin/bash"
    return shutil.which("bash")


def _write_small_file(path: str, text: str) -> None:
    """A few hundred bytes, once per shell start: cheaper inline than a thread hop."""
    with open(path, "w", encoding="utf-8", errors="replace") as f:
        f.write(text)


def _shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


class BashTool:
    """Named bash sessions, created on first use."""

    def __init__(
        self, workdir: str, env: Dict[str, str], tmpdir: str, reaper: Reaper, max_sessions: int
    ) -> None:
        self.workdir = workdir
        self.env = env
        self.tmpdir = tmpdir
        self.reaper = reaper
        self.max_sessions = max_sessions
        self.sessions: Dict[str, BashSession] = {}
        self._counter = 0
        self._creating: Dict[str, asyncio.Lock] = {}

    async def _get(self, name: str) -> BashSession:
        session = self.sessions.get(name)
        if session is not None:
            return session
        lock = self._creating.setdefault(name, asyncio.Lock())
        async with lock:
            session = self.sessions.get(name)
            if session is not None:
                return session
            if len(self.sessions) >= self.max_sessions:
                raise ProtocolError(
                    TOOL_ERROR, "too many bash sessions (limit %d); close one first" % self.max_sessions
                )
            session = BashSession(name, self.workdir, self.env, self.tmpdir, self.reaper)
            self._counter += 1
            await session.start(self._counter)
            self.sessions[name] = session
            return session

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
            if sess.retired:
                raise ProtocolError(TOOL_ERROR, "bash session %r was closed" % session)
            was_dead = not sess.alive
            if was_dead:
                sess.close()
                await self._restart(sess)
            result = await sess.run(command, timeout_s, no_output_timeout_s, cap, lambda: self._restart(sess))
            if was_dead:
                result["restarted"] = True
            return result

    async def _restart(self, sess: BashSession) -> None:
        self._counter += 1
        await sess.start(self._counter)

    def close(self, name: str) -> bool:
        sess = self.sessions.pop(name, None)
        if sess is None:
            return False
        sess.retired = True
        sess.close()
        return True

    def list(self) -> List[Dict[str, Any]]:
        return [
            {"session": s.name, "alive": s.alive, "busy": s.lock.locked(), "cwd": s.cwd, "pid": s.pid}
            for s in self.sessions.values()
        ]

    def close_all(self) -> None:
        for name in list(self.sessions):
            self.close(name)
