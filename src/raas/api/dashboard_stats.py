"""The dashboard's numbers for what an app serves (a :class:`raas.api.dashboard.StatsSource`).

Read from what the served object already has: its ``status()`` (queue depth and activity per stage,
finished counts, inference servers; a cluster router's also lists its ``nodes``) and its event stream
(``events()``: the terminal events carry each job's reward and typed error, from which come throughput, the
reward distribution, failure kinds and the recent failures). Where it has them (a
:class:`~raas.pipeline.service.RolloutService` does) also its sandbox manager (live sandboxes), LLM
balancer (in-flight total) and ledger (jobs by status, every few seconds). One sampler task computes a
snapshot per interval, so any number of open pages cost the service the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, deque
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from raas.core.jobs import JobEvent, is_terminal
from raas.errors import RaasError

log = logging.getLogger("raas.api")

MESSAGE_CHARS = 2000
"""A failure's message is cut to this many characters on the dashboard (the result keeps all of it)."""


def histogram(values: list[float], bins: int = 10) -> dict[str, list[Any]]:
    """``bins`` equal-width bins over the range of ``values`` (one bin when they are all equal)."""
    if not values:
        return {"edges": [], "counts": []}
    lo, hi = min(values), max(values)
    if hi == lo:
        return {"edges": [lo, hi], "counts": [len(values)]}
    width = (hi - lo) / bins
    counts = [0] * bins
    for v in values:
        counts[min(int((v - lo) / width), bins - 1)] += 1
    return {"edges": [lo + i * width for i in range(bins)] + [hi], "counts": counts}


class JobEvents(Protocol):
    async def get(self) -> JobEvent | None: ...

    @property
    def dropped(self) -> int: ...


class Observed(Protocol):
    """What :class:`ServiceStats` needs of a service: its status and its job events."""

    def status(self) -> dict[str, Any]: ...

    def events(self) -> AbstractAsyncContextManager[JobEvents]: ...


class ServiceStats:
    """Start with :meth:`start` (the app's lifespan does), stop with :meth:`aclose`. ``ended`` is set
    when the service's event streams close (shutdown), which ends the dashboard's streams too."""

    def __init__(
        self,
        service: Observed,
        *,
        interval_s: float = 1.0,
        history_points: int = 600,
        window_s: float = 30.0,
        recent_rewards: int = 1000,
        recent_failures: int = 20,
        ledger_every_s: float = 5.0,
    ) -> None:
        self.service = service
        self.interval_s = interval_s
        self.window_s = window_s
        self.ledger_every_s = ledger_every_s
        self.ended = asyncio.Event()
        self._started_at = time.monotonic()
        self._finished_at: deque[tuple[float, bool]] = deque()  # (monotonic time, completed?)
        self._rewards: deque[float] = deque(maxlen=recent_rewards)
        self._kinds: Counter[tuple[str, str]] = Counter()
        self._failures: deque[dict[str, Any]] = deque(maxlen=recent_failures)
        self._history: deque[dict[str, Any]] = deque(maxlen=history_points)
        self._sandbox_seen: dict[str, float] = {}
        self._ledger: dict[str, int] = {}
        self._ledger_at = -math.inf
        self._dropped = 0
        self._latest: dict[str, Any] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._tasks:
            return
        subscribed = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._consume(subscribed), name="raas-dashboard-events"),
            asyncio.create_task(self._sample_loop(), name="raas-dashboard-sampler"),
        ]
        await subscribed.wait()  # no terminal event is missed after start returns

    async def aclose(self) -> None:
        self.ended.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _consume(self, subscribed: asyncio.Event) -> None:
        try:
            async with self.service.events() as sub:
                subscribed.set()
                while (event := await sub.get()) is not None:
                    self._dropped = sub.dropped
                    if is_terminal(event.status):
                        try:
                            self._record(event)
                        except Exception:  # one odd event must not stop the dashboard's numbers
                            log.exception("dashboard could not record the event of job %s", event.job_id)
        finally:
            subscribed.set()
            self.ended.set()  # the bus closed: the server is stopping

    def _record(self, event: JobEvent) -> None:
        now = time.monotonic()
        self._finished_at.append((now, event.status == "completed"))
        if event.reward is not None and math.isfinite(event.reward):
            self._rewards.append(float(event.reward))
        if event.error is not None:
            stage = event.error.stage or "none"
            self._kinds[(stage, event.error.kind)] += 1
            cached = self._optional("table", "cached_result")
            result = cached(event.job_id) if cached is not None else None
            self._failures.appendleft(
                {
                    "at": event.at,
                    "job_id": event.job_id,
                    "instance_id": result.instance_id if result is not None else None,
                    "status": event.status,
                    "stage": stage,
                    "kind": event.error.kind,
                    "message": event.error.message[:MESSAGE_CHARS],
                }
            )

    def _optional(self, part: str, member: str) -> Any:
        """``service.<part>.<member>``, which only some served objects have (a rollout service has a
        sandbox manager, a cluster router has none of its own), or None."""
        return getattr(getattr(self.service, part, None), member, None)

    async def _sample_loop(self) -> None:
        while True:
            try:
                await self._sample()
            except Exception:  # a bad sample must not stop the dashboard; the next one may work
                log.exception("dashboard sample failed")
            await asyncio.sleep(self.interval_s)

    # -- the snapshot -------------------------------------------------------------------------------------

    async def _sample(self) -> None:
        now = time.monotonic()
        counts = self._optional("ledger", "counts")
        if counts is not None and now - self._ledger_at >= self.ledger_every_s:
            self._ledger_at = now
            if self._optional("ledger", "running"):
                with contextlib.suppress(RaasError):
                    self._ledger = await counts()
        snap = self._compute(now)
        self._history.append(snap["point"])
        self._latest = snap

    def _compute(self, now: float) -> dict[str, Any]:
        status = self.service.status()
        stages: dict[str, dict[str, int]] = status.get("stages", {})
        finished: dict[str, int] = status.get("finished", {})
        servers: list[dict[str, Any]] = status.get("llm_servers", [])
        while self._finished_at and self._finished_at[0][0] < now - self.window_s:
            self._finished_at.popleft()
        span = max(min(self.window_s, now - self._started_at), self.interval_s)
        rate = len(self._finished_at) / span
        completed_rate = sum(1 for _, ok in self._finished_at if ok) / span
        rewards = list(self._rewards)
        in_flight = self._optional("balancer", "in_flight")
        if not isinstance(in_flight, int):
            in_flight = sum(int(v.get("in_flight") or 0) for v in servers)
        wall = time.time()
        point = {
            "t": wall,
            "queued": {s: n.get("queued", 0) for s, n in stages.items()},
            "active": {s: n.get("active", 0) for s, n in stages.items()},
            "rollouts_per_s": rate,
            "finished": sum(finished.values()),
        }
        snap: dict[str, Any] = {
            "t": wall,
            "accepting": status.get("accepting"),
            "pending": status.get("pending"),
            "max_pending": status.get("max_pending"),
            "stages": stages,
            "finished": finished,
            "throughput": {
                "window_s": self.window_s,
                "rollouts_per_s": rate,
                "completed_per_s": completed_rate,
            },
            "reward": {
                "count": len(rewards),
                "mean": sum(rewards) / len(rewards) if rewards else None,
                "min": min(rewards) if rewards else None,
                "max": max(rewards) if rewards else None,
                "histogram": histogram(rewards),
            },
            "failure_kinds": [
                {"stage": stage, "kind": kind, "count": n} for (stage, kind), n in self._kinds.most_common()
            ],
            "recent_failures": list(self._failures),
            "llm": {
                "available": status.get("llm_available"),
                "paused": status.get("llm_paused"),
                "in_flight": in_flight,
                "servers": servers,
            },
            "sandboxes": self._sandboxes(now),
            "ledger": dict(self._ledger),
            "dropped_events": self._dropped,
            "point": point,
        }
        if status.get("nodes") is not None:
            snap["nodes"] = status["nodes"]
        return snap

    def _sandboxes(self, now: float) -> dict[str, Any] | None:
        listing = self._optional("sandbox_manager", "list")
        if listing is None:
            return None
        live = listing()
        seen = {sb.id: self._sandbox_seen.get(sb.id, now) for sb in live}
        self._sandbox_seen = seen
        items = [
            {"id": sb.id, "backend": sb.backend_name, "owner": sb.owner, "age_s": round(now - seen[sb.id], 1)}
            for sb in live[:100]
        ]
        return {"live": len(live), "items": items}

    async def snapshot(self) -> dict[str, Any]:
        if self._latest is None:
            await self._sample()
        assert self._latest is not None
        return self._latest

    def history(self) -> list[dict[str, Any]]:
        return list(self._history)
