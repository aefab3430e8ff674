"""Run verifiers (math-verify, sympy, any CPU-bound check of an answer) in worker processes that can be killed.

Why: a verifier can hang on a pathological answer (sympy evaluating ``(10^7)!`` runs for minutes) and a
Python thread cannot be stopped: under ``wait_for`` the thread is abandoned, keeps a core busy, and holds
a slot of the small default executor that image conversion, sandbox closes and the ledger share. Here
each call runs in a worker process of a small pool, one call per worker at a time, under a hard timeout:
a worker that does not answer in time is SIGKILLed and reaped at once (the next call starts a fresh
one), and the caller gets ``RaasError(kind="verifier_timeout")``. The event loop only reads a pipe.

A verifier is any importable function ``"package.module:function"`` taking and returning JSON values.
Importing its module (math-verify pulls in sympy) happens once per worker, under ``start_timeout_s``,
not under the call's timeout. Workers die with their parent (``PR_SET_PDEATHSIG``, and EOF on stdin);
:func:`shutdown` (the service's hook) stops the running loop's pool, and an ``atexit`` hook kills
whatever a pool that was never closed still has.

Wire (JSON lines): the parent writes ``{"op": "import", "module": M}`` or ``{"op": "call", "target":
"M:F", "args": [...]}`` to the worker's stdin; the worker answers each with ``{"ok": true, "result": ...}``
or ``{"ok": false, "error": "Type: message", "traceback": "..."}`` on its original stdout, which it
keeps for itself (a verifier's prints go to stderr and cannot corrupt the stream).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import json
import os
import signal
import sys
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from raas.errors import RaasError

_ENV_PATH = "RAAS_VERIFY_SYS_PATH"
_ENV_PARENT = "RAAS_VERIFY_PARENT"
_ENV_MEMORY = "RAAS_VERIFY_MEMORY_MB"
_BOOTSTRAP = (
    "import json, os, sys; "
    f"sys.path[:] = json.loads(os.environ.pop({_ENV_PATH!r})); "
    "from raas.tasks.verify import worker_main; worker_main()"
)
_LINE_LIMIT = 16 * 1024 * 1024


def default_memory_mb() -> int:
    """``$RAAS_VERIFY_MEMORY_MB``, else 4096: the address-space limit of one worker, so an answer like
    ``2^{2^{40}}`` ends in a MemoryError inside the worker instead of the host's OOM killer."""
    return int(os.environ.get(_ENV_MEMORY) or 4096)


def default_size() -> int:
    """``$RAAS_VERIFY_WORKERS``, else the number of cores up to 4 (verification is CPU-bound)."""
    env = os.environ.get("RAAS_VERIFY_WORKERS")
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


class _Worker:
    """One worker process and the modules it has imported."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.loaded: set[str] = set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def exchange(self, request: dict[str, Any], timeout_s: float, what: str) -> dict[str, Any]:
        """Send one request and read its answer within ``timeout_s``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            await self.proc.stdin.drain()
        except (ConnectionError, OSError) as exc:
            raise RaasError(f"verifier worker {self.pid} is gone: {exc}", kind="handler_error") from None
        try:
            async with asyncio.timeout(timeout_s):
                line = await self.proc.stdout.readline()
        except TimeoutError:
            raise RaasError(f"{what} did not finish within {timeout_s:g}s", kind="verifier_timeout") from None
        if not line:
            code = await self.proc.wait()
            raise RaasError(
                f"verifier worker {self.pid} died during {what} (exit {code})", kind="handler_error"
            )
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise RaasError(f"verifier worker {self.pid} answered {line[:200]!r}", kind="internal")
        return answer

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


class VerifierPool:
    """At most ``size`` worker processes, started on demand and reused; see the module docstring."""

    def __init__(
        self, size: int | None = None, *, start_timeout_s: float = 60.0, memory_mb: int | None = None
    ) -> None:
        self.size = size or default_size()
        self.start_timeout_s = start_timeout_s
        self.memory_mb = default_memory_mb() if memory_mb is None else memory_mb
        self._idle: list[_Worker] = []
        self._workers: set[_Worker] = set()
        self._slots: asyncio.Semaphore | None = None
        self._closed = False
        _LIVE.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def pids(self) -> list[int]:
        """Worker processes alive now (idle or busy)."""
        return sorted(w.pid for w in self._workers if w.proc.returncode is None)

    async def call(self, target: str, *args: Any, timeout_s: float) -> Any:
        """``target(*args)`` in a worker; ``verifier_timeout`` when it runs past ``timeout_s`` (the worker
        is then killed and reaped before this returns), ``handler_error`` when it raises or crashes."""
        module, _, func = target.partition(":")
        if not module or not func:
            raise RaasError(f"verifier target must be 'module:function', got {target!r}", kind="internal")
        if self._closed:
            raise RaasError("the verifier pool is closed", kind="unavailable")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.size)
        async with self._slots:
            worker = self._take_idle() or await self._spawn()
            reusable = False
            try:
                if module not in worker.loaded:
                    loaded = await worker.exchange(
                        {"op": "import", "module": module}, self.start_timeout_s, f"importing {module}"
                    )
                    _raise_remote(loaded, f"importing {module}")
                    worker.loaded.add(module)
                answer = await worker.exchange(
                    {"op": "call", "target": target, "args": list(args)}, timeout_s, f"verifier {target}"
                )
                reusable = True
                _raise_remote(answer, f"verifier {target}")
                return answer.get("result")
            finally:
                if reusable and not self._closed:
                    self._idle.append(worker)
                else:
                    await self._discard(worker)

    def _take_idle(self) -> _Worker | None:
        """A live idle worker; one that died while idle (killed from outside) is dropped."""
        while self._idle:
            worker = self._idle.pop()
            if worker.proc.returncode is None:
                return worker
            worker.kill()
            self._workers.discard(worker)
        return None

    async def _spawn(self) -> _Worker:
        env = dict(os.environ)
        env[_ENV_PATH] = json.dumps(sys.path)
        env[_ENV_PARENT] = str(os.getpid())
        env[_ENV_MEMORY] = str(self.memory_mb)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _BOOTSTRAP,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # a terminal's Ctrl-C is the service's to handle, not the workers'
            limit=_LINE_LIMIT,
        )
        worker = _Worker(proc)
        self._workers.add(worker)
        return worker

    async def _discard(self, worker: _Worker) -> None:
        """Kill and reap one worker (even when the caller is being cancelled)."""
        worker.kill()
        self._workers.discard(worker)
        # Shielded: a cancelled caller still leaves the killed worker to asyncio's child watcher to reap.
        await asyncio.shield(worker.proc.wait())

    async def aclose(self) -> None:
        """Kill every worker and wait until each is reaped; later calls raise ``unavailable``."""
        self._closed = True
        workers = list(self._workers)
        self._idle.clear()
        for w in workers:
            w.kill()
        for w in workers:
            with contextlib.suppress(Exception):
                await w.proc.wait()
        self._workers.clear()
        _LIVE.discard(self)

    def kill_all(self) -> None:
        """Synchronous last resort (interpreter exit): SIGKILL every worker still running."""
        self._closed = True
        for w in list(self._workers):
            if w.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(w.pid, signal.SIGKILL)


def _raise_remote(answer: dict[str, Any], what: str) -> None:
    if not answer.get("ok"):
        message = f"{what} failed: {answer.get('error', 'unknown error')}"
        raise RaasError(message, kind="handler_error")


_LIVE: weakref.WeakSet[VerifierPool] = weakref.WeakSet()
_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, VerifierPool] = weakref.WeakKeyDictionary()


def default_pool() -> VerifierPool:
    """The running event loop's shared pool (created on first use)."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None or pool.closed:
        pool = _POOLS[loop] = VerifierPool()
    return pool


async def verify_call(target: str, *args: Any, timeout_s: float) -> Any:
    """``default_pool().call(...)``: what task handlers use."""
    return await default_pool().call(target, *args, timeout_s=timeout_s)


async def shutdown() -> None:
    """Stop the running loop's pool, reaping its workers (a service calls this when it shuts down)."""
    pool = _POOLS.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        await pool.aclose()


@atexit.register
def _kill_leftovers() -> None:
    for pool in list(_LIVE):
        pool.kill_all()


# -- inside the worker process ---------------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this worker when the process that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent and os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def worker_main() -> None:
    """Serve requests from stdin until EOF (the parent closed the pipe or died)."""
    _die_with_parent(int(os.environ.pop(_ENV_PARENT, "0")))
    memory_mb = int(os.environ.pop(_ENV_MEMORY, "0"))
    if memory_mb > 0:
        import resource

        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # the verifier's own prints go to stderr
    functions: dict[str, Callable[..., Any]] = {}
    for raw in sys.stdin.buffer:
        try:
            request = json.loads(raw)
            if request.get("op") == "import":
                importlib.import_module(str(request["module"]))
                answer: dict[str, Any] = {"ok": True}
            else:
                target = str(request["target"])
                fn = functions.get(target)
                if fn is None:
                    module, _, name = target.partition(":")
                    fn = functions[target] = getattr(importlib.import_module(module), name)
                answer = {"ok": True, "result": fn(*request.get("args", []))}
            line = json.dumps(answer)
        except Exception as exc:
            line = json.dumps(
                {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            )
        proto.write(line.encode() + b"\n")
