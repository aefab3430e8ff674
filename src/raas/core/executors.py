"""Bounded thread pools, one per subsystem, each owned and shut down by that subsystem.

Why not ``asyncio.to_thread``: it uses the loop's one default pool, so a subsystem with slow blocking work
(converting images, scanning ``/proc`` when sandboxes close, copying large transfers) can take every worker
and leave another subsystem's short jobs queued behind it. Each owner here creates its own
:class:`Executor` with a fixed number of workers (threads start only when work arrives) and shuts it down
when it closes, so its threads never outlive it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from raas.errors import RaasError

P = ParamSpec("P")
T = TypeVar("T")

__all__ = ["Executor"]


class Executor:
    """``await pool.run(fn, *args)`` runs ``fn`` on one of at most ``max_workers`` threads named ``name``."""

    def __init__(self, name: str, max_workers: int) -> None:
        if max_workers < 1:
            raise ValueError("an executor needs at least one worker")
        self.name = name
        self.max_workers = max_workers
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)
        self._closed = False
        self._started: set[Future[Any]] = set()

    async def run(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn`` in this pool and wait for it. Cancelling the wait drops a call still queued; one that
        has started runs to its end (:meth:`aclose` waits for it)."""
        if self._closed:
            raise RaasError(f"the {self.name} executor is shut down", kind="internal")
        future = self._pool.submit(fn, *args, **kwargs)
        self._started.add(future)
        future.add_done_callback(self._started.discard)
        return await asyncio.wrap_future(future)

    @property
    def closed(self) -> bool:
        return self._closed

    def shutdown(self) -> None:
        """Refuse new work and drop queued work; running calls finish on their own. Idempotent."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        """:meth:`shutdown`, then wait (without blocking the loop) for the calls still running, and for
        the worker threads to exit."""
        self.shutdown()
        running = list(self._started)
        if running:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in running), return_exceptions=True)
        self._pool.shutdown(wait=True)  # idle workers only, woken to exit: the join is immediate
