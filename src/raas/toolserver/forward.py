"""A loopback TCP port inside the sandbox that leads to one Unix socket (the agent gateway's).

Why: agent SDKs (OpenAI, Anthropic, LiteLLM) want an ``http://host:port`` base URL, but a sandbox has no
network, only its own loopback interface. The host's gateway listens on a Unix socket in the sandbox's
run dir (``/.raas/run`` inside); this forwarder, run by the tool server when the host asks
(``gateway.forward``), listens on ``127.0.0.1`` in the sandbox's network namespace and pipes every
connection to that socket byte for byte. It adds no route anywhere else: the sandbox still reaches nothing
but the gateway.

Runs on the image's python3 (>= 3.8), stdlib only.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Dict, Optional, Set

CHUNK = 65536


class Forwarder:
    """``host:port`` (TCP) → ``target`` (Unix socket), at most ``max_connections`` at a time."""

    def __init__(
        self, target: str, host: str = "127.0.0.1", port: int = 0, max_connections: int = 256
    ) -> None:
        self.target = target
        self.host = host
        self.port = port
        self.max_connections = max_connections
        self.connections = 0
        self.refused = 0
        self._server: Optional[asyncio.AbstractServer] = None
        self._tasks: Set[asyncio.Task] = set()

    async def start(self) -> int:
        """Listen; returns the port (the kernel's choice when ``port`` is 0)."""
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=CHUNK)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def info(self) -> Dict[str, object]:
        return {
            "host": self.host,
            "port": self.port,
            "socket": self.target,
            "connections": self.connections,
            "refused": self.refused,
        }

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        upstream: Optional[asyncio.StreamWriter] = None
        try:
            if self.connections >= self.max_connections:
                self.refused += 1
                return
            self.connections += 1
            try:
                try:
                    up_reader, upstream = await asyncio.open_unix_connection(self.target, limit=CHUNK)
                except OSError:
                    return  # the gateway is gone: the client sees the connection close
                sock = writer.get_extra_info("socket")
                if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await asyncio.gather(_pipe(reader, upstream), _pipe(up_reader, writer))
            finally:
                self.connections -= 1
                if upstream is not None:
                    upstream.close()
        finally:
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close the other side (HTTP keep-alive survives; EOF propagates)."""
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
