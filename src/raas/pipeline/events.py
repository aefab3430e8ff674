"""An in-process event bus: every job state change fans out to subscribers (the SSE endpoint, the CLI).

Each subscriber owns a bounded queue, so a slow consumer cannot grow memory without bound; when its queue
is full the oldest event is dropped and the subscriber is told how many it missed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from raas.core.jobs import JobEvent


class Subscription:
    """One consumer's view of the bus; iterate it or call :meth:`get`."""

    def __init__(self, maxsize: int) -> None:
        self._queue: asyncio.Queue[JobEvent | None] = asyncio.Queue(maxsize)
        self.dropped = 0

    def _offer(self, event: JobEvent | None) -> None:
        while True:
            try:
                self._queue.put_nowait(event)
                return
            except asyncio.QueueFull:
                self._queue.get_nowait()
                self.dropped += 1

    async def get(self) -> JobEvent | None:
        """The next event, or None once the bus is closed."""
        return await self._queue.get()

    def __aiter__(self) -> AsyncIterator[JobEvent]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[JobEvent]:
        while True:
            event = await self._queue.get()
            if event is None:
                return
            yield event


class EventBus:
    def __init__(self, maxsize: int = 10_000) -> None:
        self._maxsize = maxsize
        self._subs: set[Subscription] = set()
        self._closed = False

    def publish(self, event: JobEvent) -> None:
        for sub in list(self._subs):
            sub._offer(event)

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[Subscription]:
        sub = Subscription(self._maxsize)
        if self._closed:
            sub._offer(None)
        self._subs.add(sub)
        try:
            yield sub
        finally:
            self._subs.discard(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def close(self) -> None:
        """Wake every subscriber with end-of-stream."""
        self._closed = True
        for sub in list(self._subs):
            sub._offer(None)
