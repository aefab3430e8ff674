"""Request guards that must run before FastAPI parses anything: the body-size cap and the bearer token."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from raas.api import dashboard
from raas.api.errors import error_body

OPEN_PATHS = frozenset({"/healthz"})
GATEWAY_PREFIX = "/gateway/"
"""The agent gateway's routes: each request carries its rollout's own key instead of the API token."""


async def _send_json(
    send: Send, status: int, body: dict[str, object], headers: list[tuple[bytes, bytes]]
) -> None:
    data = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


BATCH_PATH = "/v1/jobs:batch"


async def _unauthorized(send: Send, path: str) -> None:
    """401; under ``/dashboard`` the page answers with its login form (a browser cannot send a header)."""
    if dashboard.is_dashboard_path(path):
        data, headers = dashboard.unauthorized_response(path)
    else:
        data = json.dumps(error_body("unauthorized", "missing or wrong bearer token")).encode()
        headers = [(b"content-type", b"application/json")]
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-length", str(len(data)).encode()),
                (b"www-authenticate", b"Bearer"),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": data})


class GuardMiddleware:
    """Rejects bodies over the cap with 413 (before parsing; ``max_batch_bytes`` for batches,
    ``max_bytes`` for every other route), bodies that do not arrive within ``body_timeout_s`` with 408
    and, when a token is configured, requests without ``Authorization: Bearer <token>`` with 401 — on
    every path but ``/healthz``, the agent gateway's (``/gateway/...``, which check their rollout's own
    key) and the dashboard's login form and static files (a ``GET`` under ``/dashboard`` may show the
    dashboard's session cookie instead; see :mod:`raas.api.dashboard`). The size of an accepted body is left
    in ``request.state.body_bytes``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_bytes: int,
        token: Callable[[], str | None],
        max_batch_bytes: int | None = None,
        body_timeout_s: float | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_batch_bytes = max_bytes if max_batch_bytes is None else max_batch_bytes
        self.body_timeout_s = body_timeout_s
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        expected = self.token()
        path = str(scope.get("path", ""))
        if (
            expected
            and path not in OPEN_PATHS
            and not path.startswith(GATEWAY_PREFIX)
            and not dashboard.is_open_path(path)
        ):
            given = b""
            for name, value in scope.get("headers", []):
                if name == b"authorization":
                    given = value
                    break
            scheme, _, credential = given.decode("latin-1").partition(" ")
            if (
                scheme.lower() != "bearer"
                or not hmac.compare_digest(credential.strip().encode(), expected.encode())
            ) and not dashboard.cookie_allows(scope, expected):
                await _unauthorized(send, path)
                return
        limit, setting = (
            (self.max_batch_bytes, "max_batch_bytes")
            if scope.get("path") == BATCH_PATH
            else (self.max_bytes, "max_request_bytes")
        )
        declared = None
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, error_body("bad_request", "invalid Content-Length"), [])
                    return
        if declared is not None and declared > limit:
            await _send_json(send, 413, error_body("payload_too_large", _too_large(limit, setting)), [])
            return
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            # Read (at most limit + 1) before the app does, so a chunked upload cannot exceed the cap.
            chunks: list[bytes] = []
            size = 0
            more = True
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    while more:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            return
                        chunk = message.get("body", b"")
                        size += len(chunk)
                        if size > limit:
                            await _send_json(
                                send, 413, error_body("payload_too_large", _too_large(limit, setting)), []
                            )
                            return
                        chunks.append(chunk)
                        more = message.get("more_body", False)
            except TimeoutError:
                message_text = (
                    f"request body not received within {self.body_timeout_s:g} s (http_body_timeout_s)"
                )
                # The rest of the body may still trickle in: close rather than wait for it.
                await _send_json(
                    send, 408, error_body("bad_request", message_text), [(b"connection", b"close")]
                )
                return
            body = b"".join(chunks)
            del chunks
            scope.setdefault("state", {})["body_bytes"] = size
            sent = False

            async def replay() -> Message:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        await self.app(scope, receive, send)


def _too_large(limit: int, setting: str) -> str:
    return f"request body larger than {limit} bytes (the limit {setting} = {limit})"
