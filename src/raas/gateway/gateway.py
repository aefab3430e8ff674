"""The agent gateway of one service: per-rollout sessions and the endpoints that reach them.

Each rollout gets a :class:`~raas.gateway.session.GatewaySession` with a key of its own. The sandbox the
agent runs in reaches it through a Unix socket created in that sandbox's run dir (the sandbox's only way
out: it has no network) and a loopback TCP port inside the sandbox that the tool server forwards to that
socket, so unmodified SDKs get an ordinary ``http://127.0.0.1:PORT`` base URL. The same routes are
mounted on the service's HTTP port under ``/gateway``, attributed by key alone (for sandboxes with a
network of their own, or agents outside raas: :attr:`Gateway.external`, :mod:`raas.gateway.external`).

Usage (what :class:`raas.tasks.harness.HarnessHandler` does)::

    session = gateway.open_session(job, agent=llm.agent)
    try:
        env = await gateway.expose(session, sandbox)   # OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_...
        ... run the agent in the sandbox with env ...
    finally:
        await gateway.close_session(session)
    run_output = session.run_output()
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from raas.agent.config import AgentConfig
from raas.core.executors import Executor
from raas.core.jobs import Job
from raas.errors import RaasError
from raas.gateway.app import SESSION_SCOPE_KEY, create_gateway_app
from raas.gateway.external import ExternalRollouts
from raas.gateway.session import GatewaySession
from raas.llm.balancer import LLMBalancer
from raas.llm.tokenizer import ChatTokenizer

if TYPE_CHECKING:
    from raas.sandbox import Sandbox

SOCKET_NAME = "gateway.sock"
DEFAULT_MODEL = "raas-policy"


class _Bound:
    """The gateway app, with every request on one socket attributed to that socket's session."""

    def __init__(self, app: ASGIApp, session: GatewaySession) -> None:
        self.app = app
        self.session = session

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, SESSION_SCOPE_KEY: self.session}
        await self.app(scope, receive, send)


class _QuietServer(uvicorn.Server):
    """uvicorn without signal handlers: the gateway decides when a rollout's server stops."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


def _capped(protocol: type[asyncio.Protocol], max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's protocol, closing connections beyond ``max_connections`` at once: code in a sandbox can
    open sockets to its gateway, and must not use up the service's file descriptors."""

    class Capped(protocol):  # type: ignore[valid-type, misc]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self._raas_refused = len(self.server_state.connections) >= max_connections
            if self._raas_refused:
                transport.close()
                return
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if not self._raas_refused:
                super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if not self._raas_refused:
                super().connection_lost(exc)

    return Capped


class _Endpoint:
    """One rollout's server on one Unix socket."""

    def __init__(
        self, server: _QuietServer, task: asyncio.Task[None], sock: socket.socket, path: str
    ) -> None:
        self.server = server
        self.task = task
        self.sock = sock
        self.path = path

    async def stop(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(self.task), 10)
        if not self.task.done():
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        self.sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


class Gateway:
    """See the module docstring. ``tokenizer`` may be None (sessions then refuse to open)."""

    def __init__(
        self,
        balancer: LLMBalancer,
        tokenizer: ChatTokenizer | None,
        *,
        model_name: str = DEFAULT_MODEL,
        max_body_bytes: int = 32 * 1024 * 1024,
        keepalive_s: float = 15.0,
        max_connections: int = 64,
        honor_request_sampling: bool = False,
    ) -> None:
        self.balancer = balancer
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        self.max_connections = max_connections
        self.honor_request_sampling = honor_request_sampling
        self.external = ExternalRollouts(self)
        """Rollouts whose agent runs outside raas (see :mod:`raas.gateway.external`)."""
        self.app = create_gateway_app(self)
        self._by_key: dict[str, GatewaySession] = {}
        self._endpoints: dict[str, list[_Endpoint]] = {}
        self._renderer = Executor("raas-gateway-render", 2)

    # -- sessions ---------------------------------------------------------------------------------------

    def open_session(
        self, job: Job, *, agent: AgentConfig | None = None, sampling_params: dict[str, Any] | None = None
    ) -> GatewaySession:
        """A new session for ``job``'s rollout, reachable by its key until :meth:`close_session`."""
        if self.tokenizer is None:
            raise RaasError(
                "the agent gateway needs the policy's chat tokenizer: start the service with --tokenizer DIR",
                kind="handler_error",
                stage="run",
            )
        key = "raas-" + secrets.token_urlsafe(32)
        session = GatewaySession(
            session_id=f"{job.job_id}-{secrets.token_hex(4)}",
            key=key,
            # Routing keys: the job (unique per rollout; trajectory_id repeats across groups) and its group.
            trajectory_id=job.job_id,
            group_id=job.group_key,
            tokenizer=self.tokenizer,
            balancer=self.balancer,
            agent=agent or AgentConfig(),
            renderer=self._renderer,
            sampling_params=job.sampling_params if sampling_params is None else sampling_params,
            honor_request_sampling=self.honor_request_sampling,
        )
        self._by_key[key] = session
        return session

    def session_for_key(self, key: str) -> GatewaySession | None:
        session = self._by_key.get(key)
        return None if session is None or session.closed else session

    @property
    def sessions(self) -> list[GatewaySession]:
        return list(self._by_key.values())

    async def close_session(self, session: GatewaySession) -> None:
        """Revoke the session's key and stop its endpoints (idempotent)."""
        session.closed = True
        self._by_key.pop(session.key, None)
        for endpoint in self._endpoints.pop(session.id, []):
            await endpoint.stop()

    # -- endpoints ----------------------------------------------------------------------------------------

    async def serve_socket(self, session: GatewaySession, sock: socket.socket, path: str) -> None:
        """Serve the routes on a listening Unix socket, every request attributed to ``session``."""
        config = uvicorn.Config(
            _Bound(self.app, session),
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=60,
            h11_max_incomplete_event_size=64 * 1024,
        )
        config.load()
        config.http_protocol_class = _capped(config.http_protocol_class, self.max_connections)
        server = _QuietServer(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"raas-gateway-{session.id}")
        # Registered before it is up: closing the session stops it whatever happens from here on.
        endpoint = _Endpoint(server, task, sock, path)
        self._endpoints.setdefault(session.id, []).append(endpoint)
        while not server.started:  # uvicorn has no started event
            if task.done():
                self._endpoints[session.id].remove(endpoint)
                await endpoint.stop()
                task.result()
                raise RaasError("the gateway endpoint stopped during start-up", kind="internal", stage="run")
            await asyncio.sleep(0.001)

    async def expose(self, session: GatewaySession, sandbox: Sandbox) -> dict[str, str]:
        """Make ``session`` reachable from inside ``sandbox`` and return the environment an agent there
        needs (OpenAI and Anthropic SDKs, LiteLLM): a socket in the sandbox's run dir, served here, and a
        loopback port inside the sandbox that the tool server forwards to it."""
        sock, inner = sandbox.listen_in_run_dir(SOCKET_NAME)
        await self.serve_socket(session, sock, str(sandbox.run_dir / SOCKET_NAME))
        info = await sandbox.tools.request("gateway", "forward", {"socket": inner})
        base = f"http://127.0.0.1:{int(info['port'])}"
        return gateway_env(base, session.key, self.model_name, socket=inner)

    async def aclose(self) -> None:
        """Close every session (their endpoints stop; their keys stop working)."""
        for session in list(self._by_key.values()):
            await self.close_session(session)
        for sid in list(self._endpoints):
            for endpoint in self._endpoints.pop(sid):
                await endpoint.stop()
        await self._renderer.aclose()


def gateway_env(base: str, key: str, model: str, *, socket: str | None = None) -> dict[str, str]:
    """Environment variables that point the common agent SDKs at a gateway endpoint ``base``."""
    env = {
        "OPENAI_BASE_URL": f"{base}/v1",
        "OPENAI_API_BASE": f"{base}/v1",
        "OPENAI_API_KEY": key,
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": key,
        "RAAS_GATEWAY_URL": base,
        "RAAS_GATEWAY_KEY": key,
        "RAAS_MODEL": model,
    }
    if socket:
        env["RAAS_GATEWAY_SOCKET"] = socket
    return env
