"""How a job ends: the error hook, releasing everything the job holds, and one typed result.

Every accepted job ends here exactly once (``ActiveJob.finishing`` guards it): after EVAL returns
(:meth:`Endings.complete`), after a failure, timeout or cancel anywhere (:meth:`Endings.abort`), or when
shutdown could not stop it (:meth:`Endings.interrupt_stuck`). A ``retry_on_restart`` job that shutdown
interrupts is left queued in the ledger instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from raas.core.jobs import STAGES, Timing
from raas.core.trajectory import EvalOutput
from raas.pipeline import results
from raas.pipeline.ledger_recovery import plan
from raas.pipeline.table import ActiveJob, JobTable
from raas.pipeline.wiring import Layers

log = logging.getLogger("raas.pipeline")


class Endings:
    """Ends jobs for one service (see the module docstring)."""

    def __init__(self, layers: Layers, table: JobTable, hook_timeout_s: float) -> None:
        self.layers = layers
        self.table = table
        self.hook_timeout_s = hook_timeout_s

    async def close_sandboxes(self, a: ActiveJob) -> None:
        """Close every sandbox the job opened (the RUN ones go before EVAL starts)."""
        if a.sandboxes is not None:
            await a.sandboxes.close_all()
        if a.env is not None:
            a.env.sandbox = None

    async def release(self, a: ActiveJob) -> None:
        """Close the job's sandboxes (its EVAL prewarm's too), unpin its trajectory, and close whatever the
        manager still holds."""
        await self.close_sandboxes(a)
        if a.prewarm is not None:
            await a.prewarm.close()
        await self.layers.release(a.job)

    async def complete(self, a: ActiveJob, out: EvalOutput) -> None:
        """EVAL returned: release the job (as EVAL time) and record its reward."""
        if a.finishing:
            return
        a.finishing = True
        closing = time.monotonic()
        await self.release(a)
        a.stage_s["eval"] += time.monotonic() - closing
        await self._record(a, results.evaluated(a.run_output, out))

    async def abort(self, a: ActiveJob, stage: str, exc: BaseException, tb: str | None = None) -> None:
        """End a job that failed, timed out or was cancelled: error hook, release, typed result."""
        if a.finishing:
            return
        a.finishing = True
        hook_stage = stage if stage in STAGES else _waiting_for(a.status)
        cleanup = time.monotonic()
        try:
            await asyncio.wait_for(a.handler.on_error(hook_stage, a.job, a.env, exc), self.hook_timeout_s)
        except Exception:
            log.exception("on_error hook failed for job %s", a.job_id)
        await self.release(a)
        if stage in STAGES:  # the hook and the clean-up are reported as part of the stage
            a.stage_s[stage] += time.monotonic() - cleanup
        if a.cancel_reason == "shutdown":
            if self._left_for_restart(a):
                return
            await self._record(a, results.failed(results.interrupted(stage), traceback=tb))
            return
        await self._record(a, results.failed(results.error_of(exc, stage), traceback=tb))

    async def interrupt_stuck(self, a: ActiveJob) -> None:
        """Shutdown is ending and this job did not stop: record it (or leave it for a restart)."""
        if a.result is not None:
            return
        a.finishing = True
        if a.prewarm is not None:  # its task honours cancellation even when the stage did not
            with contextlib.suppress(Exception):
                await asyncio.wait_for(a.prewarm.close(), self.hook_timeout_s)
        stage = a.status if a.status in STAGES else "queue"
        if self._left_for_restart(a):
            return
        await self._record(a, results.failed(results.interrupted(stage, results.INTERRUPTED_STUCK)))

    def _left_for_restart(self, a: ActiveJob) -> bool:
        """Shutdown stopped ``a``: leave it for the next start when that start can go on with it (the same
        :func:`~raas.pipeline.ledger_recovery.plan` a crash's recovery follows); False: record it
        interrupted."""
        how = plan(
            a.status,
            a.request.model_dump(),
            checkpointed=a.checkpointed,
            retry_on_restart=a.request.retry_on_restart,
            attempts=a.attempts,
            max_attempts=self.layers.config.max_attempts,
            resume_in_run=self.layers.resume_in_run,
            data_source=a.data_source,
        )
        if how == "fail":
            return False
        # left where the next start picks it up: at EVAL, at INIT, or in its stage (replay, restart)
        status = {"eval": "queued_eval", "init": "queued"}.get(how, a.status)
        self.table.leave_for_restart(a, status, f"stopped by shutdown; {how} on restart")
        return True

    async def _record(self, a: ActiveJob, outcome: results.Outcome) -> None:
        timing = Timing(
            queue_s=a.queue_s,
            init_s=a.stage_s["init"],
            run_s=a.stage_s["run"],
            eval_s=a.stage_s["eval"],
            total_s=time.monotonic() - a.t0,
            prewarm_s=a.prewarm.seconds if a.prewarm is not None else 0.0,
            resumed_at=a.resumed_at,
        )
        await self.table.record_result(a, results.build_result(a.job, outcome, a.run_output, timing))


def _waiting_for(status: str) -> str:
    return {"queued": "init", "queued_run": "run", "queued_eval": "eval"}.get(status, status)
