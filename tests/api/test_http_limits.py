"""The HTTP server's own limits, attacked over real sockets: a header deadline (slowloris), a body deadline,
an idle keep-alive timeout and a cap on open connections, against the app served with the settings
``raas serve`` uses (:func:`raas.api.app.server_config`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import pytest

from raas.api.limits import HttpLimits, connection_book
from tests.api.conftest import APIFactory, LiveAPI
from tests.pipeline.conftest import script

pytestmark = pytest.mark.integration

PARTIAL_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: raas\r\nX-Slow: "
"""A request whose headers never end."""


def address(api: LiveAPI) -> tuple[str, int]:
    parts = urlsplit(api.url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def server_sockets(api: LiveAPI) -> int:
    return len(api.served.server.server_state.connections)


async def read_until_closed(reader: asyncio.StreamReader, limit_s: float = 60.0) -> bytes:
    """Everything the server sends until it closes the connection (``limit_s`` only bounds a hang)."""
    return await asyncio.wait_for(reader.read(), limit_s)


@contextlib.asynccontextmanager
async def raw_connections(api: LiveAPI, n: int, first: bytes) -> AsyncIterator[list[asyncio.StreamReader]]:
    """``n`` raw connections that each sent ``first``; closed on exit."""
    host, port = address(api)
    writers: list[asyncio.StreamWriter] = []
    readers: list[asyncio.StreamReader] = []
    try:
        for _ in range(n):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(first)
            await writer.drain()
            readers.append(reader)
            writers.append(writer)
        yield readers
    finally:
        for writer in writers:
            writer.close()
        for writer in writers:
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def healthz_on_a_new_connection(api: LiveAPI) -> int:
    async with httpx.AsyncClient(base_url=api.url, timeout=30) as fresh:
        return (await fresh.get("/healthz")).status_code


async def test_slowloris_connections_are_closed_and_healthz_answers_throughout(make_api: APIFactory) -> None:
    cap = 64
    api = await make_api(http_header_timeout_s=1.0, http_max_connections=cap)
    book = connection_book(api.served.uvicorn_config.http)  # type: ignore[arg-type]
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, server_sockets(api))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    try:
        async with raw_connections(api, 500, PARTIAL_REQUEST) as readers:
            # While 500 unfinished requests arrive (8 times the cap), /healthz keeps answering.
            assert [await healthz_on_a_new_connection(api) for _ in range(5)] == [200] * 5
            endings = await asyncio.gather(*(read_until_closed(r) for r in readers))
            assert await healthz_on_a_new_connection(api) == 200
    finally:
        watcher.cancel()
    # Every slow connection was closed by the server: evicted for a newer one, or timed out with a 408.
    timed_out = [e for e in endings if e]
    assert all(e.startswith(b"HTTP/1.1 408 ") for e in timed_out), timed_out[:1]
    body = json.loads(timed_out[0].split(b"\r\n\r\n", 1)[1])
    assert body["error"]["kind"] == "bad_request" and "http_header_timeout_s" in body["detail"]
    assert book.evicted + book.header_timeouts >= 500
    assert most <= HttpLimits(1.0, cap).max_sockets, most


async def test_a_kept_alive_connection_must_finish_its_next_headers_too(make_api: APIFactory) -> None:
    api = await make_api(http_header_timeout_s=1.0, http_keep_alive_s=60.0)
    async with raw_connections(api, 1, b"GET /healthz HTTP/1.1\r\nHost: raas\r\n\r\n") as (reader,):
        first = await reader.readuntil(b"}")
        assert first.startswith(b"HTTP/1.1 200 ")
        host, port = address(api)
    # The same connection, a second request that never ends: the keep-alive timer (60 s) must not be
    # what closes it.
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: raas\r\n\r\n")
        assert (await reader.readuntil(b"}")).startswith(b"HTTP/1.1 200 ")
        writer.write(PARTIAL_REQUEST)
        rest = await read_until_closed(reader, limit_s=30)
    finally:
        writer.close()
    assert rest.startswith(b"HTTP/1.1 408 "), rest


async def test_idle_keep_alive_connections_are_closed(make_api: APIFactory) -> None:
    api = await make_api(http_keep_alive_s=0.5)
    async with raw_connections(api, 1, b"GET /healthz HTTP/1.1\r\nHost: raas\r\n\r\n") as (reader,):
        response = await read_until_closed(reader, limit_s=30)
    assert response.startswith(b"HTTP/1.1 200 ") and response.endswith(b"}")


async def test_a_body_that_does_not_arrive_gets_408(make_api: APIFactory) -> None:
    api = await make_api(http_body_timeout_s=0.5)
    head = b"POST /v1/jobs HTTP/1.1\r\nHost: raas\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    async with raw_connections(api, 1, head + b'{"instance": ') as (reader,):
        response = await read_until_closed(reader, limit_s=30)
    status, _, rest = response.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", response
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert "http_body_timeout_s" in body["detail"] and body["error"]["kind"] == "bad_request"
    assert await api.service.ledger.counts() == {}


async def test_over_the_cap_with_every_connection_busy_is_a_fast_503(make_api: APIFactory) -> None:
    cap = 8
    api = await make_api(http_max_connections=cap, http_header_timeout_s=60.0)
    job = (await api.client.post("/v1/jobs", json={"instance": script(init={"sleep": 600})})).json()
    await api.client.aclose()  # its pooled connection would count towards the cap
    long_poll = f"GET /v1/jobs/{job['job_id']}/result?wait=120 HTTP/1.1\r\nHost: raas\r\n\r\n".encode()
    async with raw_connections(api, cap, long_poll) as busy:
        # Every one is inside the app now (uvicorn has no event for it).
        while len(api.served.server.server_state.tasks) < cap:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        async with raw_connections(api, 1, b"GET /healthz HTTP/1.1\r\nHost: raas\r\n\r\n") as (late,):
            refusal = await read_until_closed(late, limit_s=30)
        head, _, body = refusal.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), refusal
        error = json.loads(body)
        assert error["error"]["kind"] == "unavailable" and "http_max_connections = 8" in error["detail"]
        # The busy ones are untouched: once the job ends they get their answer.
        await api.service.cancel(job["job_id"])
        answers = await asyncio.gather(*(r.readuntil(b"}") for r in busy))
        assert all(a.startswith(b"HTTP/1.1 200 ") for a in answers)
        # Now idle, they give way to a new client.
        assert await healthz_on_a_new_connection(api) == 200


def test_the_cap_fits_the_open_file_limit() -> None:
    """In a child process (rlimits are per process): a cap the hard limit allows raises the soft limit;
    one it does not is lowered, with a warning."""
    code = """
import json, logging, resource, sys
from raas.api.limits import HttpLimits, fit_to_fd_limit
logging.basicConfig(stream=sys.stderr)
soft, hard = (int(x) for x in sys.argv[1:3])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
got = fit_to_fd_limit(HttpLimits(header_timeout_s=10, max_connections=2048))
print(json.dumps([got.max_connections, resource.getrlimit(resource.RLIMIT_NOFILE)[0]]))
"""

    def run(soft: int, hard: int) -> tuple[list[int], str]:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(soft), str(hard)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return json.loads(proc.stdout), proc.stderr

    (cap, soft), err = run(256, 8192)
    assert cap == 2048 and soft == HttpLimits(10, 2048).max_sockets + 512 and err == ""
    (cap, soft), err = run(256, 1024)
    assert soft == 1024 and cap + HttpLimits(10, cap).refusal_slots + 512 <= 1024
    assert "open-file limit (1024) is too low for http_max_connections=2048" in err
