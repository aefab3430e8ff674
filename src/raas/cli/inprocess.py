"""Everything ``raas run`` starts in its own process when no ``--server`` is given: the embedded model
server and the rollout service with its HTTP API on a free local port."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raas.pipeline.config import ServiceConfig


@contextlib.asynccontextmanager
async def service_in_process(config: ServiceConfig, **layers: Any) -> AsyncIterator[str]:
    """Run the rollout service and its HTTP API on a free local port (through :func:`raas.api.served`,
    with the settings ``raas serve`` uses); yields the base URL.

    ``layers`` go to :class:`RolloutService` (e.g. a ``sandbox_manager`` the caller owns and inspects)."""
    from raas.api.app import served
    from raas.pipeline.service import RolloutService

    async with served(RolloutService(config, **layers)) as url:
        yield url


@contextlib.asynccontextmanager
async def embedded_llm(context: int, slots: int) -> AsyncIterator[str]:
    """The embedded llama.cpp SmolLM2 server for the length of the block; yields its URL."""
    from raas.llm.embedded import EmbeddedServer

    # One decoding slot per RUN worker: more would sit idle, fewer would queue inside llama-server where
    # the wait counts against the rollout's RUN time.
    server = EmbeddedServer(ctx_per_slot=context, parallel=slots)
    await server.start()
    try:
        yield server.url
    finally:
        await server.stop()
