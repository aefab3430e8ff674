"""The rollout service: admission, three stage pools (INIT, RUN, EVAL), timeouts, cancel, shutdown.

Why three pools: sandbox start-up, generation and test suites have very different costs; a job waits in a
FIFO (per priority) queue in front of each stage, so a slow EVAL never holds a RUN worker and the policy
server stays busy. Only time *inside* a stage counts against a job's budget; queue waits do not.

Lifetimes: each job owns a :class:`~raas.tasks.base.JobSandboxes`; the service closes it after RUN (before
EVAL), after EVAL and on any failure, timeout or cancel, then calls ``SandboxManager.close_owner(job_id)``
as a safety net. Every accepted job ends in exactly one typed result, written to the ledger before anyone
is told it finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import math
import time
import traceback
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from raas.agent.config import AgentConfig
from raas.core import metrics
from raas.core.jobs import (
    QUEUED_FOR,
    STAGES,
    ErrorInfo,
    JobEvent,
    JobInfo,
    JobRequest,
    JobResult,
    StageName,
    SubmitResponse,
    Timing,
    new_job_id,
)
from raas.core.trajectory import EvalOutput, RunOutput, TokenTrajectory
from raas.errors import RaasError
from raas.llm import ChatTokenizer, LLMBalancer
from raas.pipeline.config import ServiceConfig, agent_overrides
from raas.pipeline.events import EventBus, Subscription
from raas.pipeline.ledger import Ledger, LedgerJob
from raas.sandbox import SandboxConfig, SandboxManager, config_from_dict
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler

log = logging.getLogger("raas.pipeline")

HandlerLookup = Callable[[str], TaskHandler]


class Overloaded(RaasError):
    """The service is full; the client should retry after ``retry_after_s``."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, stage="api")
        self.retry_after_s = retry_after_s


class NotAccepting(RaasError):
    """The service is starting or shutting down."""

    kind = "unavailable"


@dataclass
class _Active:
    """A job the service is working on (in memory until it reaches a terminal status)."""

    request: JobRequest
    job: Job
    handler: TaskHandler
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
    task: asyncio.Task[Any] | None = None
    cancel_reason: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: JobResult | None = None
    finishing: bool = False

    def info(self) -> JobInfo:
        return JobInfo(
            job_id=self.job.job_id,
            status=self.status,  # type: ignore[arg-type]
            data_source=self.job.data_source,
            instance_id=self.job.instance_id,
            trajectory_id=self.job.trajectory_id,
            priority=self.priority,
            attempts=self.attempts,
            created_at=self.created_at,
            updated_at=self.updated_at,
        )


class RolloutService:
    """See the module docstring. Use ``await start()`` … ``await shutdown()`` (or ``async with``)."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        sandbox_manager: SandboxManager | None = None,
        balancer: LLMBalancer | None = None,
        tokenizer: ChatTokenizer | None = None,
        handler_lookup: HandlerLookup | None = None,
    ) -> None:
        self.config = config
        self.ledger = Ledger(
            config.ledger_file(), result_ttl_s=config.result_ttl_s, max_results=config.max_results
        )
        self.bus = EventBus()
        self.sandbox_manager = sandbox_manager
        self._owns_manager = sandbox_manager is None
        self.balancer = balancer
        self._owns_balancer = balancer is None
        self.tokenizer = tokenizer
        self._lookup = handler_lookup
        self._sandbox_default: SandboxConfig | None = None
        self._active: dict[str, _Active] = {}
        self._recent: OrderedDict[str, JobResult] = OrderedDict()
        self._queues: dict[StageName, asyncio.PriorityQueue[tuple[int, int, str]]] = {}
        self._running: dict[StageName, int] = dict.fromkeys(STAGES, 0)
        self._workers: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[Any]] = set()
        self._seq = itertools.count()
        self._accepting = False
        self._started = False
        self._stopped = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._finished_counts: dict[str, int] = {}
        self._paused_since: float | None = None
        self._paused_total = 0.0
        self.gauges = CollectorRegistry(auto_describe=True)
        self.gauges.register(
            metrics.StageGaugeCollector(self.stage_snapshot, lambda: len(self.llm_servers()))
        )

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def __aenter__(self) -> RolloutService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Open the ledger, recover what a previous run left, wire the layers and start the pools."""
        if self._started:
            return
        self._started = True
        try:
            await self._start()
        except BaseException:
            # Whatever did start (ledger writer, balancer health task and client) must not outlive a
            # failed start: nobody will call shutdown on a service that never came up.
            await self.shutdown(0)
            raise

    async def _start(self) -> None:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        await self.ledger.open()
        self._register_extra_handlers()
        await self._wire_layers()
        for stage in STAGES:
            self._queues[stage] = asyncio.PriorityQueue()
        recovery = await self.ledger.recover(max_attempts=self.config.max_attempts)
        if recovery.interrupted:
            log.warning("closed %d jobs interrupted by the previous run", len(recovery.interrupted))
            for _ in recovery.interrupted:
                metrics.count_error("queue", "interrupted")
                metrics.count_finished("failed")
        for row in recovery.requeued:
            await self._readmit(row)
        sizes = {
            "init": self.config.init_workers,
            "run": self.config.run_workers,
            "eval": self.config.eval_workers,
        }
        for stage in STAGES:
            for i in range(sizes[stage]):
                self._workers.append(
                    asyncio.create_task(self._worker(stage), name=f"raas-{stage}-worker-{i}")
                )
        self._spawn(self._prune_loop())
        self._accepting = True

    def _register_extra_handlers(self) -> None:
        if not self.config.extra_handlers:
            return
        from raas.tasks import registry

        for name, target in self.config.extra_handlers.items():
            module_name, _, attr = target.partition(":")
            try:
                cls = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError, ValueError) as exc:
                raise RaasError(f"cannot load task handler {target!r}: {exc}", kind="bad_request") from exc
            registry.register(cls, name, replace=True)

    async def _wire_layers(self) -> None:
        """Build the sandbox manager, balancer and tokenizer the config names, unless they were injected."""
        self._sandbox_default = config_from_dict(self.config.sandbox)
        if self.sandbox_manager is None:
            self.sandbox_manager = SandboxManager(self.config.state_dir / "sandboxes")
            await self.sandbox_manager.reap_stale()
        if self.balancer is None:
            # Health checks run for the service's lifetime: a server marked unhealthy after a failed
            # request comes back once it answers again. ``shutdown`` stops them and closes the client.
            self.balancer = LLMBalancer(health_interval_s=self.config.llm_health_interval_s)
            self.balancer.start_health_checks()
        for url in self.config.llm_servers:
            await _maybe_await(self.balancer.add(url))
        if self.tokenizer is None and self.config.tokenizer_dir is not None:
            self.tokenizer = await asyncio.to_thread(ChatTokenizer.from_pretrained, self.config.tokenizer_dir)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight jobs finish for ``grace_s``, interrupt the rest, close everything."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        self._accepting = False
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        if self._active and grace > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace)
        for a in list(self._active.values()):
            await self._cancel(a, "shutdown")
        if self._active:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._idle.wait(), self.config.cancel_grace_s + self.config.hook_timeout_s + 1.0
                )
        for a in list(self._active.values()):  # stuck despite cancel: record it, never drop it silently
            await self._finish_interrupted(a)
        for task in self._workers:
            task.cancel()
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._workers, *self._background, return_exceptions=True)
        self._workers.clear()
        if self._owns_manager and self.sandbox_manager is not None:
            with contextlib.suppress(Exception):
                await self.sandbox_manager.close_all()
        if self._owns_balancer and self.balancer is not None:
            with contextlib.suppress(Exception):
                await self.balancer.aclose()
        self.bus.close()
        await self.ledger.close()

    @property
    def accepting(self) -> bool:
        return self._accepting

    # -- submission --------------------------------------------------------------------------------------

    def handler_for(self, data_source: str) -> TaskHandler:
        """The handler for ``data_source`` or a ``bad_request`` error."""
        try:
            if self._lookup is not None:
                handler = self._lookup(data_source)
            else:
                from raas.tasks.registry import get_handler

                handler = get_handler(data_source)
        except RaasError as exc:
            raise RaasError(exc.message, kind="bad_request", stage="api") from exc
        except Exception as exc:
            raise RaasError(
                f"unknown data_source {data_source!r}: {exc}", kind="bad_request", stage="api"
            ) from exc
        if handler is None:
            raise RaasError(f"unknown data_source {data_source!r}", kind="bad_request", stage="api")
        return handler

    def _validate(self, request: JobRequest) -> TaskHandler:
        handler = self.handler_for(str(request.instance.get("data_source")))
        try:
            handler.validate_instance(request.instance)
        except RaasError as exc:
            raise RaasError(exc.message, kind="bad_request", stage="api") from exc
        except Exception as exc:
            raise RaasError(f"invalid instance: {exc}", kind="bad_request", stage="api") from exc
        return handler

    def _check_accepting(self) -> None:
        if not self._accepting:
            state = "shutting down" if self._stopped else "not started"
            raise NotAccepting(f"the service is {state}", stage="api")

    def _overloaded(self, wanted: int) -> Overloaded:
        return Overloaded(
            f"the service is full ({len(self._active)} of {self.config.max_pending} jobs pending; "
            f"{wanted} more requested)",
            self.config.retry_after_s,
        )

    async def submit(self, request: JobRequest) -> SubmitResponse:
        """Accept a job (durably) or raise: ``bad_request``, :class:`Overloaded`, :class:`NotAccepting`.

        Idempotent on ``job_id``: resubmitting returns the existing job, whatever its state.
        """
        self._check_accepting()
        if request.job_id is not None and request.job_id in self._active:
            a = self._active[request.job_id]
            return SubmitResponse(job_id=request.job_id, status=a.status, created=False)  # type: ignore[arg-type]
        handler = self._validate(request)
        if len(self._active) >= self.config.max_pending:
            raise self._overloaded(1)
        return await self._admit(request, handler)

    async def submit_many(self, requests: Sequence[JobRequest]) -> list[SubmitResponse]:
        """Accept a batch all-or-nothing: any invalid instance or too little room rejects the whole batch."""
        self._check_accepting()
        handlers: list[TaskHandler] = []
        for i, request in enumerate(requests):
            try:
                handlers.append(self._validate(request))
            except RaasError as exc:
                raise RaasError(f"jobs[{i}]: {exc.message}", kind=exc.kind, stage="api") from exc
        ids = [r.job_id for r in requests if r.job_id is not None]
        if len(ids) != len(set(ids)):
            raise RaasError("duplicate job_id within the batch", kind="bad_request", stage="api")
        new = sum(1 for r in requests if r.job_id is None or r.job_id not in self._active)
        if len(self._active) + new > self.config.max_pending:
            raise self._overloaded(new)
        pending: list[Any] = []
        for request, handler in zip(requests, handlers, strict=True):
            if request.job_id is not None and request.job_id in self._active:
                a = self._active[request.job_id]
                pending.append(SubmitResponse(job_id=a.job.job_id, status=a.status, created=False))  # type: ignore[arg-type]
            else:
                # Reserved now, in order; recorded together, so the whole batch shares one commit.
                a = self._reserve(request, handler)
                pending.append(asyncio.ensure_future(self._record_admission(a)))
        return [p if isinstance(p, SubmitResponse) else await asyncio.shield(p) for p in pending]

    async def _admit(self, request: JobRequest, handler: TaskHandler) -> SubmitResponse:
        # Shielded: once reserved, admission completes even if the submitting request goes away.
        return await asyncio.shield(self._record_admission(self._reserve(request, handler)))

    def _reserve(self, request: JobRequest, handler: TaskHandler) -> _Active:
        """Claim the job's place synchronously, so admission limits and idempotency see it at once."""
        job_id = request.job_id or new_job_id()
        instance = request.instance
        trajectory_id = str(instance.get("trajectory_id", job_id))
        job = Job(
            job_id=job_id,
            instance=instance,
            trajectory_id=trajectory_id,
            sampling_params=dict(request.sampling_params or {}),
        )
        a = _Active(
            request=request.model_copy(update={"job_id": job_id}),
            job=job,
            handler=handler,
            status="queued",
            priority=request.priority,
            created_at=time.time(),
            attempts=1,
            budget_s=request.timeout_s or self.config.default_timeout_s,
        )
        self._active[job_id] = a
        self._idle.clear()
        return a

    async def _record_admission(self, a: _Active) -> SubmitResponse:
        job_id, job, request = a.job.job_id, a.job, a.request
        try:
            existing = await self.ledger.insert_job(
                job_id=job_id,
                request=a.request.model_dump(mode="json"),
                data_source=job.data_source,
                instance_id=job.instance_id,
                trajectory_id=job.trajectory_id,
                priority=request.priority,
                retry_on_restart=request.retry_on_restart,
                at=a.created_at,
            )
        except BaseException:
            self._forget(job_id)
            raise
        if existing is not None:
            self._forget(job_id)
            return SubmitResponse(job_id=job_id, status=existing.status, created=False)  # type: ignore[arg-type]
        self._publish(a)
        self._enqueue(a, "init")
        return SubmitResponse(job_id=job_id, status="queued", created=True)

    async def _readmit(self, row: LedgerJob) -> None:
        """Put a job the ledger re-queued after a restart back into the INIT queue."""
        try:
            request = JobRequest.model_validate(row.request)
            handler = self._validate(request)
        except (RaasError, ValueError) as exc:
            result = JobResult(
                job_id=row.job_id,
                instance_id=row.instance_id,
                trajectory_id=row.trajectory_id,
                status="failed",
                error=ErrorInfo(
                    stage="queue", kind="bad_request", message=f"cannot re-queue after restart: {exc}"
                ),
                filter=True,
            )
            await self.ledger.finish(result, time.time())
            return
        job = Job(
            job_id=row.job_id,
            instance=request.instance,
            trajectory_id=row.trajectory_id or row.job_id,
            sampling_params=dict(request.sampling_params or {}),
        )
        a = _Active(
            request=request,
            job=job,
            handler=handler,
            status="queued",
            priority=row.priority,
            created_at=row.created_at,
            attempts=row.attempts,
            budget_s=request.timeout_s or self.config.default_timeout_s,
        )
        self._active[row.job_id] = a
        self._idle.clear()
        self._publish(a)
        self._enqueue(a, "init")

    def _forget(self, job_id: str) -> None:
        self._active.pop(job_id, None)
        if not self._active:
            self._idle.set()

    # -- queries -----------------------------------------------------------------------------------------

    async def get(self, job_id: str) -> JobInfo:
        a = self._active.get(job_id)
        if a is not None:
            return a.info()
        row = await self.ledger.get(job_id)
        if row is None:
            raise RaasError(f"no job {job_id!r}", kind="not_found", stage="api")
        return row.info()

    async def result(self, job_id: str) -> JobResult | None:
        """The result if the job finished, None if it is still running; ``not_found`` if unknown."""
        if job_id in self._recent:
            return self._recent[job_id]
        a = self._active.get(job_id)
        if a is not None:
            return a.result
        row = await self.ledger.get(job_id)
        if row is None:
            raise RaasError(f"no job {job_id!r}", kind="not_found", stage="api")
        return JobResult.model_validate(row.result) if row.result else None

    async def wait(self, job_id: str, timeout: float | None) -> JobResult | None:  # noqa: ASYNC109
        """Long-poll: the result once the job finishes, or None after ``timeout`` seconds."""
        a = self._active.get(job_id)
        if a is not None and a.result is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(a.done.wait()), timeout)
            if a.result is not None:
                return a.result
        return await self.result(job_id)

    @contextlib.asynccontextmanager
    async def events(self) -> AsyncIterator[Subscription]:
        """Subscribe to job state changes (see :class:`~raas.pipeline.events.EventBus`)."""
        async with self.bus.subscribe() as sub:
            yield sub

    def stage_snapshot(self) -> dict[str, dict[str, int]]:
        workers = {
            "init": self.config.init_workers,
            "run": self.config.run_workers,
            "eval": self.config.eval_workers,
        }
        queued = dict.fromkeys(STAGES, 0)
        for a in self._active.values():
            for stage in STAGES:
                if a.status == QUEUED_FOR[stage]:
                    queued[stage] += 1
        return {s: {"queued": queued[s], "active": self._running[s], "workers": workers[s]} for s in STAGES}

    # -- LLM pause (weight sync) ----------------------------------------------------------------------

    def llm_paused_s(self) -> float:
        """Seconds the LLM has been paused through this service, in total (a monotonic clock)."""
        current = time.monotonic() - self._paused_since if self._paused_since is not None else 0.0
        return self._paused_total + current

    async def pause_llm(self) -> None:
        """Stop new generate calls and wait for in-flight ones (weight sync). Time RUN stages spend paused
        does not count against their budget."""
        if self.balancer is None:
            raise RaasError("the LLM layer is not available in this service", kind="unavailable", stage="api")
        if self._paused_since is None:
            self._paused_since = time.monotonic()
        await _maybe_await(self.balancer.pause())

    async def resume_llm(self) -> None:
        if self.balancer is None:
            raise RaasError("the LLM layer is not available in this service", kind="unavailable", stage="api")
        await _maybe_await(self.balancer.resume())
        if self._paused_since is not None:
            self._paused_total += time.monotonic() - self._paused_since
            self._paused_since = None

    def llm_servers(self) -> list[dict[str, Any]]:
        if self.balancer is None:
            return []
        return self.balancer.servers()

    def status(self) -> dict[str, Any]:
        return {
            "accepting": self._accepting,
            "pending": len(self._active),
            "max_pending": self.config.max_pending,
            "stages": self.stage_snapshot(),
            "finished": dict(self._finished_counts),
            "llm_servers": self.llm_servers(),
            "llm_available": self.balancer is not None,
            "llm_paused": bool(getattr(self.balancer, "paused", False)),
        }

    # -- cancel ------------------------------------------------------------------------------------------

    async def cancel(self, job_id: str) -> JobInfo:
        """Stop a job wherever it is and release its sandboxes. Idempotent; ``not_found`` if unknown."""
        a = self._active.get(job_id)
        if a is None:
            return await self.get(job_id)
        await self._cancel(a, "cancelled")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(a.done.wait()), self.config.cancel_grace_s + 1.0)
        return a.info()

    async def _cancel(self, a: _Active, reason: str) -> None:
        if a.result is not None or a.cancel_reason is not None:
            return
        a.cancel_reason = reason
        if a.status in ("queued", "queued_run", "queued_eval"):
            # Owned by the service, not the caller: a dropped HTTP request must not half-abort a job.
            self._spawn(self._abort(a, "queue", _cancel_error(reason, "queue")))
        elif a.task is not None and not a.task.done():
            a.task.cancel()
        # else: between a stage's end and the next enqueue; the worker sees cancel_reason and stops there.

    # -- the pools ---------------------------------------------------------------------------------------

    def _enqueue(self, a: _Active, stage: StageName) -> None:
        a.enqueued_at = time.monotonic()
        if stage != "init":
            self._set_status(a, QUEUED_FOR[stage])
        self._queues[stage].put_nowait((-a.priority, next(self._seq), a.job.job_id))

    async def _worker(self, stage: StageName) -> None:
        queue = self._queues[stage]
        while True:
            _, _, job_id = await queue.get()
            a = self._active.get(job_id)
            if a is None or a.status != QUEUED_FOR[stage] or a.cancel_reason is not None:
                continue  # cancelled while it waited
            self._running[stage] += 1
            try:
                await self._run_stage(stage, a)
            except asyncio.CancelledError:
                if a.task is not None and not a.task.done():
                    a.task.cancel()
                raise
            except Exception as exc:  # a bug in the pipeline itself: record it, keep the worker alive
                log.exception("pipeline error on job %s in %s", job_id, stage)
                a.cancel_reason = a.cancel_reason or "internal"
                await self._abort(
                    a,
                    stage,
                    RaasError(f"internal pipeline error: {exc}", kind="internal", stage=stage),
                    tb=traceback.format_exc(),
                )
            finally:
                self._running[stage] -= 1

    async def _run_stage(self, stage: StageName, a: _Active) -> None:
        wait = time.monotonic() - a.enqueued_at
        a.queue_s += wait
        metrics.observe_queue_wait(stage, wait)
        if a.sandboxes is None:
            a.sandboxes = JobSandboxes(self.sandbox_manager, self._sandbox_default, a.job.job_id)
        remaining = a.budget_s - a.counted_s
        ceiling = getattr(self.config.stage_timeouts, stage)
        limit = remaining if ceiling is None else min(remaining, ceiling)
        self._set_status(a, stage)
        if limit <= 0:
            await self._abort(a, stage, _timeout_error(stage, a, ceiling))
            return
        a.task = asyncio.create_task(self._stage_coro(stage, a), name=f"raas-{stage}-{a.job.job_id}")
        started = time.monotonic()
        paused_at_start = self.llm_paused_s()
        used = 0.0
        try:
            while True:
                done, _ = await asyncio.wait({a.task}, timeout=max(0.0, limit - used))
                used = time.monotonic() - started
                if stage == "run":  # waiting out an LLM pause (weight sync) is not the job's time
                    used -= self.llm_paused_s() - paused_at_start
                if done or used >= limit:
                    break
        finally:
            elapsed = time.monotonic() - started
            a.counted_s += used
            a.stage_s[stage] += elapsed
        task, a.task = a.task, None
        if not done:
            task.cancel()
            await _drain(task, self.config.cancel_grace_s)
            metrics.observe_stage(stage, elapsed, "timeout")
            await self._abort(a, stage, _timeout_error(stage, a, ceiling, used))
            return
        if a.cancel_reason is not None or task.cancelled():
            if not task.cancelled():
                task.exception()  # it ended on its own as the cancel arrived: the cancel wins, quietly
            metrics.observe_stage(stage, elapsed, "cancelled")
            await self._abort(a, stage, _cancel_error(a.cancel_reason or "cancelled", stage))
            return
        exc = task.exception()
        if exc is not None:
            metrics.observe_stage(stage, elapsed, "error")
            tb = "".join(traceback.format_exception(exc))
            await self._abort(a, stage, exc, tb=tb)
            return
        metrics.observe_stage(stage, elapsed, "ok")
        value = task.result()
        if stage == "init":
            if not isinstance(value, Env):
                await self._abort(a, stage, _wrong_type(stage, "Env", value))
                return
            value.sandboxes = a.sandboxes
            a.env = value
            self._next(a, "run")
        elif stage == "run":
            if not isinstance(value, RunOutput):
                await self._abort(a, stage, _wrong_type(stage, "RunOutput", value))
                return
            a.run_output = value
            assert a.env is not None
            a.env.run_output = value
            a.env.sandbox = None
            closing = time.monotonic()
            await a.sandboxes.close_all()  # the RUN sandbox goes before EVAL starts
            a.stage_s["run"] += time.monotonic() - closing  # reported as RUN time, not budgeted
            self._next(a, "eval")
        else:
            if not isinstance(value, EvalOutput):
                await self._abort(a, stage, _wrong_type(stage, "EvalOutput", value))
                return
            closing = time.monotonic()
            await self._release(a)
            a.stage_s["eval"] += time.monotonic() - closing
            await self._complete(a, value)

    async def _stage_coro(self, stage: StageName, a: _Active) -> Any:
        assert a.sandboxes is not None
        if stage == "init":
            return await a.handler.init(a.job, a.sandboxes)
        assert a.env is not None
        if stage == "run":
            return await a.handler.run(a.job, a.env, self._llm_context(a))
        return await a.handler.eval(a.job, a.env)

    def _next(self, a: _Active, stage: StageName) -> None:
        if a.cancel_reason is not None:
            self._spawn(self._abort(a, "queue", _cancel_error(a.cancel_reason, "queue")))
            return
        self._enqueue(a, stage)

    def _llm_context(self, a: _Active) -> LLMContext:
        agent = self.config.agent
        overrides = agent_overrides(a.job.sampling_params)
        if overrides:
            try:
                agent = AgentConfig.model_validate({**agent.model_dump(), **overrides})
            except ValueError as exc:
                raise RaasError(
                    f"invalid agent settings in sampling_params: {exc}", kind="bad_request"
                ) from exc
        return LLMContext(balancer=self.balancer, tokenizer=self.tokenizer, agent=agent)

    # -- endings -----------------------------------------------------------------------------------------

    async def _release(self, a: _Active) -> None:
        """Close the job's sandboxes, then ask the manager to close anything it still holds for the job."""
        if a.sandboxes is not None:
            await a.sandboxes.close_all()
        if a.env is not None:
            a.env.sandbox = None
        if self.balancer is not None:
            self.balancer.release(a.job.trajectory_id)  # unpin, whatever the handler did
        try:
            await asyncio.shield(self.sandbox_manager.close_owner(a.job.job_id))
        except Exception:
            log.exception("close_owner failed for job %s", a.job.job_id)

    async def _abort(self, a: _Active, stage: str, exc: BaseException, tb: str | None = None) -> None:
        """End a job that failed, timed out or was cancelled: error hook, release, typed result."""
        if a.finishing:
            return
        a.finishing = True
        hook_stage = stage if stage in STAGES else _waiting_for(a.status)
        cleanup = time.monotonic()
        try:
            await asyncio.wait_for(
                a.handler.on_error(hook_stage, a.job, a.env, exc), self.config.hook_timeout_s
            )
        except Exception:
            log.exception("on_error hook failed for job %s", a.job.job_id)
        await self._release(a)
        if stage in STAGES:  # the hook and the clean-up are reported as part of the stage
            a.stage_s[stage] += time.monotonic() - cleanup
        if isinstance(exc, RaasError):
            kind, message = exc.kind, exc.message
        elif isinstance(exc, asyncio.CancelledError):
            kind, message = "cancelled", "cancelled"
        else:
            kind, message = "handler_error", f"{type(exc).__name__}: {exc}"
        if kind == "timeout":
            status = "timeout"
        elif kind == "cancelled":
            status = "cancelled"
        else:
            status = "failed"
        if a.cancel_reason == "shutdown":
            if a.request.retry_on_restart:
                await self._leave_for_restart(a)
                return
            status, kind = "failed", "interrupted"
            message = "the service shut down while the job was in flight"
        error = ErrorInfo(stage=stage, kind=kind, message=message)
        artifacts: dict[str, Any] = {}
        if tb:
            artifacts["traceback"] = tb
        await self._finish(a, status, error=error, artifacts=artifacts)

    async def _complete(self, a: _Active, out: EvalOutput) -> None:
        if a.finishing:
            return
        a.finishing = True
        artifacts: dict[str, Any] = {}
        if a.run_output is not None:
            artifacts.update(a.run_output.artifacts)
            artifacts["finish_reason"] = a.run_output.finish_reason
            if a.run_output.answer is not None:
                artifacts["answer"] = a.run_output.answer
            if a.run_output.metrics:
                artifacts["metrics"] = a.run_output.metrics
        artifacts.update(out.artifacts)
        if out.details:
            artifacts["eval_details"] = out.details
        if out.reward is None or not math.isfinite(out.reward):
            error = ErrorInfo(
                stage="eval", kind="handler_error", message="evaluation produced no usable reward"
            )
            await self._finish(a, "failed", error=error, artifacts=artifacts, resolved=out.resolved)
            return
        await self._finish(
            a, "completed", reward=float(out.reward), resolved=out.resolved, artifacts=artifacts
        )

    async def _finish(
        self,
        a: _Active,
        status: str,
        *,
        reward: float | None = None,
        resolved: bool | None = None,
        error: ErrorInfo | None = None,
        artifacts: dict[str, Any] | None = None,
    ) -> None:
        run = a.run_output
        arts = dict(artifacts or {})
        if run is not None and "finish_reason" not in arts:
            arts.update(run.artifacts)
            arts["finish_reason"] = run.finish_reason
        result = JobResult(
            job_id=a.job.job_id,
            instance_id=a.job.instance_id,
            trajectory_id=a.job.trajectory_id,
            status=status,  # type: ignore[arg-type]
            reward=reward if status == "completed" else None,
            resolved=resolved,
            error=error,
            filter=status != "completed",
            messages=run.messages if run else [],
            turns=run.turns if run else [],
            token_trajectory=run.token_trajectory if run else TokenTrajectory(),
            artifacts=arts,
            timing=Timing(
                queue_s=a.queue_s,
                init_s=a.stage_s["init"],
                run_s=a.stage_s["run"],
                eval_s=a.stage_s["eval"],
                total_s=time.monotonic() - a.t0,
            ),
        )
        now = time.time()
        try:
            await asyncio.shield(self.ledger.finish(result, now))
        except RaasError:
            log.exception("could not record the result of job %s", a.job.job_id)
        a.result = result
        a.status = status
        a.updated_at = now
        self._remember(result)
        self._forget(a.job.job_id)
        self._finished_counts[status] = self._finished_counts.get(status, 0) + 1
        metrics.count_finished(status)
        if error is not None:
            metrics.count_error(error.stage, error.kind)
        a.done.set()
        self.bus.publish(
            JobEvent(
                job_id=a.job.job_id,
                status=status,
                at=now,
                reward=result.reward,  # type: ignore[arg-type]
                filter=result.filter,
                error=error,
            )
        )

    async def _leave_for_restart(self, a: _Active) -> None:
        """Shutdown hit a ``retry_on_restart`` job: leave it queued in the ledger for the next start."""
        now = time.time()
        self.ledger.transition(a.job.job_id, "queued", now, "interrupted by shutdown; re-queued for restart")
        a.status = "queued"
        self._forget(a.job.job_id)
        a.done.set()

    async def _finish_interrupted(self, a: _Active) -> None:
        if a.result is not None:
            return
        a.finishing = True
        if a.request.retry_on_restart:
            await self._leave_for_restart(a)
            return
        error = ErrorInfo(
            stage=_stage_of(a.status),
            kind="interrupted",
            message="the service shut down and the job did not stop in time",
        )
        await self._finish(a, "failed", error=error)

    def _remember(self, result: JobResult) -> None:
        self._recent[result.job_id] = result
        while len(self._recent) > self.config.result_cache_size:
            self._recent.popitem(last=False)

    def _set_status(self, a: _Active, status: str) -> None:
        a.status = status
        a.updated_at = time.time()
        self.ledger.transition(a.job.job_id, status, a.updated_at)
        self._publish(a)

    def _publish(self, a: _Active) -> None:
        self.bus.publish(JobEvent(job_id=a.job.job_id, status=a.status, at=a.updated_at))  # type: ignore[arg-type]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _prune_loop(self) -> None:
        while True:
            try:
                removed = await self.ledger.prune()
                if removed:
                    log.info("pruned %d finished jobs from the ledger", removed)
            except RaasError:
                log.exception("ledger prune failed")
            await asyncio.sleep(self.config.prune_interval_s)


# -- helpers -----------------------------------------------------------------------------------------------


async def _maybe_await(value: Any) -> Any:
    if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future):
        return await value
    return value


async def _drain(task: asyncio.Task[Any], grace: float) -> None:
    """Give a cancelled stage ``grace`` seconds to unwind; a stage that ignores cancellation is left behind."""
    done, _ = await asyncio.wait({task}, timeout=grace)
    if not done:
        log.error("stage task %s ignored cancellation for %.1fs", task.get_name(), grace)
    elif not task.cancelled():
        task.exception()  # mark retrieved


def _timeout_error(stage: str, a: _Active, ceiling: float | None, used: float = 0.0) -> RaasError:
    if ceiling is not None and used >= ceiling - 1e-6 and a.counted_s < a.budget_s - 1e-6:
        message = f"{stage} exceeded its stage limit of {ceiling:g}s"
    else:
        message = f"the job used its {a.budget_s:g}s budget of in-stage time (stopped in {stage})"
    return RaasError(message, kind="timeout", stage=stage)


def _cancel_error(reason: str, stage: str) -> RaasError:
    if reason == "shutdown":
        return RaasError("the service is shutting down", kind="interrupted", stage=stage)
    return RaasError(
        f"cancelled ({reason})" if reason != "cancelled" else "cancelled by request",
        kind="cancelled",
        stage=stage,
    )


def _wrong_type(stage: str, expected: str, value: Any) -> RaasError:
    return RaasError(
        f"the handler's {stage}() returned {type(value).__name__}, expected {expected}",
        kind="handler_error",
        stage=stage,
    )


def _waiting_for(status: str) -> str:
    return {"queued": "init", "queued_run": "run", "queued_eval": "eval"}.get(status, status)


def _stage_of(status: str) -> str:
    return status if status in STAGES else "queue"
