"""Warm pools: sandboxes started ahead of demand, so a job's INIT claims a ready one in microseconds.

One pool per sandbox config (backend, image and every other setting: a pooled sandbox is exactly what a
cold start of that config would give). A pooled sandbox is *never used* before its claim: nothing runs in
it but its idle tool server, it has its own fresh private dirs and (as root) its own uid, like any other.
A claim hands it to exactly one owner and takes it out of the pool for good; its owner closes it (the
manager's usual lifetimes), so no sandbox ever serves two jobs.

Sizes follow demand: a pool's target is the number of sandboxes asked of it over the last ``window_s``
(a trainer's batch, say), plus the INIT backlog while demand lasts, within ``min_size`` and ``max_size``,
and every pool together stays under ``memory_budget_mb`` (``sandbox_mb`` per idle sandbox, the measured
PSS). A background task per pool starts the missing ones (``refill_concurrency`` at a time) and closes
idle ones beyond the target once they sat unused for ``keep_idle_s``.

Liveness: a pooled sandbox whose process exits is discarded (and replaced) as soon as the event loop
sees it; a claim also checks, without awaiting anything, that the launcher has not exited (``waitid``
with ``WNOWAIT``) and that the tool server has not hung up its end of the connection (``poll``), so a
sandbox that died a moment ago is never handed out, even before the loop noticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from raas.sandbox.base import Sandbox
from raas.sandbox.config import SandboxConfig, image_of

if TYPE_CHECKING:
    from raas.sandbox.manager import SandboxManager

log = logging.getLogger(__name__)

POOL_OWNER = "raas-pool"
_HUNG_UP = (
    select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP | select.POLLNVAL | select.POLLRDHUP
)
_TICK_S = 1.0  # how often a pool re-reads its target when nothing wakes it (demand decays with time)


class PoolSettings(BaseModel):
    """How warm pools size themselves (``ServiceConfig.warm_pool``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        True,
        description="Keep warm pools for the service's sandbox configs (they fill only once jobs ask)",
    )
    min_size: int = Field(0, ge=0, description="Idle sandboxes a pool keeps even without demand")
    max_size: int = Field(32, ge=0, description="Most sandboxes one pool holds (idle + starting)")
    memory_budget_mb: float = Field(1024.0, ge=0, description="All pools together, at sandbox_mb each")
    sandbox_mb: float = Field(16.0, gt=0, description="Memory one idle sandbox costs (its PSS)")
    window_s: float = Field(
        60.0, gt=0, description="A pool holds as many sandboxes as were asked of it over this many seconds"
    )
    refill_concurrency: int = Field(2, ge=1, le=256, description="Starts one pool runs at once")
    keep_idle_s: float = Field(300.0, ge=0, description="Idle sandboxes over target close after this")
    configs: list[dict[str, Any]] = Field(
        default_factory=list,
        description="More pooled configs besides the service's default sandbox: SandboxConfig fields "
        "overriding it (e.g. another image)",
    )

    @property
    def budget_slots(self) -> int:
        """Sandboxes all pools together may hold within the memory budget."""
        return int(self.memory_budget_mb // self.sandbox_mb)


@dataclass
class PoolStats:
    claims: int = 0
    misses: int = 0
    refills: int = 0
    refill_failures: int = 0
    discarded: int = 0
    """Pooled sandboxes that died while idle or failed the claim-time check (never handed out)."""
    trimmed: int = 0


@dataclass
class _Idle:
    sandbox: Sandbox
    since: float
    watcher: asyncio.Task[Any] | None = None


def config_key(config: SandboxConfig) -> str:
    return config.model_dump_json()


def looks_alive(sb: Sandbox) -> bool:
    """Cheap and synchronous: the sandbox is open, its launcher has not exited, and its tool server still
    holds its end of our connection. Errs on the side of "dead" (a discarded sandbox costs one start)."""
    try:
        client = sb.tools  # raises once the sandbox died (as far as the loop saw) or was closed
    except Exception:
        return False
    if not sb.alive or sb.pid is None or not client.connected or client.dead is not None:
        return False
    try:
        if os.waitid(os.P_PID, sb.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return False  # exited: a zombie nobody reaped yet
    except ChildProcessError:
        return False  # already reaped
    fd = client.socket_fileno()
    if fd is None:
        return False
    poller = select.poll()
    poller.register(fd, _HUNG_UP)
    # A never-used tool server sends nothing: any event (data, hang-up, error) means something is off.
    return not poller.poll(0)


@dataclass
class WarmPool:
    """The pool of one sandbox config."""

    config: SandboxConfig
    key: str
    idle: deque[_Idle] = field(default_factory=deque)
    starting: set[asyncio.Task[None]] = field(default_factory=set)
    demand: deque[float] = field(default_factory=deque)
    stats: PoolStats = field(default_factory=PoolStats)
    target: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    loop_task: asyncio.Task[None] | None = None
    retry_at: float = 0.0
    backoff_s: float = 0.0
    dropped: bool = False

    @property
    def label(self) -> str:
        image = image_of(self.config) or "-"
        return f"{self.config.backend}:{image}#{self.key_hash}"

    @property
    def key_hash(self) -> str:
        import hashlib

        return hashlib.sha256(self.key.encode()).hexdigest()[:8]

    def size(self) -> int:
        return len(self.idle) + len(self.starting)


class WarmPools:
    """The warm pools of one :class:`~raas.sandbox.manager.SandboxManager` (``manager.pools``)."""

    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager
        self.settings = PoolSettings()
        self.backlog: Callable[[], int] = lambda: 0
        self._pools: dict[str, WarmPool] = {}
        self._keys: dict[int, tuple[SandboxConfig, str]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def active(self) -> bool:
        return bool(self._pools)

    # -- configuration -----------------------------------------------------------------------------------

    def configure(
        self,
        settings: PoolSettings,
        configs: list[SandboxConfig],
        *,
        backlog: Callable[[], int] | None = None,
    ) -> None:
        """Keep pools for ``configs`` (none when ``settings.enabled`` is false): new ones start filling as
        demand appears (or to ``min_size`` at once), pools no longer wanted are dropped and their idle
        sandboxes closed."""
        self.settings = settings
        if backlog is not None:
            self.backlog = backlog
        wanted = {config_key(c): c for c in configs} if settings.enabled else {}
        for key in list(self._pools):
            if key not in wanted:
                self._drop(self._pools.pop(key))
        for key, config in wanted.items():
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = WarmPool(config=config, key=key)
                pool.loop_task = asyncio.get_running_loop().create_task(
                    self._refill_loop(pool), name=f"raas-pool-{pool.key_hash}"
                )
            pool.wake.set()
        self._keys.clear()

    async def stop(self) -> None:
        """Drop every pool and wait until each of its sandboxes is closed (service stop)."""
        for key in list(self._pools):
            self._drop(self._pools.pop(key))
        self._keys.clear()
        while self._closing:
            await asyncio.gather(*list(self._closing), return_exceptions=True)

    def _drop(self, pool: WarmPool) -> None:
        pool.dropped = True
        if pool.loop_task is not None:
            pool.loop_task.cancel()
            self._track(_await_quietly(pool.loop_task))
        for task in list(pool.starting):  # a cancelled start closes its half-started sandbox itself
            task.cancel()
            self._track(_await_quietly(task))
        while pool.idle:
            self._discard(pool.idle.popleft())

    # -- claiming ----------------------------------------------------------------------------------------

    def _pool_for(self, config: SandboxConfig) -> WarmPool | None:
        known = self._keys.get(id(config))
        if known is None or known[0] is not config:
            if len(self._keys) > 256:
                self._keys.clear()
            known = (config, config_key(config))
            self._keys[id(config)] = known  # holds the config: its id cannot be reused meanwhile
        return self._pools.get(known[1])

    def claim(self, config: SandboxConfig, owner: str) -> Sandbox | None:
        """A pooled sandbox of ``config`` for ``owner``, or None (no pool, or none ready). Synchronous:
        between the check and the hand-over nothing else runs, so no sandbox is ever claimed twice."""
        pool = self._pool_for(config)
        if pool is None:
            return None
        now = time.monotonic()
        pool.demand.append(now)
        pool.wake.set()
        while pool.idle:
            entry = pool.idle.pop()  # the most recently started: the oldest ones are trimmed first
            if entry.watcher is not None:
                entry.watcher.cancel()
            if not looks_alive(entry.sandbox) or not self._current_bundle(entry.sandbox):
                pool.stats.discarded += 1
                self._discard(entry)
                continue
            entry.sandbox.owner = owner
            pool.stats.claims += 1
            return entry.sandbox
        pool.stats.misses += 1
        return None

    def _current_bundle(self, sb: Sandbox) -> bool:
        current = self.manager.current_bundle()
        return current is not None and sb.bundle_dir == current

    # -- sizing and refilling ----------------------------------------------------------------------------

    def target_of(self, pool: WarmPool, now: float) -> int:
        s = self.settings
        while pool.demand and pool.demand[0] < now - s.window_s:
            pool.demand.popleft()
        want = len(pool.demand) + max(0, self.backlog()) if pool.demand else 0
        return max(s.min_size, min(want, s.max_size))

    def _room(self) -> int:
        used = sum(p.size() for p in self._pools.values())
        return max(0, self.settings.budget_slots - used)

    async def _refill_loop(self, pool: WarmPool) -> None:
        while not pool.dropped:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pool.wake.wait(), _TICK_S)
            pool.wake.clear()
            try:
                self._refill_step(pool)
            except Exception:  # a bug here must not end refilling for the service's lifetime
                log.exception("warm pool %s: refill step failed", pool.label)

    def _refill_step(self, pool: WarmPool) -> None:
        if pool.dropped:
            # Python 3.11's wait_for can swallow the loop's cancellation when a wake-up comes with it; a
            # start now would outlive stop(), which waits only for the starts it saw.
            return
        now = time.monotonic()
        pool.target = self.target_of(pool, now)
        self._trim(pool, now)
        if now < pool.retry_at:
            return
        room = min(
            pool.target - pool.size(),
            self.settings.refill_concurrency - len(pool.starting),
            self._room(),
        )
        for _ in range(max(0, room)):
            task = asyncio.get_running_loop().create_task(self._start_one(pool))
            pool.starting.add(task)
            task.add_done_callback(pool.starting.discard)

    def _trim(self, pool: WarmPool, now: float) -> None:
        """Close idle sandboxes over max_size or the memory budget now, over the target once stale."""
        s = self.settings
        over_budget = -min(0, s.budget_slots - sum(p.size() for p in self._pools.values()))
        hard = max(len(pool.idle) - s.max_size, min(over_budget, len(pool.idle)))
        for _ in range(max(0, hard)):
            pool.stats.trimmed += 1
            self._discard(pool.idle.popleft())
        while len(pool.idle) > pool.target and now - pool.idle[0].since >= s.keep_idle_s:
            pool.stats.trimmed += 1
            self._discard(pool.idle.popleft())

    async def _start_one(self, pool: WarmPool) -> None:
        try:
            sb = await self.manager.start_cold(pool.config, owner=POOL_OWNER, leased=False)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if pool.dropped:
                return  # stopped while starting: the start unwound and closed what it had
            pool.stats.refill_failures += 1
            pool.backoff_s = min(30.0, max(0.5, pool.backoff_s * 2))
            pool.retry_at = time.monotonic() + pool.backoff_s
            log.warning(
                "warm pool %s: a start failed (%s); retrying in %.1fs", pool.label, exc, pool.backoff_s
            )
            return
        pool.backoff_s = 0.0
        pool.stats.refills += 1
        entry = _Idle(sb, time.monotonic())
        if pool.dropped:
            self._discard(entry)
            return
        entry.watcher = asyncio.get_running_loop().create_task(self._watch(pool, entry))
        pool.idle.append(entry)
        pool.wake.set()

    async def _watch(self, pool: WarmPool, entry: _Idle) -> None:
        """A pooled sandbox that dies while idle is discarded at once (and replaced by the refill loop)."""
        await entry.sandbox.wait_exited()
        if entry in pool.idle:
            pool.idle.remove(entry)
            pool.stats.discarded += 1
            log.warning("warm pool %s: idle sandbox %s died; replacing it", pool.label, entry.sandbox.id)
            entry.watcher = None  # this task: nothing to cancel
            self._discard(entry)
            pool.wake.set()

    def _discard(self, entry: _Idle) -> None:
        if entry.watcher is not None:
            entry.watcher.cancel()
        self._track(entry.sandbox.close())

    def _track(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # -- reporting ---------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """For ``/status`` and ``/metrics``: settings, and per pool its size, target and counters."""
        s = self.settings
        return {
            "enabled": s.enabled,
            "memory_budget_mb": s.memory_budget_mb,
            "sandbox_mb": s.sandbox_mb,
            "pools": [
                {
                    "pool": p.label,
                    "backend": p.config.backend,
                    "image": image_of(p.config),
                    "idle": len(p.idle),
                    "starting": len(p.starting),
                    "target": p.target,
                    "claims": p.stats.claims,
                    "misses": p.stats.misses,
                    "refills": p.stats.refills,
                    "refill_failures": p.stats.refill_failures,
                    "discarded": p.stats.discarded,
                    "trimmed": p.stats.trimmed,
                }
                for p in self._pools.values()
            ],
        }


async def _await_quietly(task: asyncio.Future[Any]) -> None:
    """Wait for a cancelled task to finish unwinding, whatever it ends with."""
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: a failure while unwinding was logged where it happened
