"""The rollout service: the one object the API (and in-process users) talk to.

A façade over its parts, each in its own module: :mod:`~raas.pipeline.wiring` (the sandbox manager, LLM
balancer, tokenizer and handler registry), :mod:`~raas.pipeline.table` (active jobs, state changes),
:mod:`~raas.pipeline.admission`, :mod:`~raas.pipeline.scheduler` (the INIT, RUN and EVAL pools, driven by
one stage table), :mod:`~raas.pipeline.clock` (job budgets), :mod:`~raas.pipeline.endings` and
:mod:`~raas.pipeline.results`, on the durable :mod:`~raas.pipeline.ledger`.

Lifetimes: each job owns a :class:`~raas.tasks.base.JobSandboxes`; the service closes it after RUN (before
EVAL), after EVAL and on any failure, timeout or cancel, then calls ``SandboxManager.close_owner(job_id)``
as a safety net. Every accepted job ends in exactly one typed result, written to the ledger before anyone
is told it finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from raas.core import metrics
from raas.core.jobs import JobInfo, JobRequest, JobResult, SubmitResponse
from raas.errors import RaasError
from raas.gateway import Gateway
from raas.llm import ChatTokenizer, LLMBalancer
from raas.pipeline.admission import Admission
from raas.pipeline.autosize import Resizable, WorkerAutosizer, auto_worker_bounds
from raas.pipeline.clock import PauseClock
from raas.pipeline.config import ServiceConfig
from raas.pipeline.endings import Endings
from raas.pipeline.events import EventBus, Subscription
from raas.pipeline.ledger import Ledger
from raas.pipeline.lookup import stored_result, wait_result
from raas.pipeline.scheduler import Scheduler
from raas.pipeline.table import JobTable
from raas.pipeline.wiring import Layers
from raas.sandbox import SandboxManager
from raas.tasks.registry import HandlerRegistry

log = logging.getLogger("raas.pipeline")


class RolloutService:
    """See the module docstring. Use ``await start()`` … ``await shutdown()`` (or ``async with``).

    ``sandbox_manager``, ``balancer`` and ``tokenizer`` may be injected (they then belong to the caller);
    ``handlers`` is this service's own handler registry (default: built-ins and installed plug-ins), to
    which ``config.extra_handlers`` are added at start."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        sandbox_manager: SandboxManager | None = None,
        balancer: LLMBalancer | None = None,
        tokenizer: ChatTokenizer | None = None,
        handlers: HandlerRegistry | None = None,
    ) -> None:
        self.config = config
        self.ledger = Ledger(
            config.ledger_file(), result_ttl_s=config.result_ttl_s, max_results=config.max_results
        )
        self.bus = EventBus()
        self.layers = Layers(
            config, sandbox_manager=sandbox_manager, balancer=balancer, tokenizer=tokenizer, handlers=handlers
        )
        self.table = JobTable(self.ledger, self.bus, config.result_cache_size)
        self.layers.group_pending = self.table.group_pending
        self.layers.sandbox_opened = self.table.sandbox_opened
        self.layers.commit_turn = self.table.commit_turn
        self.pauses = PauseClock()
        self.endings = Endings(self.layers, self.table, config.hook_timeout_s)
        self._auto_bounds = auto_worker_bounds(config)
        workers = {
            f"{s}_workers": self._auto_bounds[s].start
            if s in self._auto_bounds
            else getattr(config, f"{s}_workers")
            for s in ("init", "run", "eval")
        }
        self.scheduler = Scheduler(
            workers, self.layers, self.table, self.endings, self.pauses, config.cancel_grace_s
        )
        self.layers.init_backlog = self.scheduler.pools["init"].waiting
        self.admission = Admission(
            self.layers,
            self.table,
            self.scheduler,
            max_pending=config.max_pending,
            retry_after_s=config.retry_after_s,
            default_timeout_s=config.default_timeout_s,
        )
        self._started = False
        self.gauges = CollectorRegistry(auto_describe=True)
        self.gauges.register(
            metrics.StageGaugeCollector(self.stage_snapshot, lambda: len(self.llm_servers()))
        )
        self.gauges.register(metrics.PoolGaugeCollector(self.layers.warm_pools))

    # -- the layers (read-only views) --------------------------------------------------------------------

    @property
    def sandbox_manager(self) -> SandboxManager | None:
        return self.layers.sandbox_manager

    @property
    def balancer(self) -> LLMBalancer | None:
        return self.layers.balancer

    @property
    def tokenizer(self) -> ChatTokenizer | None:
        return self.layers.tokenizer

    @property
    def gateway(self) -> Gateway | None:
        """The agent gateway (built at start), whose routes the API mounts at ``/gateway``."""
        return self.layers.gateway

    @property
    def handlers(self) -> HandlerRegistry:
        return self.layers.handlers

    @property
    def accepting(self) -> bool:
        return self.admission.accepting

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def __aenter__(self) -> RolloutService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Open the ledger, wire the layers, recover what a previous run left, and start accepting."""
        if self._started:
            return
        self._started = True
        try:
            self.config.state_dir.mkdir(parents=True, exist_ok=True)
            await self.ledger.open()
            await self.layers.start()
            self.handlers.warm_up()
            recovery = await self.ledger.recover(
                max_attempts=self.config.max_attempts, resume_in_run=self.layers.resume_in_run
            )
            if recovery.interrupted:
                log.warning("closed %d jobs interrupted by the previous run", len(recovery.interrupted))
                for _ in recovery.interrupted:
                    metrics.count_error("queue", "interrupted")
                    metrics.count_finished("failed")
            for _ in recovery.cancelled:
                metrics.count_finished("cancelled")
            if recovery.resumed or recovery.requeued or recovery.replayed:
                log.info(
                    "after a restart: %d jobs resume at EVAL, %d replay their committed turns, %d run "
                    "again from INIT",
                    len(recovery.resumed),
                    len(recovery.replayed),
                    len(recovery.requeued),
                )
            # in their old order (created_at) within each queue, with their priorities
            for resumed in recovery.resumed:
                await self.admission.readmit(resumed.job, resumed.checkpoint)
            for replayed in recovery.replayed:
                await self.admission.readmit(replayed.job, replay=replayed.checkpoint["turns"])
            for row in recovery.requeued:
                await self.admission.readmit(row)
            self.scheduler.spawn(self._prune_loop(), name="raas-ledger-prune")
            if self._auto_bounds:
                auto: dict[str, Resizable] = {
                    str(s): p for s, p in self.scheduler.pools.items() if s in self._auto_bounds
                }
                sizer = WorkerAutosizer(
                    auto,
                    self._auto_bounds,
                    on_change=self.scheduler.resized,
                )
                self.scheduler.spawn(sizer.run(), name="raas-auto-workers")
            self.admission.accepting = True
        except BaseException:
            # Whatever did start (ledger writer, balancer health task and client) must not outlive a
            # failed start: nobody will call shutdown on a service that never came up.
            await self.shutdown(0)
            raise

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting, let in-flight jobs finish for ``grace_s``, interrupt the rest, close everything."""
        if not self._started or self.admission.stopped:
            return
        self.admission.stopped = True
        self.admission.accepting = False
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        if len(self.table) and grace > 0:
            await self.table.wait_idle(grace)
        for a in self.table.jobs():
            self.scheduler.cancel(a, "shutdown")
        if len(self.table):
            await self.table.wait_idle(self.config.cancel_grace_s + self.config.hook_timeout_s + 1.0)
        for a in self.table.jobs():  # stuck despite cancel: record it, never drop it silently
            await self.endings.interrupt_stuck(a)
        await self.scheduler.stop()
        await self.layers.close()
        self.bus.close()
        await self.ledger.close()

    async def _prune_loop(self) -> None:
        """Retention: drop finished jobs past ``result_ttl_s`` / ``max_results`` from the ledger."""
        while True:
            try:
                removed = await self.ledger.prune()
                if removed:
                    log.info("pruned %d finished jobs from the ledger", removed)
            except RaasError:
                log.exception("ledger prune failed")
            await asyncio.sleep(self.config.prune_interval_s)

    # -- jobs --------------------------------------------------------------------------------------------

    async def submit(self, request: JobRequest) -> SubmitResponse:
        """Accept a job durably (idempotent on ``job_id``); see :mod:`raas.pipeline.admission`."""
        return await self.admission.submit(request)

    async def submit_many(self, requests: Sequence[JobRequest]) -> list[SubmitResponse]:
        """Accept a batch, all or nothing."""
        return await self.admission.submit_many(requests)

    async def get(self, job_id: str) -> JobInfo:
        a = self.table.get(job_id)
        if a is not None:
            return a.info()
        row = await self.ledger.get(job_id)
        if row is None:
            raise RaasError(f"no job {job_id!r}", kind="not_found", stage="api")
        return row.info()

    async def result(self, job_id: str) -> JobResult | None:
        """The result if the job finished, None if it is still running; ``not_found`` if unknown."""
        cached = self.table.cached_result(job_id)
        if cached is not None:
            return cached
        a = self.table.get(job_id)
        if a is not None:
            return a.result
        return await stored_result(self.ledger, job_id)

    async def wait(self, job_id: str, timeout: float | None) -> JobResult | None:  # noqa: ASYNC109
        """Long-poll: the result once the job finishes, or None after ``timeout`` seconds."""
        return await wait_result(self.table.get(job_id), timeout, lambda: self.result(job_id))

    async def cancel(self, job_id: str) -> JobInfo:
        """Stop a job wherever it is and release its sandboxes. Idempotent; ``not_found`` if unknown."""
        a = self.table.get(job_id)
        if a is None:
            return await self.get(job_id)
        if a.result is None and a.cancel_reason is None:
            # acknowledged is durable: a restart before the cancelled result is written still cancels it
            await self.ledger.request_cancel(job_id, time.time())
        self.scheduler.cancel(a, "cancelled")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(a.done.wait()), self.config.cancel_grace_s + 1.0)
        return a.info()

    @contextlib.asynccontextmanager
    async def events(self) -> AsyncIterator[Subscription]:
        """Subscribe to job state changes (see :class:`~raas.pipeline.events.EventBus`)."""
        async with self.bus.subscribe() as sub:
            yield sub

    def close_event_streams(self) -> None:
        """End every event subscription now (an open SSE stream would hold a server's graceful stop)."""
        self.bus.close()

    def stage_snapshot(self) -> dict[str, dict[str, int]]:
        return self.scheduler.snapshot()

    def status(self) -> dict[str, Any]:
        return {
            "accepting": self.accepting,
            "pending": len(self.table),
            "max_pending": self.config.max_pending,
            "stages": self.stage_snapshot(),
            "finished": dict(self.table.finished_counts),
            "llm_servers": self.llm_servers(),
            "llm_available": self.balancer is not None,
            "llm_paused": bool(self.balancer is not None and self.balancer.paused),
            "warm_pools": self.layers.warm_pools(),
        }

    # -- inference servers and weight sync ---------------------------------------------------------------

    def llm_servers(self) -> list[dict[str, Any]]:
        return self.layers.llm_servers()

    def add_llm_server(self, address: str, *, weight_version: str | None = None, kind: str = "auto") -> None:
        """Register an inference server (re-adding one updates its weight version)."""
        self.layers.add_llm_server(address, weight_version=weight_version, kind=kind)

    def remove_llm_server(self, address: str) -> None:
        """Forget an inference server; ``not_found`` if it is not registered."""
        known = {str(s.get("address", "")).rstrip("/") for s in self.llm_servers()}
        if address.rstrip("/") not in known:
            raise RaasError(f"no LLM server {address!r}", kind="not_found", stage="api")
        self.layers.remove_llm_server(address)

    def clear_llm_servers(self) -> None:
        self.layers.clear_llm_servers()

    def llm_paused_s(self) -> float:
        """Seconds the LLM has been paused through this service, in total (a monotonic clock)."""
        return self.pauses.paused_s()

    async def pause_llm(self) -> None:
        """Stop new generate calls and wait for in-flight ones (weight sync). Time RUN stages spend paused
        does not count against their budget."""
        balancer = self.layers.require_balancer()
        self.pauses.pause()
        await balancer.pause()

    async def resume_llm(self) -> None:
        self.layers.require_balancer().resume()
        self.pauses.resume()
