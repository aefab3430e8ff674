"""The sandbox interface shared by every backend, and the backend factory (the configuration is in
:mod:`raas.sandbox.config`).

A backend only says *how to launch* the tool server (:meth:`Sandbox.build_launch`, a pure function of
the config, paths and identity, so command construction is unit-testable without the runtime installed).
This class owns everything else: the host identity the sandbox runs as, private scratch dirs, spawning,
waiting for the ready line on a pipe, the tool client, death detection and a close() that always leaves
nothing behind.

Inside a container backend, the first process is ``raas_toolserver.boot`` (see its docstring): it builds
the sandbox's writable area (one size-capped tmpfs), its own capped devpts, the listening socket, makes
every other mount read-only and drops every capability before the tool server starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import os
import re
import shutil
import signal
import socket
import stat
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel

from raas.errors import RaasError
from raas.sandbox import procs
from raas.sandbox.client import ToolClient
from raas.sandbox.config import SandboxConfig
from raas.sandbox.executors import SandboxExecutors
from raas.sandbox.identity import SandboxIdentity, allocate_identity, current_identity, make_fresh_dir
from raas.sandbox.launcher import ServerProcess

if TYPE_CHECKING:
    from raas.sandbox.models import BashResult, IPythonResult

T = TypeVar("T")

READY_LINE = b"RAAS_TOOLSERVER_READY 1"
INNER_RUN = "/.raas/run"
INNER_LIB = "/.raas/lib"
INNER_AREA = "/.raas/rw"
SOCKET_NAME = "tool.sock"
# What the sandbox's python3 runs (with ``-S -c``): the boot step, then the tool server.
BOOT_CODE = "import raas_toolserver.boot as b; b.main()"
# AF_UNIX sun_path is 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


@dataclass
class LaunchSpec:
    """What to exec on the host to get a tool server that prints the ready line on stdout."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    # Paths the backend created and that close() must remove besides the scratch dir.
    extra_cleanup: list[Path] = field(default_factory=list)
    # Pass the options (argv[1:] up to "--") through ``--args FD`` (bwrap): no command line shows host paths.
    args_via_fd: bool = False


class SandboxTools(ToolClient):
    """The tool client of one sandbox: its per-command wall clock is the default bash/ipython timeout."""

    def __init__(self, socket_path: str, *, default_timeout: float | None = None, **kwargs: Any) -> None:
        super().__init__(socket_path, **kwargs)
        self.default_timeout = default_timeout

    async def bash(
        self,
        command: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - server-enforced
        **kwargs: Any,
    ) -> BashResult:
        return await super().bash(
            command, timeout=self.default_timeout if timeout is None else timeout, **kwargs
        )

    async def ipython(
        self,
        code: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - server-enforced
        **kwargs: Any,
    ) -> IPythonResult:
        return await super().ipython(
            code, timeout=self.default_timeout if timeout is None else timeout, **kwargs
        )


class Sandbox(ABC):
    """One running sandbox: a tool server reachable over ``<run_dir>/tool.sock``."""

    backend_name: ClassVar[str] = ""
    config_class: ClassVar[type[BaseModel]] = BaseModel
    """The config class this backend takes (its member of :data:`~raas.sandbox.config.SandboxConfig`)."""
    supports_seed: ClassVar[bool] = False
    """The backend lays ``config.seed`` dirs over the image before the boot step copies them (then its
    config is a :class:`~raas.sandbox.config.NamespaceSandboxConfig`)."""
    # Container backends run under a uid of their own when raas is root; local and docker do not.
    dedicated_identity: ClassVar[bool] = False

    def __init__(
        self,
        config: SandboxConfig,
        *,
        sandbox_id: str,
        owner: str,
        scratch: Path,
        bundle_dir: Path,
        on_close: Callable[[Sandbox], None] | None = None,
        executors: SandboxExecutors | None = None,
    ) -> None:
        """``executors``: the manager's (shared by its sandboxes); without them, or once they are shut down,
        the sandbox uses executors of its own and shuts them down when it has closed."""
        if not isinstance(config, self.config_class):
            raise RaasError(
                f"the {self.backend_name} backend takes a {self.config_class.__name__}, not "
                f"{type(config).__name__}",
                kind="bad_request",
            )
        self.config = config
        self.id = sandbox_id
        self.owner = owner
        self.scratch = scratch
        self.bundle_dir = bundle_dir
        self.lease_deadline: float | None = None
        self._on_close = on_close
        self._executors = executors
        self._own_executors: SandboxExecutors | None = None
        self._proc: ServerProcess | None = None
        self._client: SandboxTools | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._close_task: asyncio.Task[None] | None = None
        self._closed = False
        self._dead_reason: str | None = None
        self.pid: int | None = None
        self.pid_start: int | None = None
        self.started_at: float | None = None
        self.ready_s: float | None = None
        self.server_info: Any = None
        self.identity: SandboxIdentity = current_identity()
        self._closed_event = asyncio.Event()

    # ---- paths -------------------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return self.scratch / "run"

    @property
    def workspace(self) -> Path:
        """Host dir the ``local`` backend works in (and ``docker`` binds at ``config.workdir``); container
        backends keep their workdir inside the sandbox's own writable area."""
        return self.scratch / "ws"

    @property
    def home(self) -> Path:
        return self.scratch / "home"

    @property
    def socket_path(self) -> Path:
        return self.run_dir / SOCKET_NAME

    def area_path(self, inner: str) -> Path | None:
        """The host dir holding the sandbox's writable copy of ``inner`` (the workdir or one of
        ``writable``), where the backend keeps it on the host; None otherwise."""
        return None

    @property
    def log_path(self) -> Path:
        return self.scratch / "server.log"

    # ---- host services the sandbox may reach (the agent gateway) -------------------------------------
    def run_dir_inside(self) -> str:
        """Where :attr:`run_dir` appears inside the sandbox (the local backend: its host path)."""
        return INNER_RUN

    def workdir_inside(self) -> str:
        """The tool server's working dir as code inside the sandbox sees it (``config.workdir``; the
        local backend: its host workspace). Relative paths a policy gives are relative to it."""
        return str(getattr(self.config, "workdir", "/"))

    def listen_in_run_dir(self, name: str) -> tuple[socket.socket, str]:
        """A listening Unix socket ``run_dir/name`` for a host service that code in this sandbox may use,
        e.g. the agent gateway; returns it and its path inside the sandbox.

        Nothing else is reachable from inside, so this is the sandbox's only way out. The socket belongs
        to the sandbox's uid (mode 0600): the run dir is that uid's alone, so no other sandbox or local
        user can connect. It works on the read-only mount the run dir is inside, and after start."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name) or name == SOCKET_NAME:
            raise RaasError(f"invalid socket name {name!r}", kind="bad_request")
        if self._closed or not self.run_dir.is_dir():
            raise RaasError(f"sandbox {self.id} is not running", kind="sandbox_dead")
        path = self.run_dir / name
        if len(str(path)) > MAX_SOCKET_PATH:
            raise RaasError(f"socket path {path} is too long for AF_UNIX", kind="bad_request")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            sock.bind(str(path))
            os.chmod(path, 0o600)
            if self.identity.dedicated:
                os.chown(path, self.identity.uid, self.identity.gid)
            sock.listen(128)
        except OSError as e:
            sock.close()
            raise RaasError(f"cannot listen on {path}: {e}", kind="sandbox_start_failed") from e
        return sock, f"{self.run_dir_inside()}/{name}"

    # ---- backend hooks -----------------------------------------------------------------------------
    @abstractmethod
    def build_launch(self) -> LaunchSpec:
        """The host command for this sandbox (pure: no side effects, so it is unit-testable)."""

    def prepare(self) -> None:
        """Backend-specific preparation before launch (image conversion, extra dirs). Blocking."""
        return None

    def make_dirs(self) -> None:
        """The sandbox's private host dirs (fresh, owner-only; the run dir belongs to the sandbox's uid)."""
        ident = self.identity
        make_fresh_dir(self.scratch, 0o711 if ident.dedicated else 0o700)
        for d in self.sandbox_dirs():
            make_fresh_dir(d, 0o700)
            if ident.dedicated:
                os.chown(d, ident.uid, ident.gid)

    def sandbox_dirs(self) -> list[Path]:
        """Host dirs the sandbox itself writes to (created by :meth:`make_dirs`)."""
        return [self.run_dir]

    def server_args(self, socket: str, workdir: str) -> list[str]:
        """Arguments of the tool server (after ``raas_toolserver.boot ... --``)."""
        args = ["--socket", socket, "--workdir", workdir, "--watch-stdin"]
        if self.config.output_cap_bytes:
            args += ["--output-cap", str(self.config.output_cap_bytes)]
        args += ["--max-sessions", str(self.config.max_sessions)]
        return args

    def rlimit_args(self) -> list[str]:
        from raas.sandbox.limits import rlimit_args

        out = []
        for kv in rlimit_args(self.config.memory_mb, self.config.file_size_mb, self.config.max_procs):
            out += ["--rlimit", kv]
        return out

    def boot_command(self, python: str, boot_args: list[str], socket: str, workdir: str) -> list[str]:
        """``python -S -c BOOT_CODE <boot args> -- <server args>``.

        ``-S``: the server needs nothing from site-packages at start-up, and processing them (``.pth``
        files, venvs) costs about as much CPU as the rest of its start; the IPython tool loads them when
        first used (:mod:`raas_toolserver.pysite`). ``-c`` rather than ``-m``: runpy and what it imports
        cost another third; the boot step takes the working directory off ``sys.path`` either way."""
        server = self.server_args(socket, workdir)
        return [python, "-S", "-c", BOOT_CODE, *boot_args, "--", *server]

    # ---- state -------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None and not self._closed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tools(self) -> SandboxTools:
        """The tool client; raises ``sandbox_dead`` once the sandbox died or was closed."""
        if self._closed:
            raise RaasError(f"sandbox {self.id} is closed", kind="sandbox_dead")
        if self._dead_reason is not None:
            raise RaasError(f"sandbox {self.id} died: {self._dead_reason}", kind="sandbox_dead")
        if self._client is None:
            raise RaasError(f"sandbox {self.id} is not started", kind="sandbox_dead")
        return self._client

    def describe(self) -> dict[str, Any]:
        """The state-dir record: enough to find and reap this sandbox after a crash."""
        return {
            "id": self.id,
            "owner": self.owner,
            "backend": self.backend_name,
            "pid": self.pid,
            "pid_start": self.pid_start,
            "scratch": str(self.scratch),
            "created": self.started_at,
            "lease_deadline": self.lease_deadline,
        }

    # ---- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Launch and wait for the ready line; on any failure or cancel, clean up and re-raise."""
        self.started_at = time.time()
        t0 = time.perf_counter()
        try:
            if self.dedicated_identity:
                self.identity = await self._blocking("start", allocate_identity)
            self.make_dirs()
            if len(str(self.socket_path)) > MAX_SOCKET_PATH:
                raise RaasError(f"socket path {self.socket_path} is too long for AF_UNIX", kind="bad_request")
            await self._blocking("start", self.prepare)
            spec = self.build_launch()
            await self._spawn(spec)
            self._extra_cleanup = spec.extra_cleanup
            await self._wait_ready()
            self._client = await self._connect()
            self._watch_task = asyncio.create_task(self._watch(), name=f"watch-{self.id}")
            self.ready_s = time.perf_counter() - t0
        except BaseException:
            await self.close()
            raise

    async def _spawn(self, spec: LaunchSpec) -> None:
        env = dict(spec.env)
        env[procs.ENV_KEY] = self.id
        argv: list[str] = list(spec.argv)
        pass_fds: tuple[int, ...] = ()
        args_fd = -1
        if spec.args_via_fd:
            # The runtime reads its options (everything before "--") from a memfd: no process shows a
            # host path on its command line.
            end = argv.index("--")
            args_fd = os.memfd_create("raas-args", 0)
            os.write(args_fd, b"".join(a.encode() + b"\0" for a in argv[1:end]))
            os.lseek(args_fd, 0, os.SEEK_SET)
            argv, pass_fds = [argv[0], "--args", str(args_fd), *argv[end:]], (args_fd,)
        user: dict[str, Any] = {}
        if self.identity.dedicated:
            setpriv = setpriv_path()
            if setpriv is not None:
                # The same credentials as user=/group=/extra_groups= (real, effective and saved ids, no
                # supplementary groups, no capabilities left), but set by a small program after the exec:
                # Python then starts the child with vfork instead of fork, and the host process does not
                # copy its page tables and take copy-on-write faults on every start (~50 ms of CPU for a
                # service of 150 MB).
                ident = self.identity
                argv = [
                    setpriv,
                    f"--reuid={ident.uid}",
                    f"--regid={ident.gid}",
                    "--clear-groups",
                    "--",
                    *argv,
                ]
            else:
                user = {"user": self.identity.uid, "group": self.identity.gid, "extra_groups": []}
        try:
            log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                self._proc = await ServerProcess.spawn(
                    argv, env=env, cwd=spec.cwd, stderr=log, pass_fds=pass_fds, user=user
                )
            finally:
                os.close(log)
                if args_fd >= 0:
                    os.close(args_fd)
        except OSError as e:
            raise RaasError(f"cannot launch {spec.argv[0]}: {e}", kind="sandbox_start_failed") from e
        self.pid = self._proc.pid
        self.pid_start = procs.start_time(self._proc.pid)

    async def _wait_ready(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        stdout = self._proc.stdout

        async def read_until_ready() -> None:
            while True:
                try:
                    line = await stdout.readline()
                except ValueError:  # an over-long line of chatter before the ready line: skip it
                    continue
                if not line:
                    await self._proc.wait()  # type: ignore[union-attr]
                    raise RaasError(
                        f"{self.backend_name} sandbox exited (code {self._proc.returncode}) before ready: "  # type: ignore[union-attr]
                        f"{self._log_tail()}",
                        kind="sandbox_start_failed",
                    )
                if line.rstrip(b"\r\n") == READY_LINE:
                    return

        try:
            await asyncio.wait_for(read_until_ready(), self.config.start_timeout_s)
        except TimeoutError as e:
            raise RaasError(
                f"{self.backend_name} sandbox not ready after {self.config.start_timeout_s}s: {self._log_tail()}",
                kind="sandbox_start_failed",
            ) from e
        self._drain_task = asyncio.create_task(self._drain(), name=f"drain-{self.id}")

    async def _drain(self) -> None:
        """Keep reading stdout so a chatty server never blocks on a full pipe."""
        assert self._proc is not None and self._proc.stdout is not None
        with contextlib.suppress(Exception):
            while await self._proc.stdout.read(65536):
                pass

    async def _connect(self) -> SandboxTools:
        client = SandboxTools(
            str(self.socket_path),
            default_timeout=self.config.command_timeout_s,
            liveness_timeout_s=self.config.liveness_timeout_s,
        )
        try:
            await client.connect()
            self.server_info = await client.ping()
        except RaasError as e:
            await client.close()
            raise RaasError(
                f"cannot reach the tool server: {e.message}; {self._log_tail()}", kind="sandbox_start_failed"
            ) from e
        except BaseException:  # cancelled mid-handshake: the connection must not outlive us
            await asyncio.shield(client.close())
            raise
        return client

    async def _watch(self) -> None:
        """Notice a sandbox that dies on its own: tool calls then fail with ``sandbox_dead``."""
        assert self._proc is not None
        code = await self._proc.wait()
        if self._closed:
            return
        self._dead_reason = f"tool server exited with code {code}"
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
        # Whatever it left behind (bash sessions live in their own sessions) goes now.
        await self._blocking("close", procs.kill_by_env, self.id)

    def _log_tail(self, n: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-n:].decode(errors="replace").strip() or "(empty log)"

    async def close(self) -> None:
        """Kill the whole tree, remove dirs and socket. Idempotent; finishes even when cancelled."""
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    async def wait_exited(self) -> int | None:
        """Wait for the sandbox's main process to end (it died, or was closed); its exit code."""
        if self._proc is None:
            return None
        code = await self._proc.wait()
        if self._watch_task is not None and not self._closed:
            await asyncio.shield(self._watch_task)
        return code

    async def wait_closed(self) -> None:
        """Return once the sandbox is fully closed (by its owner, a lease expiry or the manager)."""
        await self._closed_event.wait()

    async def _close(self) -> None:
        self._closed = True
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.close()
        proc = self._proc
        if proc is not None:
            proc.close_stdin()
        if proc is not None and proc.returncode is None:
            procs.killpg_quietly(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 2.0)
            except TimeoutError:
                procs.killpg_quietly(proc.pid, signal.SIGKILL)
                procs.kill_quietly(proc.pid, signal.SIGKILL)
                await proc.wait()
        for task in (self._watch_task, self._drain_task):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if proc is not None:
            proc.close_pipes()
        try:
            await self._blocking("close", self._cleanup_sync)
        finally:
            own, self._own_executors = self._own_executors, None
            if own is not None:
                await own.aclose()
            self._notify_closed()  # on the loop thread: the manager's books are not thread-safe
            self._closed_event.set()

    async def _blocking(self, kind: Literal["start", "close"], fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn`` on this sandbox's ``start`` or ``close`` pool (never the loop's default one)."""
        executors = self._executors
        if executors is None or executors.closed:
            if self._own_executors is None:
                self._own_executors = SandboxExecutors(f"raas-{self.id}", 1, 1)
            executors = self._own_executors
        return await (executors.start if kind == "start" else executors.close).run(fn, *args)

    def kill_sync(self) -> None:
        """Synchronous last-resort close for atexit and signal handlers (no event loop needed)."""
        self._closed = True
        if self._proc is not None and self._proc.returncode is None:
            procs.killpg_quietly(self._proc.pid, signal.SIGKILL)
            procs.kill_quietly(self._proc.pid, signal.SIGKILL)
        self._cleanup_sync()
        self._notify_closed()

    def _cleanup_sync(self) -> None:
        procs.kill_by_env(self.id)
        self.identity.release()  # a dedicated uid: everything still running as it dies, then it is free
        for p in getattr(self, "_extra_cleanup", []):
            remove_tree(p)
        remove_tree(self.scratch)

    def _notify_closed(self) -> None:
        if self._on_close is not None:
            cb, self._on_close = self._on_close, None
            cb(self)


@functools.cache
def setpriv_path() -> str | None:
    """util-linux ``setpriv``, where installed (looked up once per process)."""
    return shutil.which("setpriv")


def remove_tree(path: Path) -> None:
    """rm -rf that also copes with unreadable or read-only dirs a sandbox created in its workspace."""
    if not (path.exists() or path.is_symlink()):
        return
    try:
        shutil.rmtree(path)
        return
    except OSError:
        pass
    # Give ourselves rwx on every directory (top-down, so locked ones become listable), then retry.
    stack = [str(path)]
    while stack:
        d = stack.pop()
        with contextlib.suppress(OSError):
            os.chmod(d, stat.S_IMODE(os.lstat(d).st_mode) | stat.S_IRWXU)
        with contextlib.suppress(OSError), os.scandir(d) as it:
            stack.extend(e.path for e in it if e.is_dir(follow_symlinks=False))
    shutil.rmtree(path, ignore_errors=True)


BACKENDS: dict[str, str] = {
    "local": "raas.sandbox.backends.local:LocalSandbox",
    "bwrap": "raas.sandbox.backends.bwrap:BwrapSandbox",
    "apptainer": "raas.sandbox.backends.apptainer:ApptainerSandbox",
    "singularity": "raas.sandbox.backends.apptainer:ApptainerSandbox",
    "docker": "raas.sandbox.backends.docker:DockerSandbox",
    "podman": "raas.sandbox.backends.docker:PodmanSandbox",
}


def backend_class(name: str) -> type[Sandbox]:
    """The Sandbox subclass for backend ``name`` (imported lazily)."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise RaasError(
            f"unknown sandbox backend {name!r}; known: {', '.join(BACKENDS)}", kind="bad_request"
        ) from None
    module, cls = target.split(":")
    backend: type[Sandbox] = getattr(importlib.import_module(module), cls)
    return backend
