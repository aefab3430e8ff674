"""Persistent bash sessions on a pseudo-terminal: the event-loop side.

What bash is told and how its answers are parsed lives in :mod:`.bashproto` (pure functions); terminal
modes and input-wait detection in :mod:`.ptyctl`. This module owns the processes and descriptors, reads
the pty through the event loop (never by sleeping or polling; the waits are in :mod:`.loopwait`), and
turns deadlines into results:

* a command finishes when its report comes through the terminal (exit status, cwd);
* ``timeout`` (default: the server's ``--bash-timeout``) interrupts it: SIGINT to the foreground job,
  then SIGKILL, then a restart of the shell if it still does not answer;
* after ``no_output_timeout`` seconds without output (or the server's ``--bash-input-wait`` when none is
  given), a command blocked reading the terminal returns with ``waiting_for_input`` and keeps running
  (``bash.send`` gives it input); any other command is interrupted only if ``no_output_timeout`` was set.
"""

from __future__ import annotations

import _signal as signal  # the C module: signal.py imports enum, a sandbox's first call pays for it
import errno
import os
import termios

from . import bashproto, ptyctl
from . import loop as aio
from .loopwait import until, write_until
from .output import OutputBuffer
from .procs import Reaper, find_bash, kill_tree
from .protocol import BAD_REQUEST, TOOL_ERROR, TOOL_UNAVAILABLE, ProtocolError

TYPE_CHECKING = False  # typing is not imported at run time: it costs a sandbox's first call
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional

# How long an interrupted command gets to return to the prompt before harsher steps.
INTERRUPT_GRACE_S = 1.0
# While interrupting: how often to look whether bash has the terminal back, and how long bash may take
# to act on SIGINT before the probe line is written (it prints a newline as soon as it has).
INTERRUPT_STEP_S = 0.02
PROBE_SETTLE_S = 0.25
START_TIMEOUT_S = 30.0
MAX_INPUT = 1 << 20
_PROMPT_ENV = ("PS0", "PS1", "PS2", "PROMPT_COMMAND")


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
        runner: str,
        rows: int = 50,
        cols: int = 200,
    ) -> None:
        self.name = name
        self.workdir = workdir
        self.cwd = workdir
        self._env = {k: v for k, v in env.items() if k not in _PROMPT_ENV}
        self._tmpdir = tmpdir
        self._reaper = reaper
        self._runner = runner
        self._dims = (rows, cols)
        self.lock = aio.Lock()
        self.pid = -1
        self.fd = -1
        self.alive = False
        self.returncode: Optional[int] = None
        self.retired = False
        self._exited: Optional[aio.Future] = None
        self._fds: List[int] = []
        self._cmd_fd = -1
        self._paths: Optional[bashproto.Paths] = None
        self._scanner = bashproto.ReportScanner()
        self._seq = 0
        self._nonce = ""
        self._state = bashproto.ShellState()
        self._done: Optional[aio.Future] = None
        self._buffer = OutputBuffer(4096)
        self._modes: Optional[List[Any]] = None
        self._tty = -1
        self._nonces = bytearray()
        self._dirty = False
        self.last_output = 0.0

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """A command started by an earlier call is still running (it returned ``waiting_for_input``)."""
        return self._done is not None and not self._done.done()

    async def start(self) -> None:
        """Spawn bash and wait for its first report."""
        bash = find_bash()
        if bash is None:
            raise ProtocolError(TOOL_UNAVAILABLE, "bash is unavailable: the sandbox has no bash")
        loop = aio.get_running_loop()
        self._scanner = bashproto.ReportScanner()
        self._buffer = OutputBuffer(4096)
        self._seq = 0
        self._state = bashproto.ShellState()
        self._nonce = bashproto.nonce_from(os.urandom(8))
        self._scanner.expect(self._nonce, 0)
        self._done = loop.create_future()
        rc_fd = -1
        try:
            me = os.getpid()
            self._cmd_fd = self._own(ptyctl.memory_file("raas-cmd", self._tmpdir))
            defs_fd = self._own(ptyctl.memory_file("raas-defs", self._tmpdir))
            rc_fd = ptyctl.memory_file("raas-rc", self._tmpdir)
            self._paths = bashproto.Paths(
                bashproto.proc_fd_path(me, self._cmd_fd),
                bashproto.proc_fd_path(me, defs_fd),
                self._runner,
            )
            ptyctl.write_file(defs_fd, bashproto.definitions(self._paths).encode("ascii"))
            ptyctl.write_file(rc_fd, bashproto.rcfile(self._paths, self._nonce).encode("ascii"))
            self.pid, self.fd = ptyctl.spawn(
                [bash, "--noprofile", "--rcfile", bashproto.proc_fd_path(me, rc_fd), "--noediting", "-i"],
                self.workdir,
                self._env,
                *self._dims,
            )
        except (OSError, ValueError) as exc:
            if rc_fd >= 0:
                os.close(rc_fd)
            self._done = None
            self.close()
            raise ProtocolError(TOOL_ERROR, "cannot start bash: %s" % exc) from None
        self.alive = True
        self.returncode = None
        self._exited = loop.create_future()
        pid = self.pid
        self._reaper.watch(pid, lambda code: self._on_exit(pid, code))
        os.set_blocking(self.fd, False)
        self._setup_tty()
        loop.add_reader(self.fd, self._on_readable)
        self.last_output = loop.time()
        try:
            done, _ = await aio.wait({self._done}, timeout=START_TIMEOUT_S)
            if not done:
                raise ProtocolError(TOOL_ERROR, "bash did not start within %ss" % START_TIMEOUT_S)
            self._settle(self._done.result())
        except SessionDead:
            self.close()
            raise ProtocolError(TOOL_ERROR, "bash exited while starting") from None
        except BaseException:
            self.close()
            raise
        finally:
            self._done = None
            os.close(rc_fd)

    def _own(self, fd: int) -> int:
        self._fds.append(fd)
        return fd

    def _setup_tty(self) -> None:
        try:
            self._modes = ptyctl.neutral_modes(termios.tcgetattr(self.fd))
            ptyctl.set_modes(self.fd, self._modes)
            peer = ptyctl.slave_fd(self.fd)
            try:
                self._tty = os.fstat(peer).st_rdev
            finally:
                os.close(peer)
        except (termios.error, OSError):
            pass

    def close(self, kill: bool = True) -> None:
        """Kill the shell with everything it started (unless ``kill`` is false: the server's shutdown
        sweep does it), and release the pty and descriptors."""
        try:
            loop: Optional[aio.Loop] = aio.get_running_loop()
        except RuntimeError:
            loop = None
        for fd in [self.fd, *self._fds]:
            if fd >= 0 and loop is not None:
                loop.remove_reader(fd)
        if self.pid > 0:
            # Once reaped, the pid may belong to someone else; its session id cannot be reused
            # while the session's members live, so those are still safe to kill.
            if kill:
                kill_tree(self.pid, include_root=self.returncode is None)
            self.pid = -1
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
        self.fd = -1
        self.alive = False
        self._fail(SessionDead(self.returncode))
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._cmd_fd = -1

    # -- events ----------------------------------------------------------------------------------

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
        self._take(data)
        self.last_output = aio.get_running_loop().time()

    def _take(self, data: bytes) -> None:
        output, reports = self._scanner.feed(data)
        if output:
            self._buffer.feed(output)
        for report in reports:
            done = self._done
            if (
                report.seq == self._seq
                and report.nonce == self._nonce
                and done is not None
                and not done.done()
            ):
                done.set_result(report)

    def _drain_pty(self) -> None:
        """Take what the pty holds now (a pty read first flushes what the kernel has not passed on)."""
        for _ in range(64):
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                return
            if not data:
                return
            self._take(data)

    def _on_eof(self) -> None:
        try:
            aio.get_running_loop().remove_reader(self.fd)
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
            self._drain_pty()
            try:
                aio.get_running_loop().remove_reader(self.fd)
            except (RuntimeError, ValueError):
                pass
        self.alive = False
        self._fail(SessionDead(returncode))

    def _fail(self, exc: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    # -- commands --------------------------------------------------------------------------

    def _prepare_tty(self) -> None:
        """Before bash reads a line: the tool's modes back, and no stale input queued ahead of it."""
        if self._modes is not None:
            ptyctl.set_modes(self.fd, self._modes)
        if self._dirty:
            ptyctl.flush_input(self.fd)
            self._dirty = False

    def _next_nonce(self) -> str:
        """64 random bits per command, drawn from a pool refilled every 512 commands (one syscall)."""
        if len(self._nonces) < 8:
            self._nonces = bytearray(os.urandom(4096))
        nonce = bashproto.nonce_from(bytes(self._nonces[-8:]))
        del self._nonces[-8:]
        return nonce

    def _start_command(self, command: str) -> aio.Future:
        data = bashproto.command_bytes(command)
        inline = bashproto.inline_argument(data)
        if inline is None:
            ptyctl.write_file(self._cmd_fd, data)
        self._seq += 1
        self._nonce = self._next_nonce()
        self._scanner.expect(self._nonce, self._seq)
        assert self._paths is not None
        line = bashproto.command_line(
            self._seq, self._nonce, self._state, inline, self._paths, bashproto.needs_runner(command)
        )
        done = aio.get_running_loop().create_future()
        self._done = done
        self._prepare_tty()
        try:
            os.write(self.fd, line)
        except OSError:
            pass  # the shell is gone: its exit fails ``done``
        return done

    async def run(
        self,
        command: str,
        limits: bashproto.Limits,
        cap: int,
        restart: Callable[[], Any],
    ) -> Dict[str, Any]:
        """Run one command; the caller holds ``self.lock``. ``restart`` respawns this session."""
        if self.running:
            raise ProtocolError(
                TOOL_ERROR,
                "bash session %r is still running a command that waits for input: give it input with "
                "bash.send, or interrupt it with bash.send interrupt=true" % self.name,
            )
        previous = self._done
        if previous is not None:
            # A command that returned waiting_for_input finished since; its output is still buffered.
            self._done = None
            if previous.exception() is None:
                self._settle(previous.result())
        pending_head, pending_tail, _ = self._buffer.raw()
        self._buffer = OutputBuffer(cap)
        # Output that arrived between commands (background jobs) belongs to this one.
        self._buffer.feed(pending_head + pending_tail)
        self.last_output = aio.get_running_loop().time()
        done = self._start_command(command)
        return await self._follow(done, limits, cap, restart, interrupt=None)

    async def send(
        self, text: str, interrupt: bool, limits: bashproto.Limits, cap: int, restart: Callable[[], Any]
    ) -> Dict[str, Any]:
        """Type ``text`` into the running command (or interrupt it) and keep reading its output."""
        done = self._done
        if done is None:
            raise ProtocolError(
                TOOL_ERROR, "no command is running in bash session %r (start one with bash.run)" % self.name
            )
        data = bashproto.input_bytes(text)
        if len(data) > MAX_INPUT:
            raise ProtocolError(BAD_REQUEST, "input of %d bytes exceeds %d bytes" % (len(data), MAX_INPUT))
        loop = aio.get_running_loop()
        self.last_output = loop.time()
        mode = "hard" if interrupt else None
        if data == b"\x03" and ptyctl.signals_enabled(self.fd):
            # Ctrl-C as a key: SIGINT like the terminal would send, but with the same care as an interrupt
            # (bash may discard the command line) and without escalating if the program carries on.
            mode = "soft"
        if not done.done() and data and mode is None:
            # The report may be in the pty already: then the command is over and bash must not get the text.
            self._drain_pty()
            if not done.done():
                self._dirty = True
                await write_until(self.fd, data, done, limits.deadline(loop.time()))
        return await self._follow(done, limits, cap, restart, interrupt=mode)

    async def _follow(
        self,
        done: aio.Future,
        limits: bashproto.Limits,
        cap: int,
        restart: Callable[[], Any],
        interrupt: Optional[str],
    ) -> Dict[str, Any]:
        """Wait for the command (``interrupt``: ``"hard"`` stops it, ``"soft"`` only sends SIGINT first)."""
        timed_out = interrupted = restarted = waiting = False
        exit_code: Optional[int] = None
        if interrupt == "soft":
            # Ended by the Ctrl-C, or the program took it and carries on: then follow it as usual.
            interrupted = not done.done() and await self._interrupt(done, escalate=False)
        if interrupted:
            reason = "done"
        elif interrupt == "hard" and not done.done():
            interrupted = True
            reason = "done" if await self._interrupt(done) else "stuck"
        else:
            reason = await self._wait(done, limits)
            if reason in ("timeout", "no_output"):
                timed_out = interrupted = True
                reason = "done" if await self._interrupt(done) else "stuck"
        if reason == "waiting":
            waiting = True
        elif reason == "done":
            exc = done.exception()
            if isinstance(exc, SessionDead):
                if self.returncode is None and self._exited is not None:
                    # EOF on the pty can come just before the exit status.
                    await aio.wait({self._exited}, timeout=INTERRUPT_GRACE_S)
                # The shell's own exit status (``exit 3``); none when a signal killed it.
                exit_code = self.returncode if self.returncode is not None and self.returncode >= 0 else None
                restarted = True
            elif exc is not None:
                raise exc
            else:
                report = done.result()
                exit_code = self._settle(report)
                if "x" in report.flags:
                    # Under ``set -x`` bash traced the call of the report function: not output.
                    self._buffer.cut_line(
                        b"__raas_z %d %s %d" % (report.seq, report.nonce.encode(), report.status)
                    )
                if interrupted:
                    self._strip_probe_echo(report)
        else:
            restarted = True
        if waiting:
            self._buffer.feed(self._scanner.release())
        else:
            self._done = None
        if interrupted:
            self._dirty = True
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
            "waiting_for_input": waiting,
            "cwd": self.cwd,
            "session": self.name,
        }

    def _settle(self, report: bashproto.Report) -> int:
        """Take over what a finished command left: ``$?``, options and prompts for the next one; the cwd."""
        state = self._state
        if (report.status, report.flags, report.saved) != state:
            self._state = report.state()
        self.cwd = report.cwd or self._proc_cwd()
        return report.status

    def _proc_cwd(self) -> str:
        try:
            return os.readlink("/proc/%d/cwd" % self.pid)
        except OSError:
            return self.cwd

    def _strip_probe_echo(self, report: bashproto.Report) -> None:
        """After an aborted command bash printed the user's PS1, the probe line (under ``set -v``) and PS0."""
        self._buffer.drop_suffix(report.prompt0.encode("utf-8", "replace"))
        if self._paths is not None:
            self._buffer.drop_suffix(bashproto.probe_line(self._seq, self._nonce, self._paths))
        self._buffer.drop_suffix(report.prompt.encode("utf-8", "replace"))

    async def _wait(self, done: aio.Future, limits: bashproto.Limits) -> str:
        """Wait for the report: ``done``, ``timeout``, ``no_output`` or ``waiting``. Timers, no polling."""
        loop = aio.get_running_loop()
        hard = limits.deadline(loop.time())
        silence = limits.silence
        check = self.last_output + silence if silence else float("inf")
        while not done.done():
            now = loop.time()
            if now >= hard:
                return "timeout"
            if now >= check:
                if self.last_output + silence > now:
                    check = self.last_output + silence  # output came meanwhile
                    continue
                if self._tty >= 0 and ptyctl.waiting_for_input(self.fd, self.pid, self._tty):
                    return "waiting"
                if limits.no_output_s is not None:
                    return "no_output"
                check = now + silence
                continue
            await until(done, min(hard, check))
        return "done"

    async def _interrupt(self, done: aio.Future, escalate: bool = True) -> bool:
        """SIGINT the foreground job, then SIGKILL it; True once bash reported the command's end.

        SIGINT goes to the process group directly (not as a ``^C`` byte), so ``stty raw``/``-isig`` cannot
        turn it into input for the next command. A Ctrl-C'd command line is discarded by bash together
        with its report; bash then prints a newline and its prompt. Once bash holds the terminal and has
        printed something (or has been quiet for :data:`PROBE_SETTLE_S`), a probe line asks for the status.
        Without ``escalate``, a program that keeps the terminal (a REPL catching Ctrl-C) is left running.
        """
        loop = aio.get_running_loop()
        signalled = loop.time()
        self._signal_foreground(signal.SIGINT)
        deadline = signalled + INTERRUPT_GRACE_S
        kills = 0
        probed = False
        shell_since: Optional[float] = None
        while not done.done():
            fg = ptyctl.foreground_group(self.fd)
            if fg is None:
                break
            now = loop.time()
            if fg != self.pid:
                shell_since = None
                if not escalate and (self.last_output > signalled or now >= deadline):
                    break
                if now >= deadline:
                    if kills >= 3:
                        break
                    kills += 1
                    signalled = now
                    self._signal_foreground(signal.SIGKILL)
                    deadline = now + INTERRUPT_GRACE_S
            elif not probed:
                if shell_since is None:
                    shell_since = now
                if self.last_output > signalled or now - shell_since >= PROBE_SETTLE_S:
                    probed = True
                    self._probe()
                    deadline = now + INTERRUPT_GRACE_S
            elif now >= deadline:
                break  # bash itself does not come back (a shell loop that ignores SIGINT)
            await aio.wait({done}, timeout=INTERRUPT_STEP_S)
        return done.done()

    def _signal_foreground(self, sig: int) -> None:
        fg = ptyctl.foreground_group(self.fd)
        if fg is None or fg <= 1:
            return
        if sig == signal.SIGKILL and fg == self.pid:
            return  # never the shell itself: the probe or a restart deals with it
        try:
            os.killpg(fg, sig)
        except OSError:
            pass

    def _probe(self) -> None:
        if self._paths is None:
            return
        if self._modes is not None:
            ptyctl.set_modes(self.fd, self._modes)
        ptyctl.flush_input(self.fd)
        try:
            os.write(self.fd, bashproto.probe_line(self._seq, self._nonce, self._paths))
        except OSError:
            pass
