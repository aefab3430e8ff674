"""The FastAPI application: native ``/v1`` routes, ProRL-compatible routes, health, status and metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI

from raas.api import errors, native, prorl
from raas.api.middleware import GuardMiddleware
from raas.pipeline.service import RolloutService


def create_app(service: RolloutService, *, manage_service: bool = True) -> FastAPI:
    """An app serving ``service``. With ``manage_service`` the app starts the service on startup and shuts
    it down (gracefully, ``shutdown_grace_s``) when the server stops."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_service:
            await service.start()
        try:
            yield
        finally:
            if manage_service:
                await service.shutdown()

    app = FastAPI(
        title="raas",
        summary="Rollout-as-a-Service: sandboxed, token-exact multi-turn agent rollouts for RL",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.prorl = prorl.ProRLGate()
    errors.install(app)
    app.include_router(native.router)
    app.include_router(prorl.router)
    app.add_middleware(
        GuardMiddleware, max_bytes=service.config.max_request_bytes, token=service.config.token
    )
    return app


class _Server(uvicorn.Server):
    """uvicorn, plus: when a stop signal arrives, end the event streams at once. Otherwise an open SSE
    connection would hold the server's graceful shutdown for its whole timeout."""

    def __init__(self, config: uvicorn.Config, service: RolloutService) -> None:
        super().__init__(config)
        self._service = service

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon_threadsafe(self._service.bus.close)
        super().handle_exit(sig, frame)


async def serve(
    service: RolloutService, *, host: str | None = None, port: int | None = None, log_level: str = "info"
) -> None:
    """Serve ``service`` over HTTP until SIGINT/SIGTERM, then shut it down gracefully."""
    host = host or service.config.host
    port = service.config.port if port is None else port
    config = uvicorn.Config(
        create_app(service),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=int(service.config.shutdown_grace_s) + 5,
    )
    await _Server(config, service).serve()
