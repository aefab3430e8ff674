"""The live dashboard: ``/dashboard``, a plain HTML + JS page fed by Server-Sent Events.

Self-contained so that any raas front end can mount it: :func:`install` adds the routes to a FastAPI app
and takes a :class:`StatsSource`. :class:`raas.api.dashboard_stats.ServiceStats` is the one
``create_app`` uses, for anything with ``status()`` and ``events()``: a rollout service, or a cluster
router, whose ``status()["nodes"]`` becomes the page's node table. The static files under ``raas/api/static/`` are read as package data:
no build step, no third-party script.

Routes (all ``GET`` but the login):

* ``/dashboard`` — the page; ``/dashboard/static/{name}`` — its script and stylesheet;
* ``/dashboard/events`` — SSE: one ``history`` event (the recent time series), then a ``snapshot`` event
  every ``interval_s``. At most ``max_clients`` streams at once (503 beyond); a stream ends when its
  client leaves or the source ends (server shutdown);
* ``/dashboard/snapshot`` — the current snapshot as JSON (what a router polls from its nodes);
* ``POST /dashboard/login`` — the browser's way in when ``RAAS_API_TOKEN`` is set (see below).

Auth is the API's: with a token set, the page, its events and its snapshot need ``Authorization: Bearer
<token>`` (the login and the static script and stylesheet, the same in every install, are open). A
browser cannot send that header on a page load or an ``EventSource``, so the page also accepts a session
cookie: ``GET /dashboard`` without credentials answers 401 with a login form; posting the token to
``/dashboard/login`` sets ``raas_dashboard`` (HttpOnly, SameSite=Strict, scoped to the dashboard's path),
whose value is an HMAC of the token, not the token. That cookie opens only ``GET`` requests under
``/dashboard``: it cannot submit or cancel jobs, and a stolen one does not reveal the token. The token
never travels in a URL, so it is not left in browser history or proxy logs.

Snapshot keys (every one optional to the page): ``t``, ``accepting``, ``pending``, ``max_pending``,
``stages`` (``{stage: {queued, active, workers}}``), ``finished`` (``{status: n}``), ``throughput``
(``{window_s, rollouts_per_s, completed_per_s}``), ``reward`` (``{count, mean, min, max, histogram:
{edges, counts}}``), ``failure_kinds`` (``[{stage, kind, count}]``), ``recent_failures`` (``[{at,
job_id, instance_id, status, stage, kind, message}]``, newest first), ``llm`` (``{paused, in_flight,
servers: [...]}`` as ``GET /v1/llm/servers``), ``sandboxes`` (``{live, items: [{id, backend, owner,
age_s}]}``, absent where nothing runs sandboxes), ``ledger`` (``{status: n}``), ``nodes`` (``[{node_id,
url, host, healthy, jobs, load, capacity, llm_servers, error}]``, a cluster router's ``status()["nodes"]``)
and ``point`` (the newest history point: ``{t, queued: {stage: n}, active: {stage: n}, rollouts_per_s,
finished}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import html
import json
from collections.abc import AsyncIterator, Callable, Iterable
from importlib import resources
from typing import Any, Protocol
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from raas.api.errors import error_body

DASHBOARD_PATH = "/dashboard"
LOGIN_PATH = DASHBOARD_PATH + "/login"
COOKIE_NAME = "raas_dashboard"
_COOKIE_LABEL = b"raas-dashboard-session-v1"
_STATIC = ("dashboard.js", "dashboard.css")
_STATIC_PATHS = frozenset(f"{DASHBOARD_PATH}/static/{name}" for name in _STATIC)
_MEDIA = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
# The page loads only its own script and stylesheet and talks only to its own origin: even a bug that
# put markup into the page could not run an inline script or load one from elsewhere.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


class StatsSource(Protocol):
    """What the dashboard reads. ``snapshot`` must be cheap (every open page calls it every interval);
    ``history`` is the recent series of ``point`` dicts, oldest first; ``ended`` is set when the source
    stops (the server is shutting down), which ends every open stream."""

    @property
    def ended(self) -> asyncio.Event: ...

    async def snapshot(self) -> dict[str, Any]: ...

    def history(self) -> list[dict[str, Any]]: ...


# -- auth --------------------------------------------------------------------------------------------


def session_value(token: str) -> str:
    """The cookie's value for ``token``: an HMAC, so the cookie does not carry the API token itself."""
    return hmac.new(token.encode(), _COOKIE_LABEL, hashlib.sha256).hexdigest()


def is_dashboard_path(path: str) -> bool:
    return path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


def _cookie(headers: Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    for key, value in headers:
        if key != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            k, sep, v = part.strip().partition("=")
            if sep and k == name:
                return v
    return None


def is_open_path(path: str) -> bool:
    """The login and the page's script and stylesheet (the same in every install) need no credentials."""
    return path == LOGIN_PATH or path in _STATIC_PATHS


def cookie_allows(scope: Scope, token: str) -> bool:
    """True when a ``GET``/``HEAD`` under ``/dashboard`` carries the session cookie for ``token``. Nothing
    else is opened by the cookie, so a cross-site request riding on it can change nothing."""
    if scope.get("method") not in ("GET", "HEAD") or not is_dashboard_path(str(scope.get("path", ""))):
        return False
    given = _cookie(scope.get("headers", []), COOKIE_NAME)
    return given is not None and hmac.compare_digest(given.encode(), session_value(token).encode())


def login_page(message: str = "") -> bytes:
    """The form a browser without credentials gets (with a 401). No script; the token is posted."""
    note = f'<p class="note">{html.escape(message)}</p>' if message else ""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8><title>raas dashboard: sign in</title>"
        '<link rel=icon href="data:,">'
        f'<link rel=stylesheet href="{DASHBOARD_PATH}/static/dashboard.css"></head>'
        '<body class="login"><main><h1>raas dashboard</h1>'
        "<p>This service requires its API token (<code>RAAS_API_TOKEN</code>).</p>"
        f'{note}<form method=post action="{LOGIN_PATH}">'
        "<label>API token <input id=token name=token type=password autocomplete=off required></label>"
        "<button id=login type=submit>Open dashboard</button></form></main></body></html>"
    ).encode()


def unauthorized_response(path: str) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The body and headers of a 401 under ``/dashboard``: the login form for the page, JSON otherwise."""
    if path == DASHBOARD_PATH:
        headers = [(b"content-type", b"text/html; charset=utf-8")]
        headers += [(k.lower().encode(), v.encode()) for k, v in PAGE_HEADERS.items()]
        return login_page(), headers
    body = json.dumps(error_body("unauthorized", "missing or wrong bearer token")).encode()
    return body, [(b"content-type", b"application/json")]


# -- the routes --------------------------------------------------------------------------------------


def _static(name: str) -> bytes:
    return resources.files("raas.api").joinpath("static", name).read_bytes()


class Dashboard:
    """The dashboard's routes over one :class:`StatsSource`. ``token`` returns the API token (or None)."""

    def __init__(
        self,
        source: StatsSource,
        token: Callable[[], str | None],
        *,
        interval_s: float = 1.0,
        max_clients: int = 16,
    ) -> None:
        self.source = source
        self.token = token
        self.interval_s = interval_s
        self.max_clients = max_clients
        self.clients = 0
        """Event streams open now (each is released when its client leaves or the source ends)."""
        self._page = _static("dashboard.html")
        self._assets = {name: _static(name) for name in _STATIC}
        self.router = self._routes()

    def _routes(self) -> APIRouter:
        router = APIRouter(include_in_schema=False)
        router.add_api_route(DASHBOARD_PATH, self.page, methods=["GET"])
        router.add_api_route(DASHBOARD_PATH + "/static/{name}", self.asset, methods=["GET"])
        router.add_api_route(DASHBOARD_PATH + "/snapshot", self.snapshot, methods=["GET"])
        router.add_api_route(DASHBOARD_PATH + "/events", self.events, methods=["GET"])
        router.add_api_route(LOGIN_PATH, self.login, methods=["POST"])
        return router

    async def page(self) -> Response:
        return Response(self._page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def asset(self, name: str) -> Response:
        data = self._assets.get(name)
        if data is None:
            return JSONResponse(error_body("not_found", f"no dashboard file {name!r}"), status_code=404)
        media = _MEDIA[name[name.rindex(".") :]]
        return Response(data, media_type=media, headers={"X-Content-Type-Options": "nosniff"})

    async def snapshot(self) -> JSONResponse:
        return JSONResponse(await self.source.snapshot(), headers={"Cache-Control": "no-store"})

    async def login(self, request: Request) -> Response:
        """Exchange the token (a form field) for the session cookie, then back to the page (303)."""
        expected = self.token()
        if not expected:
            return Response(status_code=303, headers={"Location": DASHBOARD_PATH})
        try:
            fields = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=4)
        except ValueError:  # more fields than a login form has
            fields = {}
        given = (fields.get("token") or [""])[0]
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return Response(
                login_page("Wrong token."),
                status_code=401,
                media_type="text/html; charset=utf-8",
                headers=PAGE_HEADERS,
            )
        response = Response(
            status_code=303, headers={"Location": DASHBOARD_PATH, "Cache-Control": "no-store"}
        )
        response.set_cookie(
            COOKIE_NAME,
            session_value(expected),
            path=DASHBOARD_PATH,
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def events(self) -> Response:
        if self.clients >= self.max_clients:
            return JSONResponse(
                error_body("unavailable", f"too many dashboard streams open (max {self.max_clients})"),
                status_code=503,
                headers={"Retry-After": "5"},
            )
        self.clients += 1  # released by _EventStream once the response is over, however it ended
        return _EventStream(self._stream(), self._release)

    def _release(self) -> None:
        self.clients -= 1

    async def _stream(self) -> AsyncIterator[bytes]:
        ended = self.source.ended
        yield b"retry: 2000\n\n"
        yield _event("history", self.source.history())
        while not ended.is_set():
            yield _event("snapshot", await self.source.snapshot())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), self.interval_s)


class _EventStream(StreamingResponse):
    """An SSE response that releases its stream slot when it is over: finished, failed, or cut short
    because the client left (the server then cancels it, or its next write fails)."""

    def __init__(self, body: AsyncIterator[bytes], release: Callable[[], None]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._release_slot = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release_slot()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def _event(name: str, data: Any) -> bytes:
    # json.dumps escapes newlines inside strings, so the data is one SSE line whatever it holds.
    return f"event: {name}\ndata: {json.dumps(data, allow_nan=False)}\n\n".encode()


def install(app: FastAPI, source: StatsSource, token: Callable[[], str | None], **options: Any) -> Dashboard:
    """Mount the dashboard on ``app`` (the app's auth middleware must let dashboard requests through
    :func:`cookie_allows`, as :class:`raas.api.middleware.GuardMiddleware` does)."""
    dashboard = Dashboard(source, token, **options)
    app.include_router(dashboard.router)
    app.state.dashboard = dashboard
    return dashboard
