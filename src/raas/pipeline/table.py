"""The job table: the jobs a service is working on, their state changes, and recently finished results.

Every change of a job's status goes through here, so the order is always the same: the ledger first
(durable), then the in-memory state, then the event bus (what clients see).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

from raas.core import metrics
from raas.core.jobs import (
    QUEUED_FOR,
    STAGES,
    Job,
    JobEvent,
    JobInfo,
    JobRequest,
    JobResult,
    JobStatus,
    StageName,
)
from raas.core.policy import StagePolicy
from raas.core.trajectory import RunOutput
from raas.errors import RaasError
from raas.pipeline.events import EventBus
from raas.pipeline.ledger import Ledger
from raas.pipeline.prewarm import Prewarm
from raas.pipeline.turns import turn_stage
from raas.sandbox.base import Sandbox
from raas.tasks.base import Env, JobSandboxes, TaskHandler

log = logging.getLogger("raas.pipeline")


@dataclass
class ActiveJob:
    """A job the service is working on (in memory until it reaches a terminal status)."""

    request: JobRequest
    job: Job
    handler: TaskHandler
    policy: StagePolicy
    status: str
    priority: int
    created_at: float
    attempts: int
    budget_s: float
    t0: float = field(default_factory=time.monotonic)
    enqueued_at: float = field(default_factory=time.monotonic)
    updated_at: float = field(default_factory=time.time)
    counted_s: float = 0.0
    queue_s: float = 0.0
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    sandboxes: JobSandboxes | None = None
    env: Env | None = None
    run_output: RunOutput | None = None
    prewarm: Prewarm | None = None
    """The handler's EVAL prewarm, started with RUN (handlers that have one)."""
    task: asyncio.Task[Any] | None = None
    cancel_reason: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: JobResult | None = None
    finishing: bool = False
    checkpointed: bool = False
    """Its RUN output is committed to the ledger (a restart resumes it at EVAL)."""
    resumed_at: str | None = None
    """Where it went on after a restart (``Timing.resumed_at``)."""
    replay: list[dict[str, Any]] | None = None
    """RUN's committed turns, to replay after a restart (:mod:`raas.pipeline.turns`)."""
    replayed_turns: int = 0
    acknowledge: asyncio.Future[bool] | None = None
    """Told whether RUN's output was committed (True) or the job ended first (False): an external rollout's
    close is answered only then."""

    @property
    def job_id(self) -> str:
        return self.job.job_id

    @property
    def data_source(self) -> str:
        return self.job.data_source

    def info(self) -> JobInfo:
        return JobInfo(
            job_id=self.job.job_id,
            status=cast(JobStatus, self.status),
            data_source=self.job.data_source,
            instance_id=self.job.instance_id,
            trajectory_id=self.job.trajectory_id,
            priority=self.priority,
            attempts=self.attempts,
            created_at=self.created_at,
            updated_at=self.updated_at,
        )

    def waiting_for(self, stage: StageName) -> bool:
        """Still queued for ``stage`` and not cancelled meanwhile."""
        return self.status == QUEUED_FOR[stage] and self.cancel_reason is None


def settle(a: ActiveJob, *, committed: bool) -> None:
    """Answer whoever waits for ``a``'s RUN output to be committed (once)."""
    if a.acknowledge is not None and not a.acknowledge.done():
        a.acknowledge.set_result(committed)


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


class JobTable:
    """Active jobs by id, the results cache, and the state transitions (ledger, then memory, then bus)."""

    def __init__(self, ledger: Ledger, bus: EventBus, cache_size: int) -> None:
        self.ledger = ledger
        self.bus = bus
        self._cache_size = cache_size
        self._active: dict[str, ActiveJob] = {}
        self._recent: OrderedDict[str, JobResult] = OrderedDict()
        self._idle = asyncio.Event()
        self._idle.set()
        self.finished_counts: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._active)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._active

    def get(self, job_id: str) -> ActiveJob | None:
        return self._active.get(job_id)

    def jobs(self) -> Iterator[ActiveJob]:
        """A snapshot of the active jobs (safe to iterate while they finish)."""
        return iter(list(self._active.values()))

    def cached_result(self, job_id: str) -> JobResult | None:
        return self._recent.get(job_id)

    def add(self, a: ActiveJob) -> None:
        self._active[a.job_id] = a
        self._idle.clear()

    def forget(self, job_id: str) -> None:
        self._active.pop(job_id, None)
        if not self._active:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> None:
        """Until no job is active, or ``timeout_s`` passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    def queued_per_stage(self) -> dict[str, int]:
        queued: dict[str, int] = dict.fromkeys(STAGES, 0)
        for a in self._active.values():
            for stage in STAGES:
                if a.status == QUEUED_FOR[stage]:
                    queued[stage] += 1
        return queued

    def group_pending(self, groups: set[str], claimed: set[str]) -> bool:
        """Does a job of one of ``groups``, not among the ``claimed`` job ids, still wait for or run INIT?
        (Whether a group's shared layer may still be needed; one pass over the active jobs.)"""
        return any(
            a.status in ("queued", "init") and a.job_id not in claimed and a.job.group_key in groups
            for a in self._active.values()
        )

    # -- transitions -------------------------------------------------------------------------------------

    def publish(self, a: ActiveJob) -> None:
        self.bus.publish(JobEvent(job_id=a.job_id, status=cast(JobStatus, a.status), at=a.updated_at))

    def set_status(self, a: ActiveJob, status: str) -> None:
        a.status = status
        a.updated_at = time.time()
        self.ledger.transition(a.job_id, status, a.updated_at)
        self.publish(a)

    def sandbox_opened(self, job_id: str, sandbox: Sandbox) -> None:
        """Keep the sandbox a job opened in its history (the job page shows it; not a state change)."""
        detail = {
            "id": sandbox.id,
            "backend": sandbox.backend_name,
            "image": getattr(sandbox.config, "image", None),
        }
        self.ledger.note(job_id, "sandbox", time.time(), json.dumps(detail))

    def commit_turn(self, job_id: str, index: int, body: str) -> None:
        """One turn of a job's RUN, for a replay after a restart (:mod:`raas.pipeline.turns`)."""
        self.ledger.checkpoint_turn(job_id, turn_stage(index), body, time.time())

    async def record_result(self, a: ActiveJob, result: JobResult) -> None:
        """The job ended: commit ``result`` to the ledger, then let everyone see it."""
        now = time.time()
        try:
            await asyncio.shield(self.ledger.finish(result, now))
        except RaasError:
            log.exception("could not record the result of job %s", a.job_id)
        settle(a, committed=a.checkpointed)
        a.result = result
        a.status = result.status
        a.updated_at = now
        self._recent[result.job_id] = result
        while len(self._recent) > self._cache_size:
            self._recent.popitem(last=False)
        self.forget(a.job_id)
        self.finished_counts[result.status] = self.finished_counts.get(result.status, 0) + 1
        metrics.count_finished(result.status)
        if result.error is not None:
            metrics.count_error(result.error.stage, result.error.kind)
        a.done.set()
        self.bus.publish(
            JobEvent(
                job_id=a.job_id,
                status=result.status,
                at=now,
                reward=result.reward,
                filter=result.filter,
                error=result.error,
            )
        )

    def leave_for_restart(self, a: ActiveJob, status: str, detail: str) -> None:
        """Shutdown stopped a job the next start can go on with: leave it in ``status`` in the ledger
        (``queued``: from INIT; ``queued_eval``: at EVAL, its RUN output committed; its stage: for
        :mod:`~raas.pipeline.ledger_recovery` to decide)."""
        self.ledger.transition(a.job_id, status, time.time(), detail)
        a.status = status
        self.forget(a.job_id)
        settle(a, committed=a.checkpointed)
        a.done.set()

    async def checkpoint_run(self, a: ActiveJob) -> bool:
        """Commit what EVAL needs to grade ``a`` without generating again (its RUN output, the JSON part of
        its INIT state, its timings so far); True once on disk. A failed write only costs resumability."""
        run_output = a.run_output
        if run_output is None:
            return False
        data = dict(a.env.data) if a.env is not None else {}
        timing = {"queue_s": a.queue_s, "counted_s": a.counted_s, **{f"{s}_s": a.stage_s[s] for s in STAGES}}

        def serialize() -> str:  # a SWE trajectory is megabytes of JSON: not on the event loop
            env_data = {k: v for k, v in data.items() if _jsonable(v)}
            return json.dumps(
                {"run_output": run_output.model_dump(mode="json"), "env_data": env_data, "timing": timing}
            )

        try:
            body = await asyncio.to_thread(serialize)
            await self.ledger.checkpoint(a.job_id, "run", body, time.time())
        except RaasError:
            log.exception(
                "could not commit the RUN output of job %s (it cannot resume after a restart)", a.job_id
            )
            return False
        a.checkpointed = True
        return True
