"""``RolloutClient``: a trainer's view of one or many raas services as a source of finished sample groups.

Why: a trainer thinks in groups (one prompt x n samples) and wants each group the moment its last sample is
in, with infrastructure failures kept out of its statistics, whatever happens to the services. This client

* spreads every sample over the healthy services by least outstanding jobs;
* follows each service's Server-Sent Events (``/v1/events?terminal_only=true``) and fetches each result
  as it finishes; after a dropped stream it reconnects and asks for the result of every job it still
  waits for, so nothing is missed (``consume="poll"`` long-polls each job instead);
* watches ``/healthz``: a service silent for ``dead_after_s`` is skipped and its unfinished jobs are
  resubmitted elsewhere under the same ``job_id`` (idempotent if the service was only slow), at most
  ``FailurePolicy.max_moves`` times per sample;
* applies a :class:`FailurePolicy` to filtered results (``filter: true`` never becomes a reward of 0):
  resubmit the sample (bounded) or drop it; a group left below ``min_group_size`` usable samples is
  refilled with new samples (bounded) or dropped;
* drives weight syncs on every service: ``POST /v1/llm:pause`` (in-flight turns finish, none is aborted),
  new ``weight_version`` on every inference server, ``POST /v1/llm:resume``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Literal

from raas.errors import RaasError
from raas.trainer.client import RaasClient
from raas.trainer.failover import ServiceFailover
from raas.trainer.llm_control import LLMControl
from raas.trainer.placement import host_of
from raas.trainer.records import ClientStats, FailurePolicy, JobRecord, ServiceState
from raas.trainer.types import Group, JobResult, is_valid

__all__ = ["ClientStats", "FailurePolicy", "RolloutClient"]

log = logging.getLogger(__name__)

_GROUP_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,150}$")
_RETRYABLE = frozenset({"unavailable", "timeout", "overloaded", "internal"})
"""Submit errors that mean "this service cannot take it now", not "this job is wrong"."""


class RolloutClient(ServiceFailover, LLMControl):
    """``async with RolloutClient([url_a, url_b]) as c: await c.submit_group(inst, 8); g = await c.next_group()``.

    Job ids are ``<group_id>.<trajectory index>.<attempt>`` and default group ids ``<run_id>-g<n>``; the
    services are idempotent on job ids, so a ``run_id`` you pass yourself must be new for every run against
    the same services (the default is random). ``health_interval_s`` is how often ``/healthz`` is probed,
    ``dead_after_s`` how long a service may stay silent before its jobs move, ``job_timeout_s`` each job's
    in-stage budget (``timeout_s``), ``on_result`` a callback for every result, usable or not.
    """

    def __init__(
        self,
        services: str | Sequence[str],
        *,
        token: str | None = None,
        policy: FailurePolicy | None = None,
        consume: Literal["sse", "poll"] = "sse",
        run_id: str | None = None,
        timeout_s: float = 30.0,
        health_interval_s: float = 1.0,
        dead_after_s: float = 5.0,
        job_timeout_s: float | None = None,
        on_result: Callable[[JobResult], None] | None = None,
    ) -> None:
        urls = [services] if isinstance(services, str) else list(services)
        if not urls:
            raise RaasError("RolloutClient needs at least one raas service URL", kind="bad_request")
        if consume not in ("sse", "poll"):
            raise RaasError(f"consume must be 'sse' or 'poll', got {consume!r}", kind="bad_request")
        self.policy = policy or FailurePolicy()
        self.consume = consume
        self.run_id = run_id or "r" + secrets.token_hex(4)
        self.health_interval_s = health_interval_s
        self.dead_after_s = dead_after_s
        self.job_timeout_s = job_timeout_s
        self.on_result = on_result
        self.stats = ClientStats()
        self.weight_version: str | None = None
        self._services = [
            ServiceState(u.rstrip("/"), RaasClient(u, token=token, timeout_s=timeout_s), host_of(u))
            for u in urls
        ]
        self._jobs: dict[str, JobRecord] = {}
        self._groups: dict[str, Group] = {}
        self._pending: dict[str, set[str]] = {}
        self._finished: asyncio.Queue[Group] = asyncio.Queue()
        self._homeless: list[JobRecord] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cancels: set[asyncio.Task[Any]] = set()
        self._seq = itertools.count()
        self._rotation = itertools.count()
        self._health: asyncio.Task[None] | None = None
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def __aenter__(self) -> RolloutClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Check every service once (at least one must answer) and start following them."""
        answers = await asyncio.gather(*(s.client.health() for s in self._services), return_exceptions=True)
        for s, answer in zip(self._services, answers, strict=True):
            s.healthy = not isinstance(answer, BaseException)
            if s.healthy and self.consume == "sse":
                s.watcher = asyncio.create_task(self._watch(s), name=f"raas-watch-{s.url}")
        if not any(s.healthy for s in self._services):
            await self.aclose()
            raise RaasError(
                f"no raas service answers: {', '.join(s.url for s in self._services)}", kind="unavailable"
            )
        self._health = asyncio.create_task(self._health_loop(), name="raas-health")

    async def aclose(self) -> None:
        """Stop following the services. Cancels already asked for are sent first; other unfinished jobs
        keep running there (cancel them first if unwanted)."""
        if self._cancels:
            await asyncio.wait(list(self._cancels), timeout=60)
        self._closed = True
        tasks = [
            t for t in (self._health, *(s.watcher for s in self._services), *self._tasks, *self._cancels) if t
        ]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        await asyncio.gather(*(s.client.aclose() for s in self._services), return_exceptions=True)

    @property
    def services(self) -> list[dict[str, Any]]:
        return [
            {"url": s.url, "healthy": s.healthy, "outstanding": len(s.outstanding), "host": s.host}
            for s in self._services
        ]

    @property
    def in_flight_groups(self) -> int:
        """Groups submitted and not yet finished (cancelled ones whose jobs are still ending excluded)."""
        return sum(1 for g in self._groups.values() if not g.cancelled)

    @property
    def outstanding_jobs(self) -> int:
        return sum(len(s.outstanding) for s in self._services) + len(self._homeless)

    # -- submitting --------------------------------------------------------------------------------------

    def new_group(
        self,
        instance: dict[str, Any],
        n: int,
        *,
        sampling_params: dict[str, Any] | None = None,
        group_id: str | None = None,
        version: int = 0,
        priority: int | None = None,
    ) -> Group:
        """A group record (not yet submitted); :meth:`submit_groups` sends it."""
        if n < 1:
            raise RaasError(f"a group needs at least one sample, got n={n}", kind="bad_request")
        if not isinstance(instance, dict) or not isinstance(instance.get("data_source"), str):
            raise RaasError("instance must be an object with a data_source", kind="bad_request")
        gid = group_id or f"{self.run_id}-g{next(self._seq)}"
        if not _GROUP_ID.match(gid) or gid in self._groups:
            raise RaasError(f"group_id {gid!r} is malformed or already in use", kind="bad_request")
        fields: dict[str, Any] = {}
        if self.job_timeout_s is not None:
            fields["timeout_s"] = self.job_timeout_s
        if priority is not None:
            fields["priority"] = priority
        return Group(
            group_id=gid,
            instance=dict(instance),
            size=n,
            sampling_params=sampling_params,
            request_fields=fields,
            submit_version=version,
        )

    async def submit_group(self, instance: dict[str, Any], n: int, **kw: Any) -> Group:
        """Submit one instance x ``n`` samples (``trajectory_id`` 0..n-1); returns the group."""
        group = self.new_group(instance, n, **kw)
        await self.submit_groups([group])
        return group

    async def submit_groups(self, groups: Sequence[Group]) -> None:
        """Submit new groups (from :meth:`new_group`), one batch request per service."""
        jobs: list[JobRecord] = []
        for g in groups:
            if g.group_id in self._groups:
                raise RaasError(f"group {g.group_id} was already submitted", kind="bad_request")
            g.submitted_at = time.monotonic()
            self._groups[g.group_id] = g
            self._pending[g.group_id] = set()
            for i in range(g.size):
                jobs.append(self._job(g, i, 0))
        try:
            await self._send(jobs, raise_errors=True)
        except RaasError:
            # Refused (e.g. an unknown data_source): none of these groups exists for the caller.
            await self.cancel_groups(groups, wait=False)
            raise

    def _job(self, group: Group, index: int, attempt: int) -> JobRecord:
        job = JobRecord(
            job_id=f"{group.group_id}.{index}.{attempt}", group=group, index=index, attempt=attempt
        )
        self._jobs[job.job_id] = job
        self._pending[group.group_id].add(job.job_id)
        return job

    def _choose(self) -> ServiceState | None:
        healthy = [s for s in self._services if s.healthy]
        if not healthy:
            return None
        least = min(len(s.outstanding) for s in healthy)
        tied = [s for s in healthy if len(s.outstanding) == least]
        return tied[next(self._rotation) % len(tied)]

    async def _send(self, jobs: list[JobRecord], *, raise_errors: bool = False) -> None:
        """Assign each job to the least-loaded healthy service and submit per service; a service that
        cannot take its share is marked down and the share goes elsewhere."""
        todo = [j for j in jobs if not j.done]
        for job in [j for j in todo if j.group.cancelled]:
            self._forget_job(job)
        todo = [j for j in todo if not j.group.cancelled]
        while todo:
            batches: dict[int, tuple[ServiceState, list[JobRecord]]] = {}
            for job in todo:
                service = self._choose()
                if service is None:
                    self._park(job)
                    continue
                job.service = service
                service.outstanding[job.job_id] = job
                batches.setdefault(id(service), (service, []))[1].append(job)
            todo = []
            outcomes = await asyncio.gather(
                *(self._post(service, batch) for service, batch in batches.values()), return_exceptions=True
            )
            for (service, batch), outcome in zip(batches.values(), outcomes, strict=True):
                if outcome is None:
                    self.stats.submitted += len(batch)
                    continue
                if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                    raise outcome  # cancelled
                for job in batch:
                    service.outstanding.pop(job.job_id, None)
                    job.service = None
                kind = getattr(outcome, "kind", "internal")
                if isinstance(outcome, RaasError) and kind not in _RETRYABLE:
                    if raise_errors:
                        raise outcome
                    log.error("raas service %s refused %d jobs: %s", service.url, len(batch), outcome)
                    for job in batch:
                        self._fail_locally(job, f"resubmission refused: {outcome}", kind=kind)
                    continue
                log.warning(
                    "raas service %s could not take %d jobs (%s); trying another",
                    service.url,
                    len(batch),
                    outcome,
                )
                # It may have accepted some before failing: cancel those when it answers again.
                service.abandoned.update(j.job_id for j in batch)
                service.healthy = False
                todo.extend(batch)

    async def _post(self, service: ServiceState, batch: list[JobRecord]) -> None:
        for start in range(0, len(batch), 512):
            await service.client.submit_batch([j.body() for j in batch[start : start + 512]])
        for job in batch:
            job.acked = True
        if self.consume == "poll":
            for job in batch:
                self._spawn(self._poll(service, job))

    def _park(self, job: JobRecord) -> None:
        """No healthy service: keep the job until one comes back (or ``give_up_after_s`` passes)."""
        job.service = None
        if job.homeless_since is None:
            job.homeless_since = time.monotonic()
        self._homeless.append(job)

    def _forget_job(self, job: JobRecord) -> None:
        self._jobs.pop(job.job_id, None)
        pending = self._pending.get(job.group.group_id)
        if pending is not None:
            pending.discard(job.job_id)
            if not pending:
                self._settle(job.group)

    # -- consuming ---------------------------------------------------------------------------------------

    async def next_group(self, timeout: float | None = None) -> Group:  # noqa: ASYNC109
        """The next group that finished (complete, or ``dropped`` by the failure policy)."""
        if timeout is None:
            return await self._finished.get()
        return await asyncio.wait_for(self._finished.get(), timeout)

    def finished_nowait(self) -> list[Group]:
        """Every group that has finished and not been taken yet."""
        out: list[Group] = []
        while True:
            try:
                out.append(self._finished.get_nowait())
            except asyncio.QueueEmpty:
                return out

    async def groups(self) -> AsyncIterator[Group]:
        """Finished groups as they come, forever (break out when you have enough)."""
        while True:
            yield await self._finished.get()

    async def _watch(self, service: ServiceState) -> None:
        """Follow one service's terminal events; reconnect after a dropped stream and catch up."""
        backoff = 0.1
        first = True
        while not self._closed:
            try:
                async for name, data in service.client.stream_events(terminal_only=True, timeout_s=45.0):
                    if name == "connected":
                        backoff = 0.1
                        if not first:
                            self.stats.stream_reconnects += 1
                        first = False
                        self._spawn(self._reconcile(service))
                    elif name == "dropped":
                        self._spawn(self._reconcile(service))
                    elif name == "job" and data is not None:
                        job = service.outstanding.get(str(data.get("job_id")))
                        if job is not None and not job.done:
                            self._spawn(self._fetch(service, job))
            except RaasError as exc:
                log.debug("event stream of %s ended: %s", service.url, exc)
            if self._closed:
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _reconcile(self, service: ServiceState) -> None:
        """Fetch every result that may have finished while this client was not listening."""
        sem = asyncio.Semaphore(32)

        async def one(job: JobRecord) -> None:
            async with sem:
                await self._fetch(service, job)

        jobs = [j for j in service.outstanding.values() if j.acked]
        await asyncio.gather(*(one(j) for j in jobs), return_exceptions=True)

    async def _fetch(self, service: ServiceState, job: JobRecord, wait_s: float = 0.0) -> bool:
        try:
            body = await service.client.result(job.job_id, wait_s=wait_s)
        except RaasError as exc:
            if exc.kind == "not_found" and job.acked and job.service is service:
                # The service lost the job (a fresh ledger after a restart): run it again elsewhere.
                self._spawn(self._move([job], service))
            return False
        if body is None:
            return False
        self._deliver(service, job, JobResult.model_validate(body))
        return True

    async def _poll(self, service: ServiceState, job: JobRecord) -> None:
        """``consume="poll"``: long-poll one job until it has a result or moves to another service."""
        while not self._closed and not job.done and job.service is service:
            if not service.healthy:
                await asyncio.sleep(self.health_interval_s)
                continue
            async with service.polls:
                found = await self._fetch(service, job, wait_s=20.0)
            if found:
                return
            await asyncio.sleep(0.05 if service.healthy else self.health_interval_s)

    def _deliver(self, service: ServiceState, job: JobRecord, result: JobResult) -> None:
        if job.done or job.service is not service:
            return
        job.done = True
        service.outstanding.pop(job.job_id, None)
        self._pending.get(job.group.group_id, set()).discard(job.job_id)
        self._jobs.pop(job.job_id, None)
        self.stats.results += 1
        if self.on_result is not None:
            try:
                self.on_result(result)
            except Exception:
                log.exception("on_result callback failed")
        group = job.group
        if group.cancelled:
            if result.status == "cancelled":
                self.stats.cancelled += 1
        elif is_valid(result):
            self.stats.usable += 1
            group.results[job.index] = result
        else:
            self.stats.filtered += 1
            p = self.policy
            if p.resubmit and job.attempt < p.max_resubmits:
                self.stats.resubmitted += 1
                self._spawn(self._send([self._job(group, job.index, job.attempt + 1)]))
            else:
                self.stats.dropped_samples += 1
                group.failures.append(result)
        if not self._pending.get(group.group_id):
            self._settle(group)

    def _settle(self, group: Group) -> None:
        """Every job of the group has ended: emit it complete, refill it, or drop it."""
        if group.group_id not in self._groups:
            return
        if group.cancelled:
            self._close_group(group)
            return
        p = self.policy
        usable = len(group.results)
        needed = min(p.min_group_size, group.size)
        if usable >= needed:
            self.stats.completed_groups += 1
            self._close_group(group)
            self._finished.put_nowait(group)
            return
        refilled = int(group.meta.get("refilled", 0))
        missing = needed - usable
        if p.refill and refilled + missing <= p.max_refill_samples:
            group.meta["refilled"] = refilled + missing
            self.stats.refilled_samples += missing
            start = group.size + refilled
            self._spawn(self._send([self._job(group, start + k, 0) for k in range(missing)]))
            return
        self.stats.dropped_groups += 1
        group.dropped = True
        self._close_group(group)
        self._finished.put_nowait(group)

    def _close_group(self, group: Group) -> None:
        group.finished_at = time.monotonic()
        self._groups.pop(group.group_id, None)
        self._pending.pop(group.group_id, None)

    # -- cancel ------------------------------------------------------------------------------------------

    async def cancel_groups(self, groups: Iterable[Group], *, wait: bool = True) -> int:
        """Cancel every unfinished job of ``groups`` (the service stops them and closes their sandboxes);
        the groups are never emitted. Returns the number of jobs asked to stop. ``wait=False`` sends the
        cancels in the background."""
        calls: list[Awaitable[Any]] = []
        for g in groups:
            if g.cancelled or g.group_id not in self._groups:
                continue
            g.cancelled = True
            for job_id in list(self._pending.get(g.group_id, ())):
                job = self._jobs.get(job_id)
                if job is None or job.done:
                    continue
                if job.service is None:  # parked: nothing runs anywhere
                    self._homeless = [j for j in self._homeless if j is not job]
                    self._forget_job(job)
                    continue
                calls.append(self._cancel_job(job.service, job))
            if not self._pending.get(g.group_id):
                self._settle(g)
        if not calls:
            return 0
        if wait:
            await asyncio.gather(*calls, return_exceptions=True)
        else:
            for c in calls:
                task = asyncio.ensure_future(c)
                self._cancels.add(task)
                task.add_done_callback(self._cancels.discard)
        return len(calls)

    async def _cancel_job(self, service: ServiceState, job: JobRecord) -> None:
        with contextlib.suppress(RaasError):
            await service.client.cancel(job.job_id)
        if not job.done and service.healthy:
            await self._fetch(service, job)

    # -- helpers -----------------------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[Any]) -> None:
        if self._closed:
            if asyncio.iscoroutine(coro):
                coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("rollout client task failed", exc_info=task.exception())
