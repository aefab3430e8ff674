"""The host client's liveness check against a server that is busy sending, one that is busy reading a
large upload, and one that is silent or stopped reading.

``TricklingServer`` is a test double speaking the real wire protocol: it answers ``files.read`` with a
large attachment sent slowly, and answers pings only in order (after that attachment), like a real
server whose socket is busy with a big download on a slow machine. ``SlowReader`` reads a request's
attachment slowly (or stops reading it), like a server taking a big upload on a slow machine (or frozen
in the middle of one).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox.client import LARGE_BYTES, ToolClient
from raas.toolserver.protocol import (
    attachment_size,
    decode_body,
    encode_message,
    ok_response,
    read_attachment,
    read_frame,
)

pytestmark = pytest.mark.integration

SIZE = 2 * LARGE_BYTES
HANG_GUARD_S = 60
STEPS = 20


class TricklingServer:
    def __init__(self, step_s: float, silent: bool = False) -> None:
        self.step_s = step_s
        self.silent = silent
        self.payload = bytes(range(256)) * (SIZE // 256)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (body := await read_frame(reader, 1 << 20)) is not None:
                msg = decode_body(body)
                n = attachment_size(msg, 1 << 30)
                if n:
                    await read_attachment(reader, n)
                if msg["tool"] == "server" and msg["op"] == "ping":
                    writer.writelines(encode_message(ok_response(msg["id"], {"version": 1})))
                    await writer.drain()
                    continue
                if self.silent:
                    await asyncio.sleep(3600)
                out = encode_message(ok_response(msg["id"], {"size": len(self.payload)}), self.payload)
                writer.write(out[0])
                step = -(-len(self.payload) // STEPS)
                for i in range(STEPS):
                    writer.write(self.payload[i * step : (i + 1) * step])
                    await writer.drain()
                    await asyncio.sleep(self.step_s)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(double: TricklingServer | SlowReader, path: Path) -> AsyncIterator[str]:
    server = await asyncio.start_unix_server(double.handle, str(path))
    try:
        yield str(path)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_long_download_is_not_taken_for_a_dead_server(tmp_path: Path) -> None:
    """The ping's answer waits behind an attachment that takes 10 liveness timeouts to arrive: bytes
    keep coming, so the server is alive and the download completes."""
    double = TricklingServer(step_s=0.1)
    async with (
        serving(double, tmp_path / "s.sock") as sock,
        ToolClient(sock, liveness_interval_s=0.05, liveness_timeout_s=0.2) as client,
    ):
        assert await client.read_file("/x") == double.payload
        assert client.dead is None


async def test_a_silent_server_is_still_declared_dead(tmp_path: Path) -> None:
    """Nothing arrives at all (the double stops reading and writing): the liveness check fails the call
    long before its own deadline."""
    double = TricklingServer(step_s=0.1, silent=True)
    async with (
        serving(double, tmp_path / "s.sock") as sock,
        ToolClient(sock, liveness_interval_s=0.05, liveness_timeout_s=0.2) as client,
    ):
        with pytest.raises(RaasError) as err:
            await client.request("files", "read", {"path": "/x"}, wait_s=3600)
        assert err.value.kind == "sandbox_dead" and "liveness ping" in err.value.message
        assert client.dead is not None


class SlowReader:
    """Reads each request's attachment ``piece`` bytes at a time, ``step_s`` apart; ``freeze`` stops
    reading (for good) once the request's frame is in."""

    def __init__(self, step_s: float, piece: int = 64 << 10, freeze: bool = False) -> None:
        self.step_s = step_s
        self.piece = piece
        self.freeze = freeze
        self.received = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while (body := await read_frame(reader, 1 << 20)) is not None:
                msg = decode_body(body)
                left = attachment_size(msg, 1 << 30)
                if left and self.freeze:
                    await asyncio.sleep(3600)
                while left:
                    chunk = await reader.readexactly(min(left, self.piece))
                    left -= len(chunk)
                    self.received += len(chunk)
                    await asyncio.sleep(self.step_s)
                writer.writelines(encode_message(ok_response(msg["id"], {"received": self.received})))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


UPLOAD = 4 * LARGE_BYTES


async def test_a_long_upload_to_a_slow_reader_is_not_taken_for_a_dead_server(tmp_path: Path) -> None:
    """The upload takes ~7 liveness timeouts to be read and the pings wait behind it; the server keeps
    taking bytes, so it is alive and the upload completes."""
    double = SlowReader(step_s=0.02)
    async with (
        serving(double, tmp_path / "s.sock") as sock,
        ToolClient(sock, liveness_interval_s=0.05, liveness_timeout_s=0.2) as client,
    ):
        reply, _ = await client.request_with_attachment(
            "files", "write", {"path": "/x"}, attachment=bytes(UPLOAD), wait_s=60
        )
        assert reply["received"] == UPLOAD
        assert client.dead is None


async def test_a_server_that_stops_reading_mid_upload_is_declared_dead(tmp_path: Path) -> None:
    """The server takes the request's frame and then reads nothing: the upload fills the socket and
    waits, and the ping waits behind it for the write lock. The liveness check must still fail the call
    (before, the ping's send was not timed, and the upload waited for as long as the call's own deadline)."""
    double = SlowReader(step_s=0, freeze=True)
    async with (
        serving(double, tmp_path / "s.sock") as sock,
        ToolClient(sock, liveness_interval_s=0.05, liveness_timeout_s=0.2) as client,
    ):
        with pytest.raises(RaasError) as err:
            async with asyncio.timeout(HANG_GUARD_S):
                await client.request_with_attachment(
                    "files", "write", {"path": "/x"}, attachment=bytes(UPLOAD), wait_s=3600
                )
        assert err.value.kind == "sandbox_dead"
        assert client.dead is not None and "liveness ping" in client.dead.message
