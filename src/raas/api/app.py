"""The FastAPI application: native ``/v1`` routes, ProRL-compatible routes, health, status, metrics and the\nlive dashboard (:mod:`raas.api.dashboard`)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from types import FrameType

import uvicorn
from fastapi import FastAPI
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from raas.api import dashboard, errors, inspector, native, prorl, rollouts
from raas.api.dashboard_stats import ServiceStats
from raas.api.inspector_data import LedgerJobs
from raas.api.limits import HttpLimits, fit_to_fd_limit, guarded_protocol
from raas.api.middleware import GuardMiddleware
from raas.api.protocol import Served
from raas.errors import RaasError
from raas.pipeline.config import ServiceConfig

log = logging.getLogger("raas.api")


def create_app(service: Served, *, manage_service: bool = True) -> FastAPI:
    """An app serving ``service``. With ``manage_service`` the app starts the service on startup and shuts
    it down (gracefully, ``shutdown_grace_s``) when the server stops."""

    stats = ServiceStats(service)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_service:
            await service.start()
        try:
            await stats.start()
            yield
        finally:
            await stats.aclose()
            if manage_service:
                await service.shutdown()

    app = FastAPI(
        title="raas",
        summary="Rollout-as-a-Service: sandboxed, token-exact multi-turn agent rollouts for RL",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.prorl = prorl.ProRLGate()
    errors.install(app)
    app.include_router(native.router)
    app.include_router(rollouts.router)
    app.include_router(prorl.router)
    app.mount("/gateway", _GatewayRoutes(service), name="gateway")
    cfg = service.config
    dashboard.install(app, stats, cfg.token)
    ledger = getattr(service, "ledger", None)
    if ledger is not None:  # a rollout service (a cluster router has no ledger of jobs)

        def decoder() -> inspector.Decoder | None:
            tokenizer = getattr(service, "tokenizer", None)
            return tokenizer.decode if tokenizer is not None else None

        inspector.install(app, LedgerJobs(ledger.path), decoder)
    app.add_middleware(
        GuardMiddleware,
        max_bytes=cfg.max_request_bytes,
        max_batch_bytes=cfg.max_batch_bytes,
        body_timeout_s=cfg.http_body_timeout_s,
        token=cfg.token,
    )
    return app


class _GatewayRoutes:
    """The agent gateway's routes under ``/gateway`` (OpenAI ``/gateway/v1/...``, Anthropic
    ``/gateway/v1/messages``), attributed by each rollout's key; the gateway exists once the service runs.
    A cluster router has none: its rollouts reach the gateway of the node that runs them."""

    def __init__(self, service: Served) -> None:
        self.service = service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gateway = getattr(self.service, "gateway", None)
        if gateway is None:
            body = errors.error_body(
                "unavailable", "no agent gateway here (not started, or a cluster router)"
            )
            await JSONResponse(body, status_code=503)(scope, receive, send)
            return
        await gateway.app(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn, plus: when a stop signal arrives, end the event streams at once (otherwise an open SSE
    connection would hold the server's graceful shutdown for its whole timeout). Without
    ``handle_signals`` it installs no signal handlers: its owner decides when it stops."""

    def __init__(self, config: uvicorn.Config, service: Served, *, handle_signals: bool = True) -> None:
        super().__init__(config)
        self._service = service
        self._handle_signals = handle_signals

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if not self._handle_signals:
            yield
            return
        with super().capture_signals():
            yield

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().call_soon_threadsafe(self._service.close_event_streams)
        super().handle_exit(sig, frame)


def server_config(
    app: FastAPI,
    config: ServiceConfig,
    *,
    host: str | None = None,
    port: int | None = None,
    log_level: str = "info",
    fit_fd_limit: bool = True,
) -> uvicorn.Config:
    """The uvicorn settings every raas server runs with: the header deadline and connection cap of
    :mod:`raas.api.limits`, the keep-alive timeout and a graceful-stop timeout from ``config``.
    ``fit_fd_limit`` raises this process's open-file limit for the cap (or lowers the cap to fit)."""
    limits = HttpLimits(
        header_timeout_s=config.http_header_timeout_s, max_connections=config.http_max_connections
    )
    if fit_fd_limit:
        limits = fit_to_fd_limit(limits)
    return uvicorn.Config(
        app,
        host=host or config.host,
        port=config.port if port is None else port,
        http=guarded_protocol(limits),
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=config.http_keep_alive_s,  # type: ignore[arg-type]  # any number works
        timeout_graceful_shutdown=int(config.shutdown_grace_s) + 5,
        backlog=min(2048, limits.max_sockets),
    )


def is_loopback(host: str) -> bool:
    """True when ``host`` is reachable only from this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # any other name may resolve to a public address


def check_exposure(config: ServiceConfig, host: str) -> None:
    """Refuse to serve a non-loopback address without a bearer token unless ``insecure`` says so: the API
    runs jobs whose handlers execute code, so an open port is an open door."""
    if is_loopback(host) or config.token():
        return
    if not config.insecure:
        raise RaasError(
            f"refusing to serve {host} without an API token: anyone who can reach it could submit jobs. "
            "Set RAAS_API_TOKEN (or api_token in the config), or pass --insecure (insecure = true) to "
            "serve it without one",
            kind="bad_request",
        )
    log.warning(
        "serving %s WITHOUT an API token (--insecure): anyone who can reach it can submit jobs; "
        "set RAAS_API_TOKEN to require one",
        host,
    )


def listen_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A bound TCP socket for uvicorn to serve on.

    The protocol must be given as ``IPPROTO_TCP``: asyncio sets ``TCP_NODELAY`` on accepted connections
    only when the listening socket says it is TCP, and without it every small response waits for the
    client's delayed ACK (about 40 ms per HTTP call)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def serve(
    service: Served, *, host: str | None = None, port: int | None = None, log_level: str = "info"
) -> None:
    """Serve ``service`` over HTTP until SIGINT/SIGTERM, then shut it down gracefully.

    ``raas serve`` and ``python -m raas.api`` come through here (``raas run`` through :func:`served`).
    The service is started before anything listens, so an unusable ledger or state dir ends the call
    with its typed error (no server, no traceback) rather than with a server that answers 500."""
    host = host or service.config.host
    check_exposure(service.config, host)
    await service.start()
    try:
        # The app's lifespan shuts the service down inside uvicorn's own shutdown: uvicorn re-raises the
        # stop signal once it returns, so nothing after ``serve()`` is sure to run.
        config = server_config(create_app(service), service.config, host=host, port=port, log_level=log_level)
        await _Server(config, service).serve()
    finally:
        await service.shutdown()  # a no-op after a normal stop; closes the service if uvicorn never ran


@asynccontextmanager
async def served(
    service: Served,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    fit_fd_limit: bool = True,
) -> AsyncIterator[str]:
    """Serve ``service`` in this event loop for the length of the block (on a free port by default) with
    the settings of :func:`serve`, and yield its base URL. It installs no signal handlers: leaving the
    block stops the server (event streams first), then shuts the service down."""
    check_exposure(service.config, host)
    await service.start()
    sock: socket.socket | None = None
    try:
        sock = listen_socket(host, port)
        port = sock.getsockname()[1]
        config = server_config(
            create_app(service),
            service.config,
            host=host,
            port=port,
            log_level=log_level,
            fit_fd_limit=fit_fd_limit,
        )
        server = _Server(config, service, handle_signals=False)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            while not server.started:
                if task.done():
                    task.result()
                    raise RaasError("the API server stopped during start-up", kind="internal")
                await asyncio.sleep(0.02)
            yield f"http://{host}:{port}"
        finally:
            # End the event streams first: an open SSE connection would hold uvicorn's graceful stop.
            service.close_event_streams()
            server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(task, 15)
    finally:
        if sock is not None:
            sock.close()
        await service.shutdown()
