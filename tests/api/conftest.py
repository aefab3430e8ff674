"""Fixtures for API tests: the real app served by uvicorn on a real socket, driven over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from raas.api.app import create_app, server_config
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from tests.doubles.handlers import script_registry
from tests.pipeline.conftest import (
    RecordingSandboxManager,
    assert_no_leftovers,
    script_handler,
)

__all__ = ["script_handler"]


@dataclass
class LiveAPI:
    url: str
    service: RolloutService
    manager: RecordingSandboxManager
    client: httpx.AsyncClient
    served: Served


class Served:
    """One uvicorn server on 127.0.0.1:<free port> in the running loop; the app's lifespan runs the service."""

    def __init__(self, app: Any, config: ServiceConfig) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        # The settings `raas serve` uses (connection limits included), minus raising this process's
        # open-file limit.
        self.uvicorn_config = server_config(app, config, log_level="warning", fit_fd_limit=False)
        self.server = uvicorn.Server(self.uvicorn_config)
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("uvicorn exited during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """An app of its own (no service) on 127.0.0.1:<free port> for the length of the block; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done()
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


APIFactory = Callable[..., Awaitable[LiveAPI]]


@pytest.fixture
async def make_api(
    tmp_path: Path, script_handler: Any, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[APIFactory]:
    """``await make_api(**config)``: a live service over HTTP; stopped and leak-checked at teardown."""
    monkeypatch.delenv("RAAS_API_TOKEN", raising=False)
    made: list[tuple[Served, LiveAPI]] = []

    async def make(**overrides: Any) -> LiveAPI:
        state = tmp_path / f"api{len(made)}"
        cfg = ServiceConfig(state_dir=state, **{"shutdown_grace_s": 0.0, **overrides})
        manager = RecordingSandboxManager(state / "sandboxes")
        service = RolloutService(cfg, sandbox_manager=manager, handlers=script_registry())
        served = Served(create_app(service), cfg)
        await served.start()
        api = LiveAPI(
            served.url, service, manager, httpx.AsyncClient(base_url=served.url, timeout=60), served
        )
        made.append((served, api))
        return api

    yield make
    for served, api in made:
        await api.client.aclose()
        await served.stop()
        assert_no_leftovers(api.manager)
        assert not api.service.ledger.running, "the ledger writer thread outlived shutdown"
        await api.manager.close_all()


@contextlib.asynccontextmanager
async def sse(client: httpx.AsyncClient, path: str = "/v1/events", **kw: Any) -> AsyncIterator[Any]:
    """Open an SSE stream; yields an async iterator of parsed ``(event, data)`` pairs."""
    import json

    async with client.stream("GET", path, **kw) as response:
        assert response.status_code == 200, response.status_code
        assert response.headers["content-type"].startswith("text/event-stream")

        async def events() -> AsyncIterator[tuple[str, dict[str, Any]]]:
            name, data = "message", ""
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:"):
                    data += line[5:].strip()
                elif line == "" and data:
                    yield name, json.loads(data)
                    name, data = "message", ""

        yield events()
