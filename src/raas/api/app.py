"""The FastAPI application: native ``/v1`` routes, ProRL-compatible routes, health, status and metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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
    app.add_middleware(GuardMiddleware, max_bytes=service.config.max_request_bytes, token=service.config.token)
    return app
