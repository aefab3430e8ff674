"""Closing a tool connection never waits on the server: one that stopped reading cannot hold it up."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox.connection import ToolConnection

pytestmark = pytest.mark.integration

HANG_GUARD_S = 60


async def test_close_returns_when_the_server_never_reads(tmp_path: Path) -> None:
    """A server that accepts and then reads nothing (frozen): a large request fills the socket buffers and
    its writer blocks; ``close`` must still return, fail the call, and leave no socket open."""
    path = tmp_path / "frozen.sock"
    accepted: list[asyncio.StreamWriter] = []

    async def frozen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # keep the connection open, never read from it

    server = await asyncio.start_unix_server(frozen, path=str(path))
    conn = ToolConnection(path, liveness_interval_s=0)
    try:
        await conn.connect()
        call = asyncio.ensure_future(
            conn.request("files", "write", {"path": "/x"}, attachment=b"x" * (64 << 20))
        )
        await asyncio.sleep(0.5)  # the attachment fills both sockets' buffers; the rest waits in ours
        assert not call.done()
        async with asyncio.timeout(HANG_GUARD_S):
            await conn.close()
            with pytest.raises(RaasError) as err:
                await call
        assert err.value.kind == "sandbox_dead"
        assert not conn.connected
    finally:
        for w in accepted:
            w.close()
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()
