"""A job's result, read the same way wherever jobs are kept: the live entry first, then the ledger.

The service (its job table) and the cluster router (a table of its own) hold unfinished jobs in memory,
each with a ``result`` and a ``done`` event, and every job in a ledger; both answer ``result`` and the
long-poll ``wait`` through these two functions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol

from raas.core.jobs import JobResult
from raas.errors import RaasError
from raas.pipeline.ledger import Ledger


class LiveJob(Protocol):
    """An in-memory job entry: its result once it has one, and an event set when it finishes."""

    result: JobResult | None
    done: asyncio.Event


async def stored_result(ledger: Ledger, job_id: str) -> JobResult | None:
    """The ledger's result of ``job_id`` (None while unfinished); ``not_found`` if it has no such job."""
    row = await ledger.get(job_id)
    if row is None:
        raise RaasError(f"no job {job_id!r}", kind="not_found", stage="api")
    return JobResult.model_validate(row.result) if row.result else None


async def wait_result(
    live: LiveJob | None,
    timeout: float | None,  # noqa: ASYNC109
    result: Callable[[], Awaitable[JobResult | None]],
) -> JobResult | None:
    """Long-poll: ``live``'s result once it finishes, within ``timeout`` seconds; else what ``result()``
    says (the job finished before, is not live here, or is still running)."""
    if live is not None and live.result is None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(live.done.wait()), timeout)
        if live.result is not None:
            return live.result
    return await result()
