"""A blocking facade over :class:`RolloutClient` for trainers that are not written with asyncio.

The client runs on a private event loop in a background thread; every method here submits a coroutine to
that loop and waits for its answer, so a plain training loop can do
``with SyncRolloutClient(urls) as c: c.submit_group(inst, 8); g = c.next_group()``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from raas.trainer.rollout import RolloutClient
from raas.trainer.types import Group

T = TypeVar("T")


class SyncRolloutClient:
    """Same arguments as :class:`RolloutClient`; ``.client`` is the async client (use it through :meth:`run`)."""

    def __init__(self, services: str | list[str], **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="raas-rollout-client", daemon=True
        )
        self._thread.start()
        self._closed = False
        try:
            self.client: RolloutClient = self._call(self._make(services, kwargs))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _make(services: str | list[str], kwargs: dict[str, Any]) -> RolloutClient:
        client = RolloutClient(services, **kwargs)
        await client.start()
        return client

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def run(self, make: Callable[[RolloutClient], Awaitable[T]], timeout: float | None = None) -> T:
        """Run ``make(client)`` on the client's loop, e.g. ``c.run(lambda _: sampler.next_step())``."""

        async def go() -> T:
            return await make(self.client)

        return self._call(go(), timeout)

    def submit_group(self, instance: dict[str, Any], n: int, **kw: Any) -> Group:
        return self._call(self.client.submit_group(instance, n, **kw))

    def next_group(self, timeout: float | None = None) -> Group:
        """The next finished group; ``TimeoutError`` after ``timeout`` seconds (no group is lost)."""
        return self._call(self.client.next_group(timeout))

    def cancel_groups(self, groups: Iterable[Group]) -> int:
        return self._call(self.client.cancel_groups(list(groups)))

    def weight_sync(self, version: str, sync: Callable[[], Any] | None = None) -> None:
        """Pause every service, call ``sync()`` here (blocking is fine), stamp ``version``, resume."""
        self._call(self.client.pause())
        try:
            if sync is not None:
                sync()
            self._call(self.client.set_weight_version(version))
        finally:
            self._call(self.client.resume())

    @property
    def stats(self) -> dict[str, int]:
        return self.client.stats.snapshot()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self.client.aclose(), timeout=60)
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
