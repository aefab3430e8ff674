"""``gateway.forward``: a loopback TCP port of the tool server that leads to one Unix socket, byte for byte,
in both directions, with half-close, and bounded; bad arguments and a vanished target are typed answers."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox.client import ToolClient
from tests.toolserver.conftest import RunningServer

pytestmark = pytest.mark.integration


async def _echo_server(path: str) -> asyncio.AbstractServer:
    """Upper-cases what it gets until EOF, then says how many bytes it saw and closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        total = 0
        while chunk := await reader.read(65536):
            total += len(chunk)
            writer.write(chunk.upper())
            await writer.drain()
        writer.write(f"|{total}".encode())
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(handle, path=path)


async def test_forward_pipes_both_ways_with_half_close(fresh_server: RunningServer) -> None:
    target = str(Path(fresh_server.base) / "upstream.sock")
    upstream = await _echo_server(target)
    try:
        async with ToolClient(fresh_server.socket) as client:
            info = await client.request("gateway", "forward", {"socket": target})
            assert info["host"] == "127.0.0.1" and info["port"] > 0 and info["socket"] == target
            again = await client.request("gateway", "forward", {"socket": target})
            assert again["port"] == info["port"]  # one forwarder per socket
            payload = b"abc" * 200_000  # larger than any buffer on the way
            reader, writer = await asyncio.open_connection("127.0.0.1", info["port"])
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            data = await reader.read()
            writer.close()
            assert data == payload.upper() + f"|{len(payload)}".encode()
    finally:
        upstream.close()
        await upstream.wait_closed()
    assert await fresh_server.stop() == 0  # the forwarder closes with the server


async def test_forward_refuses_bad_arguments_and_closes_when_the_target_is_gone(
    fresh_server: RunningServer,
) -> None:
    async with ToolClient(fresh_server.socket) as client:
        for args in ({"socket": "relative.sock"}, {}, {"socket": 5}, {"socket": "/x", "extra": 1}):
            with pytest.raises(RaasError) as info:
                await client.request("gateway", "forward", args)
            assert info.value.kind == "bad_request"
        gone = str(Path(fresh_server.base) / "nobody-listens.sock")
        info_ok = await client.request("gateway", "forward", {"socket": gone})
        reader, writer = await asyncio.open_connection("127.0.0.1", info_ok["port"])
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        try:  # closed, nothing forwarded anywhere (a reset when the request was still unread)
            assert await reader.read() == b""
        except ConnectionResetError:
            pass
        writer.close()
        # a port that is taken is a typed failure, not a crash
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        try:
            with pytest.raises(RaasError) as info:
                await client.request(
                    "gateway", "forward", {"socket": gone + "2", "port": taken.getsockname()[1]}
                )
            assert "cannot listen" in info.value.message
        finally:
            taken.close()
        assert (await client.ping()).version == 1
