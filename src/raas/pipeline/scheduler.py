"""The stage scheduler: one pool of workers per stage, fed by priority-then-FIFO queues, driven by one table.

:data:`STAGE_TABLE` says, for each stage, what runs (the handler call), what it must return, where its
timeout ceiling comes from (the job's :class:`~raas.core.policy.StagePolicy`), whether LLM-pause time is
free, whether the job's sandboxes close when it succeeds, and which stage follows. Nothing else in the
pipeline dispatches on a stage's name.

Why one pool per stage: sandbox start-up, generation and test suites cost very different amounts; a slow
EVAL never holds a RUN worker, so the policy server stays busy. Within a pool, a ``data_source`` may hold
at most its policy's ``max_share`` of the workers: a job over its share waits in the queue without blocking
the jobs of other data sources behind it, so a ten-minute SWE evaluation cannot starve math.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import logging
import time
import traceback
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

from raas.core import metrics
from raas.core.jobs import QUEUED_FOR, STAGES, StageName
from raas.core.trajectory import EvalOutput, RunOutput
from raas.errors import RaasError
from raas.llm import LLMBalancer
from raas.pipeline.clock import Budget, PauseClock, run_within
from raas.pipeline.endings import Endings
from raas.pipeline.external import is_external, run_external
from raas.pipeline.prewarm import Prewarm
from raas.pipeline.table import ActiveJob, JobTable, settle
from raas.pipeline.turns import TurnRecorder
from raas.pipeline.wiring import Layers
from raas.tasks.base import Env

log = logging.getLogger("raas.pipeline")


# -- the stage table -------------------------------------------------------------------------------------


async def _call_init(a: ActiveJob, layers: Layers) -> object:
    assert a.sandboxes is not None
    return await a.handler.init(a.job, a.sandboxes)


async def _call_run(a: ActiveJob, layers: Layers) -> object:
    assert a.env is not None
    if is_external(a, layers):  # the agent runs outside raas and talks to the gateway
        return await run_external(a, layers)
    llm = layers.llm_context(a.job)
    if a.policy.resume == "replay" and layers.commit_turn is not None and layers.config.checkpoints:
        recorder = TurnRecorder(llm.balancer, functools.partial(layers.commit_turn, a.job_id), a.replay or ())
        llm.balancer = cast(LLMBalancer, recorder)
        try:
            return await a.handler.run(a.job, a.env, llm)
        finally:
            a.replayed_turns = recorder.replayed
    return await a.handler.run(a.job, a.env, llm)


async def _call_eval(a: ActiveJob, layers: Layers) -> object:
    assert a.env is not None
    if a.prewarm is not None:  # waiting for a prewarm still under way is EVAL time
        a.env.prewarmed = await a.prewarm.take()
        a.env.prewarm_error = a.prewarm.error
    return await a.handler.eval(a.job, a.env)


def _keep_env(a: ActiveJob, env: Any) -> None:
    env.sandboxes = a.sandboxes
    a.env = env


def _keep_run_output(a: ActiveJob, out: Any) -> None:
    a.run_output = out
    assert a.env is not None
    a.env.run_output = out
    if a.replay is not None:  # resumed after a restart: say how much of RUN was replayed, not sampled
        out.artifacts["resumed"] = {"replayed_turns": a.replayed_turns, "committed_turns": len(a.replay)}


def _keep_nothing(a: ActiveJob, out: Any) -> None:
    pass


@dataclass(frozen=True)
class StageSpec:
    """One row of the stage table."""

    name: StageName
    workers: str
    """The ``ServiceConfig`` field sizing this stage's pool."""
    call: Callable[[ActiveJob, Layers], Coroutine[Any, Any, object]]
    returns: type
    keep: Callable[[ActiveJob, Any], None]
    """Store the stage's value on the job."""
    close_sandboxes: bool
    """On success, close the job's sandboxes before the next stage (reported as this stage's time)."""
    llm_pause_free: bool
    """Time the LLM spends paused through the service does not count against the budget."""
    next: StageName | None
    """The stage that follows; None: the job is complete."""
    checkpoint: bool = False
    """Commit the stage's output to the ledger before the next stage (a restart resumes the job there)."""
    prewarm: bool = False
    """Start the handler's EVAL prewarm (:meth:`TaskHandler.prewarm_eval`, if it has one) alongside this
    stage; EVAL receives what it produced, and its sandboxes are closed when the job ends."""


STAGE_TABLE: dict[StageName, StageSpec] = {
    "init": StageSpec("init", "init_workers", _call_init, Env, _keep_env, False, False, "run"),
    "run": StageSpec(
        "run",
        "run_workers",
        _call_run,
        RunOutput,
        _keep_run_output,
        True,
        True,
        "eval",
        checkpoint=True,
        prewarm=True,
    ),
    "eval": StageSpec("eval", "eval_workers", _call_eval, EvalOutput, _keep_nothing, False, False, None),
}
assert tuple(STAGE_TABLE) == STAGES


# -- one stage's pool ------------------------------------------------------------------------------------


class StagePool:
    """The jobs waiting for one stage, per ``data_source`` (each a heap on (-priority, arrival)), and the
    jobs inside it. :meth:`pop_next` takes the best waiting job whose data source is under its share."""

    def __init__(self, stage: StageName, workers: int) -> None:
        self.stage = stage
        self.workers = workers
        self.running = 0
        self._by_source: Counter[str] = Counter()
        self._waiting: dict[str, list[tuple[int, int, str]]] = {}
        self._limits: dict[str, int] = {}

    def waiting(self) -> int:
        """Jobs waiting for this stage (cancelled ones not yet dropped included): O(data sources)."""
        return sum(len(heap) for heap in self._waiting.values())

    def push(self, a: ActiveJob, seq: int) -> None:
        source = a.data_source
        self._limits[source] = a.policy.max_share.limit(self.stage, self.workers)
        heapq.heappush(self._waiting.setdefault(source, []), (-a.priority, seq, a.job_id))

    def pop_next(self, table: JobTable) -> ActiveJob | None:
        if self.running >= self.workers:
            return None
        best: tuple[tuple[int, int, str], str] | None = None
        for source, heap in list(self._waiting.items()):
            while heap:  # drop jobs cancelled (or ended) while they waited
                waiting = table.get(heap[0][2])
                if waiting is not None and waiting.waiting_for(self.stage):
                    break
                heapq.heappop(heap)
            if not heap:
                del self._waiting[source]
                continue
            if self._by_source[source] >= self._limits[source]:
                continue  # over its share: it waits, the others go ahead
            if best is None or heap[0] < best[0]:
                best = (heap[0], source)
        if best is None:
            return None
        heapq.heappop(self._waiting[best[1]])
        a = table.get(best[0][2])
        assert a is not None
        self.running += 1
        self._by_source[best[1]] += 1
        return a

    def done(self, a: ActiveJob) -> None:
        self.running -= 1
        self._by_source[a.data_source] -= 1


# -- the scheduler ---------------------------------------------------------------------------------------


def cancel_error(reason: str, stage: str) -> RaasError:
    if reason == "shutdown":
        return RaasError("the service is shutting down", kind="interrupted", stage=stage)
    message = f"cancelled ({reason})" if reason != "cancelled" else "cancelled by request"
    return RaasError(message, kind="cancelled", stage=stage)


class Scheduler:
    """Moves jobs through :data:`STAGE_TABLE`; owns every task it starts (stage slots, cancels)."""

    def __init__(
        self,
        workers: dict[str, int],
        layers: Layers,
        table: JobTable,
        endings: Endings,
        pauses: PauseClock,
        cancel_grace_s: float,
    ) -> None:
        self.pools = {s.name: StagePool(s.name, workers[s.workers]) for s in STAGE_TABLE.values()}
        self.layers = layers
        self.table = table
        self.endings = endings
        self.pauses = pauses
        self.cancel_grace_s = cancel_grace_s
        self._seq = itertools.count()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> None:
        """Run ``coro`` as a task the scheduler owns (cancelled at :meth:`stop`)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def snapshot(self) -> dict[str, dict[str, int]]:
        queued = self.table.queued_per_stage()
        return {
            s: {"queued": queued[s], "active": pool.running, "workers": pool.workers}
            for s, pool in self.pools.items()
        }

    # -- queues ------------------------------------------------------------------------------------------

    def enqueue(self, a: ActiveJob, stage: StageName) -> None:
        a.enqueued_at = time.monotonic()
        if stage != "init":
            self.table.set_status(a, QUEUED_FOR[stage])
        self.pools[stage].push(a, next(self._seq))
        self._dispatch(stage)

    def resized(self, stage: str) -> None:
        """A stage's worker count changed (``auto`` workers): start what now fits."""
        self._dispatch(stage)  # type: ignore[arg-type]

    def _dispatch(self, stage: StageName) -> None:
        if self._stopping:
            return
        pool = self.pools[stage]
        while (a := pool.pop_next(self.table)) is not None:
            self.spawn(self._slot(pool, a), name=f"raas-{stage}-slot-{a.job_id}")

    def cancel(self, a: ActiveJob, reason: str) -> None:
        """Stop ``a`` wherever it is; its ending is recorded by the stage (or a task owned here)."""
        if a.result is not None or a.cancel_reason is not None:
            return
        a.cancel_reason = reason
        if a.status in ("queued", "queued_run", "queued_eval"):
            # Owned by the service, not the caller: a dropped HTTP request must not half-abort a job.
            self.spawn(self.endings.abort(a, "queue", cancel_error(reason, "queue")))
        elif a.task is not None and not a.task.done():
            a.task.cancel()
        # else: between a stage's end and the next enqueue; the scheduler sees cancel_reason and stops there.

    def _next(self, a: ActiveJob, stage: StageName) -> None:
        if a.cancel_reason is not None:
            self.spawn(self.endings.abort(a, "queue", cancel_error(a.cancel_reason, "queue")))
            return
        self.enqueue(a, stage)

    # -- one job in one stage ----------------------------------------------------------------------------

    async def _slot(self, pool: StagePool, a: ActiveJob) -> None:
        stage = pool.stage
        try:
            await self._run_stage(STAGE_TABLE[stage], a)
        except asyncio.CancelledError:
            if a.task is not None and not a.task.done():
                a.task.cancel()
            raise
        except Exception as exc:  # a bug in the pipeline itself: record it, keep the pool going
            log.exception("pipeline error on job %s in %s", a.job_id, stage)
            a.cancel_reason = a.cancel_reason or "internal"
            error = RaasError(f"internal pipeline error: {exc}", kind="internal", stage=stage)
            await self.endings.abort(a, stage, error, tb=traceback.format_exc())
        finally:
            pool.done(a)
            self._dispatch(stage)

    async def _run_stage(self, spec: StageSpec, a: ActiveJob) -> None:
        stage = spec.name
        wait = time.monotonic() - a.enqueued_at
        a.queue_s += wait
        metrics.observe_queue_wait(stage, wait)
        if a.sandboxes is None:
            a.sandboxes = self.layers.sandboxes_for(a.job_id)
        budget = Budget(a.budget_s, a.counted_s, a.policy.stage_timeouts.of(stage))
        self.table.set_status(a, stage)
        if budget.limit_s <= 0:
            await self.endings.abort(a, stage, budget.timeout_error(stage))
            return
        if spec.prewarm and a.prewarm is None and a.handler.prewarms_eval():
            a.prewarm = Prewarm(a.handler, a.job, self.layers.sandboxes_for(a.job_id))
        a.task = asyncio.create_task(spec.call(a, self.layers), name=f"raas-{stage}-{a.job_id}")
        measured = await run_within(a.task, budget.limit_s, self.pauses if spec.llm_pause_free else None)
        a.counted_s += measured.used_s
        a.stage_s[stage] += measured.elapsed_s
        task, a.task = a.task, None
        if not measured.done:
            task.cancel()
            await _drain(task, self.cancel_grace_s)
            metrics.observe_stage(stage, measured.elapsed_s, "timeout")
            await self.endings.abort(a, stage, budget.timeout_error(stage, measured.used_s))
            return
        if a.cancel_reason is not None or task.cancelled():
            if not task.cancelled():
                task.exception()  # it ended on its own as the cancel arrived: the cancel wins, quietly
            metrics.observe_stage(stage, measured.elapsed_s, "cancelled")
            await self.endings.abort(a, stage, cancel_error(a.cancel_reason or "cancelled", stage))
            return
        exc = task.exception()
        if exc is not None:
            metrics.observe_stage(stage, measured.elapsed_s, "error")
            tb = "".join(traceback.format_exception(exc))
            await self.endings.abort(a, stage, exc, tb=tb)
            return
        metrics.observe_stage(stage, measured.elapsed_s, "ok")
        value = task.result()
        if not isinstance(value, spec.returns):
            await self.endings.abort(a, stage, _wrong_type(stage, spec.returns.__name__, value))
            return
        spec.keep(a, value)
        if spec.next is None:
            assert isinstance(value, EvalOutput)
            await self.endings.complete(a, value)
            return
        if spec.close_sandboxes:
            closing = time.monotonic()
            await self.endings.close_sandboxes(a)
            a.stage_s[stage] += time.monotonic() - closing  # reported as this stage's time, not budgeted
        if spec.checkpoint and not a.checkpointed and self.layers.config.checkpoints:
            await self.table.checkpoint_run(a)  # a restart now resumes the job here, never generating again
        settle(a, committed=a.checkpointed)
        self._next(a, spec.next)


async def _drain(task: asyncio.Task[Any], grace: float) -> None:
    """Give a cancelled stage ``grace`` seconds to unwind; a stage that ignores cancellation is left behind."""
    done, _ = await asyncio.wait({task}, timeout=grace)
    if not done:
        log.error("stage task %s ignored cancellation for %.1fs", task.get_name(), grace)
    elif not task.cancelled():
        task.exception()  # mark retrieved


def _wrong_type(stage: str, expected: str, value: object) -> RaasError:
    return RaasError(
        f"the handler's {stage}() returned {type(value).__name__}, expected {expected}",
        kind="handler_error",
        stage=stage,
    )
