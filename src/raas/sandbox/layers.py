"""Group-shared environments: INIT work that is the same for many jobs runs once, in the first job's
sandbox; the others start from a copy of what it left behind.

A GRPO group runs n samples of one instance, and each would repeat the same set-up in its own sandbox
(for SWE: the repository brought to the base commit, hidden tests removed). With a :class:`LayerStore`,
the first job of a key prepares a sandbox and **publishes** it: the dirs the sandbox populates from its
image (the workdir and ``writable``) become a host directory, the *layer*. A sandbox with
``root_writes="host"`` (a throwaway preparing sandbox) is stopped and its host area taken over (moved);
any other is read through its tool server as a tar stream and unpacked through a filter. Every job of that
key then starts its sandbox with ``SandboxConfig.seed``: the layer's dirs are bound read-only over the
image's, and the sandbox's boot step builds its private writable dirs from them instead of the image's:

* **no sharing of writes**: where the sandbox's root owns the layer (rootless: every sandbox runs as the
  service's user) the layer is the read-only lower layer of an overlayfs whose upper layer is in the
  sandbox's own capped writable area (nothing is copied; a write copies the file up first); as root, where
  every sandbox has a uid of its own that cannot own the layer (files of an unmapped owner cannot be
  copied up), the boot step copies the layer into the writable area, as it would the image's dirs. The
  layer is never bound writable and never hard-linked into a sandbox, so a write, delete or ``chmod`` in
  one sample cannot reach the layer or a sibling.
* **one preparation**: the first job of a key prepares; the others wait for it (an ``asyncio.Lock`` per
  key). If it fails, every job waiting for or arriving at that key fails with the same infrastructure
  error (``sandbox_start_failed``: filtered, never a reward). If the preparing job is cancelled or times
  out, the next waiting job prepares instead.
* **owned, bounded lifetime**: a layer is held by every claim and by every sandbox seeded from it until
  that sandbox closes (the seed stays bound, covered, under the sandbox's own copy: removing a bind
  mount's source directory on the host detaches every mount stacked on it, in every namespace, which
  would leave the sample looking at an empty, deleted directory). It is removed once nothing holds it and
  no job of its groups still waits for or runs INIT (the service answers that: :attr:`LayerStore.pending`),
  after ``idle_ttl_s`` without use, at ``max_age_s`` after it was built, when the store's ``max_bytes``
  budget needs the room (least recently used first), and when the store closes (service stop, after its
  sandboxes; interpreter exit). A store's directory carries its process id; a later store reaps the
  directories of dead processes.

Layer files belong to the service's own user, with group/other write and set-uid/set-gid bits removed;
as root, where every sandbox runs under a uid of its own, they are also made readable by others. So a
prepared file's group/other write bits (and, as root, an owner-only read mode) differ in the samples'
copies. Unpacked tar streams also lose devices, fifos and extended attributes; a moved host area keeps
what the preparing sandbox left there (it cannot create devices).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import secrets
import signal
import stat
import subprocess
import tarfile
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from raas.core.executors import Executor
from raas.core.reaping import reap_dead_owner_dirs
from raas.errors import RaasError
from raas.sandbox import procs
from raas.sandbox.base import Sandbox, remove_tree
from raas.sandbox.config import SandboxConfig, image_of, writable_of
from raas.sandbox.identity import kill_uid, make_private_dir

log = logging.getLogger(__name__)

_STORES: weakref.WeakSet[LayerStore] = weakref.WeakSet()
_ATEXIT = False


class LayerPolicy(BaseModel):
    """How long prepared layers may live and how much disk they may take (per service)."""

    enabled: bool = True
    idle_ttl_s: float = Field(300.0, gt=0, description="remove a layer no job used for this long")
    max_age_s: float = Field(3600.0, gt=0, description="remove a layer this long after it was built")
    max_bytes: int = Field(8 << 30, gt=0, description="all layers together; least recently used go first")
    sweep_interval_s: float = Field(10.0, gt=0)


def layer_key(handler_key: str, config: SandboxConfig) -> str:
    """The store key: the handler's key for its preparation plus what the layer is laid over (the image
    and the populated dirs), so a layer is never seeded into a sandbox of another image or layout."""
    parts = [handler_key, image_of(config), config.workdir, sorted(writable_of(config))]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


@dataclass
class _Entry:
    key: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    path: Path | None = None
    seed: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    error: RaasError | None = None
    size: int = 0
    built_at: float = 0.0
    used_at: float = field(default_factory=time.monotonic)
    holders: int = 0
    groups: set[str] = field(default_factory=set)
    users: set[str] = field(default_factory=set)
    """Jobs that claimed this entry (a job still before INIT that is not among them keeps it wanted)."""
    doomed: bool = False
    """Over the budget when built: removed as soon as nobody holds it."""

    @property
    def ready(self) -> bool:
        return self.path is not None


class Share:
    """One job's claim on a key, as :meth:`LayerStore.claim` yields it.

    ``seed`` is empty when this job must prepare (then :meth:`publish` after preparing), else the layer's
    dirs to pass as ``SandboxConfig.seed``, with ``meta`` what the preparing job published alongside."""

    def __init__(self, store: LayerStore | None, entry: _Entry | None, job_id: str) -> None:
        self._store = store
        self._entry = entry
        self.job_id = job_id
        self.seed: dict[str, str] = dict(entry.seed) if entry is not None and entry.ready else {}
        self.meta: dict[str, Any] = dict(entry.meta) if entry is not None and entry.ready else {}
        self.published = False
        self._lock_held = False

    def hold_while_open(self, sandbox: Sandbox) -> None:
        """Keep the layer until ``sandbox`` (started with this share's seed) is closed."""
        if self._store is not None and self._entry is not None and self.seed:
            self._store._hold_until_closed(self._entry, sandbox)

    @property
    def shared(self) -> bool:
        """True when this job starts from a layer another job prepared."""
        return bool(self.seed)

    @property
    def preparing(self) -> bool:
        """True when this job prepares (and should publish) the layer."""
        return self._entry is not None and not self.seed and not self.published

    async def publish(self, sandbox: Sandbox, meta: dict[str, Any] | None = None) -> None:
        """Capture ``sandbox``'s populated dirs (prepared, before the policy touched them) as the layer;
        from then on this share is :attr:`shared` too. A sandbox with ``root_writes="host"`` is stopped
        for the copy (close it afterwards); any other keeps running."""
        if self._store is None or self._entry is None or self.seed:
            return
        await self._store._publish(self._entry, sandbox, dict(meta or {}))
        self.published = True
        self.seed, self.meta = dict(self._entry.seed), dict(self._entry.meta)
        self._release_lock()  # the waiting jobs go ahead now, not when this job's block ends

    def _release_lock(self) -> None:
        if self._lock_held and self._entry is not None:
            self._lock_held = False
            self._entry.lock.release()


class LayerStore:
    """Prepared layers of one service, by key (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        policy: LayerPolicy | None = None,
        *,
        pending: Callable[[set[str], set[str]], bool] | None = None,
    ) -> None:
        self.policy = policy or LayerPolicy()
        self.pending = pending
        """``pending(groups, claimed)``: does a job of one of ``groups``, not among the ``claimed`` job ids,
        still wait for or run INIT? (The service's job table answers; None: never.)"""
        parent = make_private_dir(Path(root), 0o711 if os.geteuid() == 0 else 0o700)
        self._reap_dead(parent)
        self.dir = make_private_dir(parent / f"{os.getpid()}-{secrets.token_hex(4)}", 0o711)
        self._entries: dict[str, _Entry] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._watchers: set[asyncio.Task[None]] = set()
        self._closed = False
        self.stats = {"prepared": 0, "shared": 0, "failed": 0, "removed": 0}
        self._pool = Executor("raas-layers", 2)
        """Copies, unpacks, removals and sweeps: minutes for a large tree, so never on the loop's pool."""
        _STORES.add(self)
        _install_atexit()

    # -- claims --------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def claim(self, key: str, *, group: str, job_id: str) -> AsyncIterator[Share]:
        """Yield this job's :class:`Share` of ``key``: the ready layer, or the right to prepare it (the
        first job; later ones wait here until it is published or failed). Leaving the block releases the
        claim; leaving it while preparing, with an error, fails the key for every waiting job."""
        if self._closed:
            raise RaasError("the layer store is closed", kind="unavailable")
        self._ensure_sweeper()
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(key)
        entry.holders += 1
        entry.groups.add(group)
        entry.users.add(job_id)
        entry.used_at = time.monotonic()
        try:
            share = await self._take(entry, job_id)
            if share.seed:
                self.stats["shared"] += 1
                yield share
                return
            try:
                yield share
            except asyncio.CancelledError:
                raise  # the next waiting job prepares instead
            except BaseException as exc:
                if not share.published:
                    self._fail(entry, exc)
                raise
            finally:
                share._release_lock()
        finally:
            entry.holders -= 1
            entry.used_at = time.monotonic()
            self._maybe_remove(entry)

    async def _take(self, entry: _Entry, job_id: str) -> Share:
        """Wait for the layer (or the failure), or get the lock to prepare it."""
        while True:
            if entry.error is not None:
                raise entry.error
            if entry.ready:
                return Share(self, entry, job_id)
            await entry.lock.acquire()
            if entry.ready or entry.error is not None:
                entry.lock.release()
                continue
            share = Share(self, entry, job_id)
            share._lock_held = True  # until it publishes or its claim ends
            return share

    def _hold_until_closed(self, entry: _Entry, sandbox: Sandbox) -> None:
        entry.holders += 1

        async def watch() -> None:
            try:
                await sandbox.wait_closed()
            finally:
                entry.holders -= 1
                entry.used_at = time.monotonic()
                self._maybe_remove(entry)

        task = asyncio.get_running_loop().create_task(watch(), name=f"raas-layer-hold-{sandbox.id}")
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    def _fail(self, entry: _Entry, exc: BaseException) -> None:
        kind = getattr(exc, "kind", "internal")
        message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        entry.error = RaasError(
            f"preparing the environment this group shares failed ({kind}): {message}",
            kind="sandbox_start_failed",
            stage="init",
        )
        self.stats["failed"] += 1

    # -- publishing ----------------------------------------------------------------------------------

    async def _publish(self, entry: _Entry, sandbox: Sandbox, meta: dict[str, Any]) -> None:
        cfg = sandbox.config
        dirs = [cfg.workdir, *writable_of(cfg)]
        sources = [sandbox.area_path(d) for d in dirs]
        path = self.dir / secrets.token_hex(8)
        await self._pool.run(make_private_dir, path, 0o711)
        try:
            seed: dict[str, str] = {}
            size = 0
            if all(sources):
                await _stop(sandbox, self._pool)  # nothing may change the tree while it is copied
            for i, (inner, src) in enumerate(zip(dirs, sources, strict=True)):
                dest = path / f"d{i}"
                if src is not None and all(sources):
                    size += await self._pool.run(_take_tree, src, dest)
                else:
                    data = await sandbox.tools.download(inner)
                    size += await self._pool.run(_unpack, data, dest)
                seed[inner] = str(dest)
        except BaseException:
            await self._pool.run(remove_tree, path)
            raise
        if self._closed:
            await self._pool.run(remove_tree, path)
            raise RaasError("the layer store closed while a layer was being published", kind="unavailable")
        entry.path, entry.seed, entry.meta, entry.size = path, seed, meta, size
        entry.built_at = entry.used_at = time.monotonic()
        self.stats["prepared"] += 1
        self._enforce_budget(entry)

    # -- lifetime ------------------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self._entries.values() if e.ready)

    def keys(self) -> list[str]:
        return list(self._entries)

    def _enforce_budget(self, new: _Entry) -> None:
        idle = sorted(
            (e for e in self._entries.values() if e is not new and e.ready and e.holders == 0),
            key=lambda e: e.used_at,
        )
        while self.total_bytes > self.policy.max_bytes and idle:
            self._remove(idle.pop(0), "over the size budget")
        if self.total_bytes > self.policy.max_bytes:
            new.doomed = True

    def _wanted(self, entry: _Entry) -> bool:
        if self.pending is None:
            return False
        try:
            return self.pending(set(entry.groups), set(entry.users))
        except Exception:
            log.exception("layer store: the pending check failed; keeping the layer until its TTL")
            return True

    def _maybe_remove(self, entry: _Entry) -> None:
        if entry.holders > 0 or self._entries.get(entry.key) is not entry:
            return
        if not entry.ready and entry.error is None:
            self._remove(entry, "unused")  # nobody prepared it (cancelled): nothing to keep
        elif entry.doomed:
            self._remove(entry, "over the size budget")
        elif not self._wanted(entry):
            self._remove(entry, "every job of its groups has started")

    def _remove(self, entry: _Entry, why: str) -> None:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if entry.path is not None:
            log.debug("removing layer %s (%s)", entry.key, why)
            remove_tree(entry.path)
            entry.path = None
            self.stats["removed"] += 1

    def sweep(self) -> int:
        """Remove what outlived ``idle_ttl_s`` or ``max_age_s`` (nobody holding it); returns how many."""
        now = time.monotonic()
        doomed = [
            e
            for e in self._entries.values()
            if e.holders == 0
            and (
                now - e.used_at > self.policy.idle_ttl_s
                or (e.ready and now - e.built_at > self.policy.max_age_s)
                or (e.error is not None and not self._wanted(e))
            )
        ]
        for e in doomed:
            self._remove(e, "expired")
        return len(doomed)

    def _ensure_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop(), name="raas-layers")

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.policy.sweep_interval_s)
            try:
                await self._pool.run(self.sweep)
            except Exception:
                log.exception("layer sweep failed")

    async def close(self) -> None:
        """Remove every layer and the store's directory (service stop). Idempotent."""
        self._closed = True
        tasks = [t for t in (self._sweeper, *self._watchers) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._pool.run(self.close_sync)
        await self._pool.aclose()

    def close_sync(self) -> None:
        self._closed = True
        for entry in list(self._entries.values()):
            self._remove(entry, "store closed")
        remove_tree(self.dir)
        with contextlib.suppress(OSError):
            self.dir.parent.rmdir()

    @staticmethod
    def _reap_dead(parent: Path) -> None:
        """Directories of stores whose process is gone (killed before it could clean up)."""
        reap_dead_owner_dirs(parent.iterdir(), lambda d: d.name.split("-", 1)[0], remove=remove_tree)


def _install_atexit() -> None:
    global _ATEXIT
    if not _ATEXIT:
        _ATEXIT = True
        atexit.register(_close_all_stores)


def _close_all_stores() -> None:
    for store in list(_STORES):
        with contextlib.suppress(Exception):
            store.close_sync()
        store._pool.shutdown()


class _LayerFilter:
    """tarfile's ``tar`` filter (names inside the destination, no set-uid bits, no group/other write),
    plus: hard links only to members inside the destination, devices and fifos skipped, ownership not
    restored, the owner may read and write, and as root everyone may read. Symlinks are kept as they are (any target):
    nothing on the host follows them, and inside a sandbox they resolve in the sandbox's own tree."""

    def __init__(self, for_other_uids: bool) -> None:
        self.size = 0
        self.for_other_uids = for_other_uids

    def __call__(self, member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            return None
        out = tarfile.tar_filter(member, dest)
        if out.islnk():
            target = os.path.realpath(os.path.join(dest, out.linkname))
            if os.path.commonpath([target, os.path.realpath(dest)]) != os.path.realpath(dest):
                raise tarfile.LinkOutsideDestinationError(out, target)
        mode: int | None = None
        if not out.issym():
            mode = out.mode if out.mode is not None else 0o644
            mode |= 0o700 if out.isdir() else 0o600
            if self.for_other_uids:
                mode |= 0o555 if out.isdir() else 0o444
        self.size += out.size if out.isreg() else 0
        # None means "do not set" to tarfile (its own data filter does the same); the stubs say int/str.
        return out.replace(mode=mode, uid=None, gid=None, uname=None, gname=None, deep=False)  # type: ignore[arg-type]


async def _stop(sandbox: Sandbox, pool: Executor) -> None:
    """Kill every process of a sandbox whose host area is about to be copied (its dirs stay until it is
    closed): the kernel ends a PID namespace with its first process; stragglers go by id or by uid."""
    if sandbox.pid is not None:
        procs.killpg_quietly(sandbox.pid, signal.SIGKILL)
        procs.kill_quietly(sandbox.pid, signal.SIGKILL)
    await sandbox.wait_exited()
    await pool.run(procs.kill_by_env, sandbox.id)
    if sandbox.identity.dedicated:
        await pool.run(kill_uid, sandbox.identity.uid)


def _take_tree(src: Path, dest: Path) -> int:
    """Take over a stopped sandbox's host area dir as a layer dir: moved when it is on the same file
    system (nothing is copied; nothing of the sandbox runs any more, and it is closed right after), else
    copied with ``cp`` (modes, times and hard links kept, symlinks copied as links, no extended
    attributes). Then made ours (as root: the sandbox's uid goes back to the pool) with the layer's modes
    (see the module docstring). Returns the bytes of regular files."""
    run = functools.partial(subprocess.run, capture_output=True, text=True, check=False)
    try:
        os.rename(src, dest)
    except OSError:
        out = run(["cp", "-R", "-P", "--preserve=mode,timestamps,links", "--", f"{src}/.", str(dest)])
        if out.returncode != 0:
            raise RaasError(
                f"copying the prepared environment failed: {out.stderr[-500:]}", kind="internal"
            ) from None
    steps = [["chmod", "-R", "go-w,ug-s,u+rwX" + (",a+rX" if os.geteuid() == 0 else ""), "--", str(dest)]]
    if os.geteuid() == 0:  # links from the sandbox's area can only point inside it (link() is per mount)
        steps.insert(0, ["chown", "-R", "-P", "-h", f"{os.geteuid()}:{os.getegid()}", "--", str(dest)])
    for argv in steps:
        out = run(argv)
        if out.returncode != 0:
            raise RaasError(
                f"{argv[0]} on the prepared environment failed: {out.stderr[-500:]}", kind="internal"
            )
    size = 0
    for dirpath, _, files in os.walk(dest):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            size += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return size


def _unpack(data: bytes, dest: Path) -> int:
    """Unpack a tool-server tar stream into a fresh ``dest``; returns the bytes of regular files."""
    dest.mkdir(mode=0o755)
    os.chmod(dest, 0o755)
    filt = _LayerFilter(for_other_uids=os.geteuid() == 0)  # as root, sandboxes run under uids of their own
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(dest, filter=filt)
    return filt.size
