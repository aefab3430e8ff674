"""The EVAL prewarm of one job: the handler's :meth:`~raas.tasks.base.TaskHandler.prewarm_eval`, run
alongside RUN.

Why: a task whose tests run in a fresh sandbox (SWE) would otherwise start that sandbox only after RUN
ended, and the whole start-up (image, repository copy, tool server) would add to every rollout's latency.
Started when RUN starts, it is usually ready when EVAL begins.

Ownership: the prewarm has a :class:`~raas.tasks.base.JobSandboxes` of its own, so closing RUN's
sandboxes before EVAL leaves it open; :meth:`Prewarm.close` (called when the job ends, on every path)
cancels the task if it still runs and closes every sandbox it opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from raas.core.jobs import Job
from raas.tasks.base import JobSandboxes, TaskHandler

log = logging.getLogger("raas.pipeline")


class Prewarm:
    """One job's prewarm task, its sandboxes and how long it took."""

    def __init__(self, handler: TaskHandler, job: Job, sandboxes: JobSandboxes) -> None:
        self.sandboxes = sandboxes
        self.seconds = 0.0
        self.error: str | None = None
        self._started = time.monotonic()
        self._task: asyncio.Task[Any] = asyncio.create_task(
            self._run(handler, job), name=f"raas-prewarm-{job.job_id}"
        )

    async def _run(self, handler: TaskHandler, job: Job) -> Any:
        try:
            return await handler.prewarm_eval(job, self.sandboxes)
        finally:
            self.seconds = time.monotonic() - self._started

    @property
    def done(self) -> bool:
        return self._task.done()

    async def take(self) -> Any:
        """What the prewarm produced, once it has (None when it failed; :attr:`error` says why)."""
        await asyncio.wait({self._task})  # a cancelled EVAL leaves the task to close()
        if self._task.cancelled():
            self.error = "the prewarm was cancelled"
            return None
        exc = self._task.exception()
        if exc is not None:
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("EVAL prewarm failed (EVAL sets up on its own): %s", self.error)
            return None
        return self._task.result()

    async def close(self) -> None:
        """Stop the task if it still runs and close every sandbox it opened (idempotent)."""
        if not self._task.done():
            self._task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.shield(asyncio.wait({self._task}))
        if self._task.done() and not self._task.cancelled():
            self._task.exception()  # retrieved: a failure was already reported through take()
        await self.sandboxes.close_all()
