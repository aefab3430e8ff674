"""Service health and failover for :class:`~raas.trainer.rollout.RolloutClient` (mixed into it).

Why apart: which service is alive, and what happens to the jobs of one that stops answering, is one
concern with its own state machine (healthy → silent → dead → back), separate from submitting jobs and
assembling groups. A service silent for ``dead_after_s`` has its unfinished jobs resubmitted elsewhere under
the same ``job_id`` (at most ``FailurePolicy.max_moves`` times per sample); jobs with no healthy service
wait (``homeless``) up to ``FailurePolicy.give_up_after_s``; a sample no service could finish becomes a
typed, filtered result, never a reward. A service that answers again gets the current weight version
before it takes new jobs, and is told to drop the jobs that moved away from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Literal

from raas.errors import RaasError
from raas.trainer.records import ClientStats, FailurePolicy, JobRecord, ServiceState
from raas.trainer.types import ErrorInfo, JobResult

log = logging.getLogger("raas.trainer.rollout")


class ServiceFailover:
    """Needs the :class:`~raas.trainer.rollout.RolloutClient` state declared below."""

    _services: list[ServiceState]
    _homeless: list[JobRecord]
    _closed: bool
    policy: FailurePolicy
    stats: ClientStats
    consume: Literal["sse", "poll"]
    health_interval_s: float
    dead_after_s: float
    weight_version: str | None

    if TYPE_CHECKING:

        def _spawn(self, coro: Awaitable[Any]) -> None: ...

        async def _send(self, jobs: list[JobRecord], *, raise_errors: bool = False) -> None: ...

        async def _watch(self, service: ServiceState) -> None: ...

        def _forget_job(self, job: JobRecord) -> None: ...

        async def _set_version_on(self, service: ServiceState, version: str) -> None: ...

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self._probe(s) for s in self._services), return_exceptions=True)
            self._retry_homeless()

    async def _probe(self, service: ServiceState) -> None:
        try:
            await service.client.health()
        except RaasError:
            service.healthy = False  # no new jobs; a moment of silence may only be a restart
            if time.monotonic() - service.last_ok > self.dead_after_s:
                self._mark_dead(service)
            return
        service.last_ok = time.monotonic()
        service.dead = False
        if not service.healthy:
            await self._mark_up(service)

    def _mark_dead(self, service: ServiceState) -> None:
        """Silent for ``dead_after_s``: every job it still holds runs elsewhere."""
        if not service.dead:
            log.warning("raas service %s stopped answering; its jobs move elsewhere", service.url)
            service.dead = True
            self.stats.services_down += 1
        if service.outstanding:
            self._spawn(self._move(list(service.outstanding.values()), service))

    async def _mark_up(self, service: ServiceState) -> None:
        log.info("raas service %s answers again", service.url)
        if self.weight_version is not None:
            with contextlib.suppress(RaasError):
                await self._set_version_on(service, self.weight_version)
        service.healthy = True
        abandoned, service.abandoned = service.abandoned, set()
        for job_id in abandoned:  # work it may have restarted for jobs that now run elsewhere
            self._spawn(self._quiet_cancel(service, job_id))
        if self.consume == "sse" and (service.watcher is None or service.watcher.done()):
            service.watcher = asyncio.create_task(self._watch(service), name=f"raas-watch-{service.url}")
        self._retry_homeless()

    async def _quiet_cancel(self, service: ServiceState, job_id: str) -> None:
        with contextlib.suppress(RaasError):
            await service.client.cancel(job_id)

    async def _move(self, jobs: list[JobRecord], source: ServiceState) -> None:
        """Resubmit ``jobs`` (same ids) on other services; samples that moved too often are dropped."""
        again: list[JobRecord] = []
        for job in jobs:
            if job.done or job.service is not source:
                continue
            source.outstanding.pop(job.job_id, None)
            source.abandoned.add(job.job_id)
            job.service = None
            if job.group.cancelled:
                self._forget_job(job)
                continue
            if job.moves >= self.policy.max_moves:
                self._fail_locally(job, f"moved {job.moves} times; no raas service finished it")
                continue
            job.acked = False
            job.moves += 1
            self.stats.moved += 1
            again.append(job)
        if again:
            await self._send(again)

    def _retry_homeless(self) -> None:
        if not self._homeless or not any(s.healthy for s in self._services):
            now = time.monotonic()
            for job in [
                j for j in self._homeless if now - (j.homeless_since or now) > self.policy.give_up_after_s
            ]:
                self._homeless.remove(job)
                self._fail_locally(job, f"no healthy raas service for {self.policy.give_up_after_s:.0f}s")
            return
        jobs, self._homeless = self._homeless, []
        for job in jobs:
            job.homeless_since = None
        self._spawn(self._send(jobs))

    def _fail_locally(self, job: JobRecord, message: str, kind: str = "unavailable") -> None:
        """A typed, filtered result for a sample no service could finish (never a reward)."""
        result = JobResult(
            job_id=job.job_id,
            instance_id=str(job.group.instance.get("instance_id"))
            if "instance_id" in job.group.instance
            else None,
            trajectory_id=str(job.index),
            status="failed",
            filter=True,
            error=ErrorInfo(stage="trainer", kind=kind, message=message),
        )
        self.stats.dropped_samples += 1
        self.stats.results += 1
        self.stats.filtered += 1
        job.done = True
        job.group.failures.append(result)
        self._forget_job(job)
