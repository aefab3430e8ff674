"""The sandbox manager: who owns which sandbox, for how long, and cleaning up after crashes.

State lives in one directory: ``records/<id>.json`` per live sandbox (written *before* anything is
started, so a crash at any point leaves a trace), the tool-server bundle, and — when the path is short
enough for AF_UNIX sockets — the sandboxes' scratch dirs. A manager started on the same state dir
after a crash reaps what the dead run left: only processes proven to be its own (pid + start time +
``RAAS_SANDBOX_ID`` in ``/proc/PID/environ``), never by name. (A sandbox claimed from a warm pool keeps
the record it was pooled with, owner ``raas-pool``: records exist for reaping, and a claim does no I/O.)

Sandboxes are also closed at interpreter exit (atexit) and, for programs that ask for it
(:func:`install_signal_handlers`), on SIGTERM/SIGHUP; bwrap sandboxes additionally die with the host
process (``--die-with-parent``), local ones through ``setpriv --pdeathsig``, and every tool server exits
when the pipe from its host process closes.

Directories: every directory raas creates is checked to be its own and private (another local user must
not be able to plant or swap one). When raas runs as root, sandboxes run under uids of their own, which
must be able to reach the tool-server bundle and their run dirs: those then live in a world-traversable
(but not listable) scratch root instead of root's private home.
"""

from __future__ import annotations

import asyncio
import atexit
import builtins
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from types import FrameType
from typing import Any

from raas.core.reaping import reap_dead_owner_dirs
from raas.errors import RaasError
from raas.sandbox import procs
from raas.sandbox.base import (
    MAX_SOCKET_PATH,
    Sandbox,
    SandboxConfig,
    backend_class,
    remove_tree,
)
from raas.sandbox.executors import SandboxExecutors
from raas.sandbox.identity import make_private_dir, traversable_by_others
from raas.sandbox.pool import WarmPools

log = logging.getLogger(__name__)

# Budget: <root>/sb-<12 hex>/run/tool.sock, and ~45 bytes of sockets a sandbox makes in its home.
SCRATCH_ROOT_MAX = MAX_SOCKET_PATH - 16 - 45
_MANAGERS: weakref.WeakSet[SandboxManager] = weakref.WeakSet()
_ATEXIT_INSTALLED = False


# Bundles built by this process: bundles dir -> (bundle, digest). Shared by its managers, checked per use.
_BUNDLES: dict[Path, tuple[Path, dict[str, str]]] = {}
_BUNDLES_LOCK = threading.Lock()


def reap_stale_bundles(bundles_dir: Path) -> list[Path]:
    """Remove bundles whose building process is gone (it was killed before it could clean up)."""
    from raas.toolserver.bundle import BUNDLE_GLOB, bundle_owner_pid

    return reap_dead_owner_dirs(bundles_dir.glob(BUNDLE_GLOB), bundle_owner_pid)


def _checked_bundle(bundles_dir: Path) -> Path:
    from raas.toolserver.bundle import build_bundle, verify_bundle

    with _BUNDLES_LOCK:
        known = _BUNDLES.get(bundles_dir)
        if known is not None:
            if verify_bundle(*known):
                return known[0]
            log.error("tool-server bundle %s changed on disk; building a fresh one", known[0])
            remove_tree(known[0])
        make_private_dir(bundles_dir, 0o755)
        reap_stale_bundles(bundles_dir)
        bundle, digest = build_bundle(bundles_dir)
        _BUNDLES[bundles_dir] = (bundle, digest)
        return bundle


def _remove_own_bundles() -> None:
    with _BUNDLES_LOCK:
        for bundle, _ in _BUNDLES.values():
            remove_tree(bundle)
        _BUNDLES.clear()


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(6)


def _atexit_close_all() -> None:
    for m in list(_MANAGERS):
        m.close_all_sync()
    _remove_own_bundles()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _atexit_close_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_atexit() -> None:
    global _ATEXIT_INSTALLED
    if not _ATEXIT_INSTALLED:
        _ATEXIT_INSTALLED = True
        atexit.register(_atexit_close_all)


def install_signal_handlers() -> None:
    """For programs without handlers of their own: close every manager's sandboxes on SIGTERM/SIGHUP
    (then die of the signal as usual). Library code never installs signal handlers by itself."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("signal handlers can only be installed from the main thread")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _on_signal)


class SandboxManager:
    """Starts sandboxes for owners, tracks leases, closes them, and reaps a crashed run's leftovers."""

    def __init__(
        self,
        state_dir: str | Path,
        *,
        scratch_root: str | Path | None = None,
        default_lease_s: float | None = None,
    ) -> None:
        self.state_dir = Path(state_dir).absolute()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.records_dir = make_private_dir(self.state_dir / "records", 0o700)
        self.scratch_root = Path(scratch_root).absolute() if scratch_root else self._default_scratch()
        self.scratch_root.parent.mkdir(parents=True, exist_ok=True)
        make_private_dir(self.scratch_root, 0o711 if os.geteuid() == 0 else 0o700)
        self.default_lease_s = default_lease_s
        self._pid = os.getpid()
        self._pid_start = procs.start_time(self._pid)
        self._live: dict[str, Sandbox] = {}
        self.started_ids: list[str] = []  # every id this manager ever used (leak checks, audits)
        self._lease_timers: dict[str, asyncio.TimerHandle] = {}
        self._bundle_lock = asyncio.Lock()
        self._expiring: set[asyncio.Task[None]] = set()
        self.pools = WarmPools(self)
        """Warm pools of pre-started sandboxes (none until :meth:`WarmPools.configure` asks for some)."""
        self.executors = SandboxExecutors()  # shut down (and replaced) by close_all once no sandbox is left
        _MANAGERS.add(self)
        _install_atexit()

    # ---- paths -------------------------------------------------------------------------------------
    def _default_scratch(self) -> Path:
        """``<state>/sb`` when short (and, as root, reachable by the sandboxes' uids), else a short dir in
        /var/tmp (disk-backed; /tmp may be RAM) named after the state dir, so a restart finds it again.

        AF_UNIX paths are limited to 107 bytes and a local sandbox's own programs (an IPython kernel's
        ``ipc://`` sockets under its temp dir) need room below the scratch dir too.
        """
        here = self.state_dir / "sb"
        root = os.geteuid() == 0
        if len(str(here)) <= SCRATCH_ROOT_MAX and (not root or traversable_by_others(self.state_dir)):
            return here
        tag = hashlib.sha256(str(self.state_dir).encode()).hexdigest()[:10]
        base = Path("/var/tmp") if Path("/var/tmp").is_dir() else Path(tempfile.gettempdir())
        return base / f"raas-{os.geteuid()}-{tag}"

    def _record_path(self, sandbox_id: str) -> Path:
        return self.records_dir / f"{sandbox_id}.json"

    def _write_record(self, sb: Sandbox) -> None:
        data = sb.describe()
        data["manager"] = {"pid": self._pid, "start": self._pid_start}
        path = self._record_path(sb.id)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    def _forget(self, sb: Sandbox) -> None:
        """Called by a sandbox when it finished closing."""
        self._live.pop(sb.id, None)
        timer = self._lease_timers.pop(sb.id, None)
        if timer is not None:
            timer.cancel()
        with contextlib.suppress(FileNotFoundError):
            self._record_path(sb.id).unlink()

    # ---- the bundle ----------------------------------------------------------------------------------
    @property
    def bundles_dir(self) -> Path:
        """Where tool-server bundles live: beside the scratch dirs, so sandbox uids can reach them."""
        return self.scratch_root / "bundles"

    def current_bundle(self) -> Path | None:
        """The bundle this process last built and checked for this manager (None before the first)."""
        with _BUNDLES_LOCK:
            known = _BUNDLES.get(self.bundles_dir)
        return None if known is None else known[0]

    async def bundle_dir(self) -> Path:
        """The tool-server bundle, bound read-only into every sandbox. Its digest is checked every time
        it is handed out; a bundle that changed on disk is thrown away and a fresh one built."""
        async with self._bundle_lock:
            return await self.executors.start.run(_checked_bundle, self.bundles_dir)

    # ---- starting ------------------------------------------------------------------------------------
    async def start(self, config: SandboxConfig, *, owner: str, lease_s: float | None = None) -> Sandbox:
        """Start a sandbox and wait until its tool server answers; the caller closes it.

        With a warm pool for ``config`` (see :mod:`raas.sandbox.pool`), a ready, never-used sandbox from
        it is handed over instead when there is one."""
        if self.pools.active:
            sb = self.pools.claim(config, owner)
            if sb is not None:
                lease = lease_s if lease_s is not None else self.default_lease_s
                if lease is not None:
                    self._arm_lease(sb, lease)
                    self._write_record(sb)  # the deadline; the record itself exists since before launch
                return sb
        return await self.start_cold(config, owner=owner, lease_s=lease_s)

    async def start_cold(
        self, config: SandboxConfig, *, owner: str, lease_s: float | None = None, leased: bool = True
    ) -> Sandbox:
        """Start a fresh sandbox (never from a pool). ``leased=False``: no lease, not even the default one
        (a pooled sandbox's lease starts when it is claimed)."""
        cls = backend_class(config.backend)
        bundle = await self.bundle_dir()
        sid = new_sandbox_id()
        sb = cls(
            config,
            sandbox_id=sid,
            owner=owner,
            scratch=self.scratch_root / sid,
            bundle_dir=bundle,
            on_close=self._forget,
            executors=self.executors,
        )
        lease = (lease_s if lease_s is not None else self.default_lease_s) if leased else None
        if lease is not None:
            sb.lease_deadline = time.time() + lease
        self._live[sid] = sb
        self.started_ids.append(sid)
        self._write_record(sb)  # before any process exists: a crash from here on is reapable
        try:
            await sb.start()
        except BaseException:
            await sb.close()
            raise
        self._write_record(sb)  # now with the pid
        if lease is not None:
            self._arm_lease(sb, lease)
        return sb

    @contextlib.asynccontextmanager
    async def sandbox(
        self, config: SandboxConfig, *, owner: str, lease_s: float | None = None
    ) -> AsyncIterator[Sandbox]:
        """``async with``: the sandbox is closed on success, error, timeout and cancellation."""
        sb = await self.start(config, owner=owner, lease_s=lease_s)
        try:
            yield sb
        finally:
            await sb.close()

    # ---- leases --------------------------------------------------------------------------------------
    def _arm_lease(self, sb: Sandbox, lease_s: float) -> None:
        old = self._lease_timers.pop(sb.id, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        sb.lease_deadline = time.time() + lease_s  # wall clock: it is written to the record

        def expire() -> None:
            self._lease_timers.pop(sb.id, None)
            if not sb.closed:
                log.warning("sandbox %s (owner %s) lease expired; closing it", sb.id, sb.owner)
                task = loop.create_task(sb.close())
                self._expiring.add(task)
                task.add_done_callback(self._expiring.discard)

        self._lease_timers[sb.id] = loop.call_later(lease_s, expire)

    def renew(self, sb: Sandbox, lease_s: float) -> None:
        """Extend a sandbox's lease to ``lease_s`` seconds from now."""
        if sb.closed:
            raise RaasError(f"sandbox {sb.id} is closed", kind="sandbox_dead")
        self._arm_lease(sb, lease_s)
        self._write_record(sb)

    # ---- closing -------------------------------------------------------------------------------------
    def list(self, owner: str | None = None) -> list[Sandbox]:
        return [s for s in self._live.values() if owner is None or s.owner == owner]

    async def close_owner(self, owner: str) -> int:
        """Close every sandbox ``owner`` still holds (a job's safety net); returns how many."""
        doomed = self.list(owner)
        await asyncio.shield(asyncio.gather(*(s.close() for s in doomed), return_exceptions=True))
        return len(doomed)

    async def close_all(self) -> None:
        await self.pools.stop()  # first: no refill may start a sandbox behind our back
        doomed = list(self._live.values())
        await asyncio.shield(asyncio.gather(*(s.close() for s in doomed), return_exceptions=True))
        self._release_scratch_root()
        if not self._live:
            # Fresh executors start no thread until used: the manager stays usable after close_all.
            executors, self.executors = self.executors, SandboxExecutors()
            await executors.aclose()

    def close_all_sync(self) -> None:
        """No event loop needed: for atexit and signal handlers."""
        for sb in list(self._live.values()):
            with contextlib.suppress(Exception):
                sb.kill_sync()
        self._release_scratch_root()
        self.executors.shutdown()

    def _release_scratch_root(self) -> None:
        """A scratch root outside the state dir (the short /var/tmp one) goes once no sandbox is left."""
        if self._live or self.scratch_root.is_relative_to(self.state_dir):
            return
        if self.bundles_dir.is_dir():
            reap_stale_bundles(self.bundles_dir)
        if any(m is not self and m.scratch_root == self.scratch_root and m._live for m in list(_MANAGERS)):
            return
        with _BUNDLES_LOCK:
            known = _BUNDLES.pop(self.bundles_dir, None)
        if known is not None:
            remove_tree(known[0])
        for d in (self.bundles_dir, self.scratch_root):
            with contextlib.suppress(OSError):
                d.rmdir()

    # ---- reaping -------------------------------------------------------------------------------------
    async def reap_stale(self) -> builtins.list[str]:
        """Reap sandboxes that a dead previous run of this state dir left behind; returns their ids."""
        return await self.executors.start.run(self._reap_stale_sync)

    def _record_is_live_elsewhere(self, rec: dict[str, Any]) -> bool:
        mgr = rec.get("manager") or {}
        pid, start = mgr.get("pid"), mgr.get("start")
        if not isinstance(pid, int):
            return False
        if pid == self._pid and start == self._pid_start:
            return True  # ours
        return procs.is_same_process(pid, start)

    def _reap_stale_sync(self) -> builtins.list[str]:
        reaped: builtins.list[str] = []
        lock_fd = os.open(self.state_dir / ".reap.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            for path in sorted(self.records_dir.glob("sb-*.json")):
                try:
                    rec = json.loads(path.read_text())
                except (OSError, ValueError):
                    rec = {"id": path.stem}
                sid = str(rec.get("id", path.stem))
                if sid != path.stem or self._record_is_live_elsewhere(rec):
                    continue
                pid, start = rec.get("pid"), rec.get("pid_start")
                if isinstance(pid, int) and procs.is_same_process(pid, start, sid):
                    procs.killpg_quietly(pid)
                    procs.kill_quietly(pid)
                procs.kill_by_env(sid)
                scratch = Path(str(rec.get("scratch", "")))
                # Only ever delete dirs named after the sandbox inside a scratch root we use.
                if scratch.name == sid and scratch.parent == self.scratch_root:
                    remove_tree(scratch)
                path.unlink(missing_ok=True)
                reaped.append(sid)
            # Scratch dirs without a record (lost between mkdir and the first record write).
            live = set(self._live)
            for d in self.scratch_root.glob("sb-*"):
                if d.name not in live and not self._record_path(d.name).exists():
                    procs.kill_by_env(d.name)
                    remove_tree(d)
                    reaped.append(d.name)
        finally:
            os.close(lock_fd)
        if reaped:
            log.warning("reaped %d stale sandboxes from %s", len(reaped), self.state_dir)
        return reaped
