"""Admission: checking a job, claiming its place, and recording it durably before ``submit`` returns.

* Idempotent on ``job_id``: resubmitting returns the existing job, whatever its state.
* At most ``max_pending`` unfinished jobs (:class:`Overloaded` beyond, HTTP 429); none while starting or
  shutting down (:class:`NotAccepting`, HTTP 503).
* A job's place is claimed synchronously (limits and idempotency see it at once), then recorded in the
  ledger, shielded: once claimed, admission completes even if the submitting request goes away. A batch
  is all or nothing and shares one ledger commit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, cast

from raas.core.jobs import NO_DATA_SOURCE, STAGES, Job, JobRequest, JobStatus, SubmitResponse, new_job_id
from raas.core.trajectory import RunOutput
from raas.errors import RaasError
from raas.pipeline import results
from raas.pipeline.ledger import LedgerJob
from raas.pipeline.scheduler import Scheduler
from raas.pipeline.table import ActiveJob, JobTable
from raas.pipeline.wiring import Layers
from raas.tasks.base import Env, TaskHandler


class Overloaded(RaasError):
    """The service is full; the client should retry after ``retry_after_s``."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, stage="api")
        self.retry_after_s = retry_after_s


class NotAccepting(RaasError):
    """The service is starting or shutting down."""

    kind = "unavailable"


class Admission:
    """Admits jobs into one service's table and INIT queue (see the module docstring)."""

    def __init__(
        self,
        layers: Layers,
        table: JobTable,
        scheduler: Scheduler,
        *,
        max_pending: int,
        retry_after_s: float,
        default_timeout_s: float,
    ) -> None:
        self.layers = layers
        self.table = table
        self.scheduler = scheduler
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self.default_timeout_s = default_timeout_s
        self.accepting = False
        self.stopped = False

    def check_accepting(self) -> None:
        if not self.accepting:
            state = "shutting down" if self.stopped else "not started"
            raise NotAccepting(f"the service is {state}", stage="api")

    def validate(self, request: JobRequest) -> TaskHandler:
        """The handler for the request's instance, or ``bad_request`` saying what is wrong: an unknown
        data_source, an instance the handler rejects, or a handler this service cannot run."""
        if "data_source" not in request.instance:  # JobRequest inferred it where the fields allow
            raise RaasError(NO_DATA_SOURCE, kind="bad_request", stage="api")
        data_source = str(request.instance.get("data_source"))
        handler = self.layers.handler_for(data_source)
        gateway = self.layers.gateway
        external = request.job_id is not None and gateway is not None and gateway.external.get(request.job_id)
        try:
            if external:  # opened by POST /v1/gateway/rollouts: its agent runs outside raas
                handler.validate_external_instance(request.instance)
            else:
                handler.validate_instance(request.instance)
        except RaasError as exc:
            raise RaasError(exc.message, kind="bad_request", stage="api") from exc
        except Exception as exc:
            raise RaasError(f"invalid instance: {exc}", kind="bad_request", stage="api") from exc
        self.layers.check_can_run(data_source, handler)
        return handler

    def _overloaded(self, wanted: int) -> Overloaded:
        return Overloaded(
            f"the service is full ({len(self.table)} of {self.max_pending} jobs pending; "
            f"{wanted} more requested)",
            self.retry_after_s,
        )

    def _existing(self, job_id: str | None) -> SubmitResponse | None:
        a = self.table.get(job_id) if job_id is not None else None
        if a is None:
            return None
        return SubmitResponse(job_id=a.job_id, status=cast(JobStatus, a.status), created=False)

    async def submit(self, request: JobRequest) -> SubmitResponse:
        """Accept a job (durably) or raise: ``bad_request``, :class:`Overloaded`, :class:`NotAccepting`."""
        self.check_accepting()
        existing = self._existing(request.job_id)
        if existing is not None:
            return existing
        handler = self.validate(request)
        if len(self.table) >= self.max_pending:
            raise self._overloaded(1)
        return await asyncio.shield(self._record(self._reserve(request, handler)))

    async def submit_many(self, requests: Sequence[JobRequest]) -> list[SubmitResponse]:
        """Accept a batch all-or-nothing: any invalid instance or too little room rejects the whole batch."""
        self.check_accepting()
        handlers: list[TaskHandler] = []
        for i, request in enumerate(requests):
            try:
                handlers.append(self.validate(request))
            except RaasError as exc:
                raise RaasError(f"jobs[{i}]: {exc.message}", kind=exc.kind, stage="api") from exc
        ids = [r.job_id for r in requests if r.job_id is not None]
        if len(ids) != len(set(ids)):
            raise RaasError("duplicate job_id within the batch", kind="bad_request", stage="api")
        new = sum(1 for r in requests if r.job_id is None or r.job_id not in self.table)
        if len(self.table) + new > self.max_pending:
            raise self._overloaded(new)
        pending: list[SubmitResponse | asyncio.Future[SubmitResponse]] = []
        for request, handler in zip(requests, handlers, strict=True):
            existing = self._existing(request.job_id)
            if existing is not None:
                pending.append(existing)
            else:
                # Reserved now, in order; recorded together, so the whole batch shares one commit.
                pending.append(asyncio.ensure_future(self._record(self._reserve(request, handler))))
        return [p if isinstance(p, SubmitResponse) else await asyncio.shield(p) for p in pending]

    def _active_job(self, request: JobRequest, job: Job, handler: TaskHandler, **fields: Any) -> ActiveJob:
        return ActiveJob(
            request=request,
            job=job,
            handler=handler,
            policy=self.layers.policy_for(job.data_source, handler),
            status="queued",
            budget_s=request.timeout_s or self.default_timeout_s,
            **fields,
        )

    def _reserve(self, request: JobRequest, handler: TaskHandler) -> ActiveJob:
        """Claim the job's place synchronously, so admission limits and idempotency see it at once."""
        job_id = request.job_id or new_job_id()
        instance = request.instance
        job = Job(
            job_id=job_id,
            instance=instance,
            trajectory_id=str(instance.get("trajectory_id", job_id)),
            sampling_params=dict(request.sampling_params or {}),
            external_rollout=request.external_rollout,
        )
        request = request.model_copy(update={"job_id": job_id})
        a = self._active_job(
            request, job, handler, priority=request.priority, created_at=time.time(), attempts=1
        )
        self.table.add(a)
        return a

    async def _record(self, a: ActiveJob) -> SubmitResponse:
        job, request = a.job, a.request
        try:
            existing = await self.table.ledger.insert_job(
                job_id=job.job_id,
                request=request.model_dump(mode="json"),
                data_source=job.data_source,
                instance_id=job.instance_id,
                trajectory_id=job.trajectory_id,
                priority=request.priority,
                retry_on_restart=request.retry_on_restart,
                at=a.created_at,
            )
        except BaseException:
            self.table.forget(job.job_id)
            raise
        if existing is not None:
            self.table.forget(job.job_id)
            return SubmitResponse(job_id=job.job_id, status=cast(JobStatus, existing.status), created=False)
        self.table.publish(a)
        self.scheduler.enqueue(a, "init")
        return SubmitResponse(job_id=job.job_id, status="queued", created=True)

    async def readmit(
        self,
        row: LedgerJob,
        checkpoint: dict[str, Any] | None = None,
        *,
        replay: list[dict[str, Any]] | None = None,
    ) -> None:
        """Put a job the ledger re-queued after a restart back into the INIT queue (with RUN's committed
        turns to ``replay``, if any), or (with its committed RUN ``checkpoint``) into the EVAL queue, its
        RUN output restored as it was generated."""
        try:
            request = JobRequest.model_validate(row.request)
            handler = self.validate(request)
            run_output = RunOutput.model_validate(checkpoint["run_output"]) if checkpoint else None
        except (RaasError, ValueError, KeyError, TypeError) as exc:
            result = results.not_requeued(row.job_id, row.instance_id, row.trajectory_id, str(exc))
            await self.table.ledger.finish(result, time.time())
            return
        job = Job(
            job_id=row.job_id,
            instance=request.instance,
            trajectory_id=row.trajectory_id or row.job_id,
            sampling_params=dict(request.sampling_params or {}),
            external_rollout=request.external_rollout,
        )
        a = self._active_job(
            request, job, handler, priority=row.priority, created_at=row.created_at, attempts=row.attempts
        )
        # the job's wall time counts from when it was accepted, across the restart
        a.t0 = time.monotonic() - max(0.0, time.time() - row.created_at)
        self.table.add(a)
        self.table.publish(a)
        if checkpoint is None or run_output is None:
            a.resumed_at = "run" if replay is not None else "init"
            a.replay = replay
            self.scheduler.enqueue(a, "init")
            return
        timing = checkpoint.get("timing") or {}
        a.queue_s = float(timing.get("queue_s", 0.0))
        a.counted_s = float(timing.get("counted_s", 0.0))
        for stage in STAGES:
            a.stage_s[stage] = float(timing.get(f"{stage}_s", 0.0))
        a.sandboxes = self.layers.sandboxes_for(job.job_id)
        a.env = Env(job=job, sandboxes=a.sandboxes, data=dict(checkpoint.get("env_data") or {}))
        a.run_output = a.env.run_output = run_output
        a.checkpointed = True
        a.resumed_at = "eval"
        self.scheduler.enqueue(a, "eval")
