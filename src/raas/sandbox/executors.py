"""The sandbox layer's own thread pools: starts and closes block (image conversion, ``/proc`` scans,
directory removal) and must never share the event loop's default pool, or each other's."""

from __future__ import annotations

import asyncio

from raas.core.executors import Executor


class SandboxExecutors:
    """The blocking work of sandboxes, split so that slow starts never hold up closes.

    ``start``: identity allocation, :meth:`Sandbox.prepare` (which may convert an image: minutes),
    bundle checks, reaping. ``close``: the ``/proc`` scans that kill what a sandbox left and the removal
    of its directories. Whoever creates them shuts them down (:meth:`aclose`)."""

    def __init__(self, name: str = "raas-sandbox", start_workers: int = 4, close_workers: int = 2) -> None:
        self.start = Executor(f"{name}-start", start_workers)
        self.close = Executor(f"{name}-close", close_workers)

    @property
    def closed(self) -> bool:
        return self.start.closed or self.close.closed

    def shutdown(self) -> None:
        self.start.shutdown()
        self.close.shutdown()

    async def aclose(self) -> None:
        await asyncio.gather(self.start.aclose(), self.close.aclose())
