"""An ASGI app served by uvicorn on a free 127.0.0.1 port, in the test's own event loop: what the test
doubles of HTTP servers (streaming inference servers, the recording proxy) stand on."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn


class _QuietServer(uvicorn.Server):
    """Leaves SIGINT/SIGTERM to the test runner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class LocalServer:
    """``await server.start()`` binds a free port (``server.port``, ``server.url``) and returns once
    uvicorn serves; ``await server.stop()`` ends it and closes the socket."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = 0
        self._server: _QuietServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self, timeout_s: float | None = None) -> None:
        """``timeout_s``: how long to wait for uvicorn to finish (None: as long as it takes)."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, timeout_s)
        if self._sock is not None:
            self._sock.close()
