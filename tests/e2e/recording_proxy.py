"""A transparent HTTP proxy that records every JSON exchange with an inference server.

Why: to prove token exactness against a *real* model server, a test needs the server's own answers, byte
for byte, independently of what raas recorded. raas talks to this proxy as if it were the server; the
proxy forwards each request unchanged, returns the response unchanged, and keeps both (a streamed answer as
the list of its events).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tests.doubles.local_server import LocalServer


@dataclass
class Exchange:
    method: str
    path: str
    request: Any
    status: int
    response: Any


class RecordingProxy:
    """``async with RecordingProxy(upstream_url) as p: p.url; p.exchanges``."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._http: httpx.AsyncClient | None = None
        self._server = LocalServer(
            Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST", "DELETE", "PUT"])])
        )

    @property
    def url(self) -> str:
        return self._server.url

    async def _forward(self, request: Request) -> Response:
        assert self._http is not None
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        upstream = await self._http.request(
            request.method,
            self.upstream + request.url.path,
            params=request.query_params,
            content=body,
            headers=headers,
        )
        streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
        answer = _events(upstream.content) if streamed else _json(upstream.content)
        self.exchanges.append(
            Exchange(request.method, request.url.path, _json(body), upstream.status_code, answer)
        )
        drop = ("content-length", "transfer-encoding", "connection", "content-encoding")
        return Response(
            upstream.content,
            status_code=upstream.status_code,
            headers={k: v for k, v in upstream.headers.items() if k.lower() not in drop},
        )

    async def __aenter__(self) -> RecordingProxy:
        self._http = httpx.AsyncClient(timeout=600)
        await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._server.stop()
        if self._http is not None:
            await self._http.aclose()


def _events(raw: bytes) -> list[Any]:
    """A Server-Sent Events answer (a streamed generation): the JSON of each ``data:`` line, in order."""
    lines = raw.decode(errors="replace").splitlines()
    return [_json(line[len("data: ") :].encode()) for line in lines if line.startswith("data: {")]


def _json(raw: bytes) -> Any:
    import json

    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None
