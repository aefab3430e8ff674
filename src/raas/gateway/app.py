"""The gateway's HTTP routes: OpenAI Chat Completions and Responses, Anthropic Messages, models.

Every request belongs to exactly one rollout. On a rollout's own Unix socket (the one bound into its
sandbox) the socket says which, and the request must also carry that rollout's key; on the service's
TCP port (mounted at ``/gateway``) the key alone says which. A missing, unknown, revoked or other
rollout's key is refused with the API's authentication error.

A client that disconnects while its request waits or generates cancels it: nothing is recorded for a
reply nobody received. ``stream: true`` requests are answered as the reply is generated
(:mod:`raas.gateway.streaming`).

``POST /v1/rollouts/{id}/close`` (service port only) ends an external rollout with that rollout's key
(:mod:`raas.gateway.external`).

An unknown path or an unsupported method is answered (404, 405 with ``Allow``) in the raas API's error body
(:func:`raas.errors.error_body`), whose ``error.message`` the OpenAI and Anthropic SDKs also read.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from raas.errors import RaasError, error_body, route_error
from raas.gateway import shapes, streaming
from raas.gateway.external import Closing
from raas.gateway.messages import ChatRequest, from_chat, from_messages, from_responses
from raas.gateway.session import Completion, GatewaySession, TextStream

if TYPE_CHECKING:
    from raas.gateway.gateway import Gateway

log = logging.getLogger("raas.gateway")

SESSION_SCOPE_KEY = "raas.gateway.session"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
CLOSE_RECORD_TIMEOUT_S = 120.0
"""How long a close waits for its record to be committed before answering 503 (the ledger is stalled)."""


def request_key(request: Request) -> str | None:
    """The API key a request carries: ``Authorization: Bearer``, ``x-api-key`` (Anthropic) or ``api-key``."""
    auth = request.headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    for name in ("x-api-key", "api-key"):
        if request.headers.get(name):
            return request.headers[name].strip()
    return None


def create_gateway_app(gateway: Gateway) -> Starlette:
    """The routes, attributing requests through ``gateway`` (see the module docstring)."""

    def session_of(request: Request) -> GatewaySession:
        key = request_key(request)
        bound: GatewaySession | None = request.scope.get(SESSION_SCOPE_KEY)
        if bound is not None:
            if key is None or not hmac.compare_digest(key.encode(), bound.key.encode()):
                raise RaasError(
                    "invalid API key for this rollout's endpoint", kind="unauthorized", stage="run"
                )
            return bound
        session = gateway.session_for_key(key) if key else None
        if session is None:
            raise RaasError(
                "invalid API key: no running rollout has it"
                if key
                else "no API key: send the rollout's key as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                kind="unauthorized",
                stage="run",
            )
        session.last_active = time.monotonic()
        return session

    async def read_json(request: Request) -> dict[str, Any]:
        limit = gateway.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RaasError(f"request body larger than {limit} bytes", kind="payload_too_large", stage="run")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RaasError(
                    f"request body larger than {limit} bytes", kind="payload_too_large", stage="run"
                )
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as exc:
            raise RaasError(f"request body is not JSON: {exc}", kind="bad_request", stage="run") from None
        if not isinstance(body, dict):
            raise RaasError("request body must be a JSON object", kind="bad_request", stage="run")
        return body

    def endpoint(
        api: str, parse: Callable[[GatewaySession, dict[str, Any]], ChatRequest]
    ) -> Callable[[Request], Any]:
        async def handle(request: Request) -> Response:
            try:
                session = session_of(request)
                req = parse(session, await read_json(request))
                return await serve(request, session, req)
            except RaasError as exc:
                return JSONResponse(shapes.error_body(api, exc), status_code=shapes.error_status(exc))
            except Exception as exc:  # a bug of raas's own: still the API's JSON, never a bare 500 page
                log.exception("gateway %s request failed", api)
                error = RaasError(f"internal gateway error: {type(exc).__name__}: {exc}", kind="internal")
                return JSONResponse(shapes.error_body(api, error), status_code=500)

        return handle

    async def serve_incremental(request: Request, session: GatewaySession, req: ChatRequest) -> Response:
        """A streamed request: the reply's text goes out as it is generated.
        Until its first piece (or the first keep-alive interval), a failure is still an HTTP error."""
        stream = TextStream()
        task = asyncio.create_task(session.complete(req, stream))
        started = asyncio.create_task(stream.started.wait())
        gone = asyncio.create_task(_disconnected(request))
        try:
            await asyncio.wait(
                {task, started, gone}, timeout=gateway.keepalive_s, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:
            task.cancel()
            raise
        finally:
            for waiter in (started, gone):
                waiter.cancel()
                with contextlib.suppress(BaseException):
                    await waiter
        if gone.done() and not gone.cancelled() and not task.done():
            task.cancel()  # the client left: do not record a reply nobody will read
            with contextlib.suppress(BaseException):
                await task
            return Response(status_code=499)
        if task.done() and not stream.started.is_set():
            task.result()  # a RaasError is the endpoint's error answer; a reply with no text streams below
        response_id = f"resp_{uuid.uuid4().hex[:24]}"

        def remember(completion: Completion) -> None:
            if req.api == "responses":
                session.remember_response(response_id, _conversation_after(req, completion))

        w = streaming.writer(req, gateway.model_name, response_id)
        return StreamingResponse(
            streaming.incremental(task, stream, req, w, gateway.keepalive_s, remember),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )

    async def serve(request: Request, session: GatewaySession, req: ChatRequest) -> Response:
        if req.stream:
            return await serve_incremental(request, session, req)
        response_id = f"resp_{uuid.uuid4().hex[:24]}"
        task = asyncio.create_task(session.complete(req))
        gone = asyncio.create_task(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            gone.cancel()
            with contextlib.suppress(BaseException):
                await gone
        if task not in done:  # the client left: do not record a reply nobody will read
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return Response(status_code=499)
        completion = task.result()  # a RaasError propagates to the endpoint's error answer
        if req.api == "responses":
            session.remember_response(response_id, _conversation_after(req, completion))
        return JSONResponse(_body(req, completion, gateway.model_name, response_id))

    async def models(request: Request) -> Response:
        try:
            session_of(request)
        except RaasError as exc:
            return JSONResponse(shapes.error_body("chat", exc), status_code=shapes.error_status(exc))
        model = {"id": gateway.model_name, "object": "model", "created": 0, "owned_by": "raas"}
        return JSONResponse({"object": "list", "data": [model]})

    def parse_responses(session: GatewaySession, body: dict[str, Any]) -> ChatRequest:
        prev = body.get("previous_response_id")
        history = session.history_of(prev) if isinstance(prev, str) else None
        return from_responses(body, history)

    async def close_rollout(request: Request) -> Response:
        """An external rollout's agent ends it (optionally with its final ``answer``/``patch``)."""
        rollout_id = request.path_params["rollout_id"]
        try:
            if request.scope.get(SESSION_SCOPE_KEY) is not None:
                raise RaasError("rollouts are closed on the service's /gateway routes", kind="not_found")
            raw = await read_json(request) if await _has_body(request) else {}
            closing = Closing(
                answer=_opt_str(raw, "answer"),
                patch=_opt_str(raw, "patch"),
                metadata=_opt_dict(raw, "metadata"),
            )
            unknown = sorted(set(raw) - {"answer", "patch", "metadata"})
            if unknown:
                raise RaasError(
                    f"unknown field(s) in the close body: {', '.join(unknown)}", kind="bad_request"
                )
            rollout = gateway.external.close(rollout_id, request_key(request), closing)
            # acknowledged is durable: answered once the record RUN made of the close is committed, so a
            # crash after this answer resumes the rollout at EVAL instead of losing it
            if not await rollout.wait_recorded(CLOSE_RECORD_TIMEOUT_S):
                raise RaasError(
                    f"rollout {rollout_id} was closed but its record was not committed (its job ended first, "
                    f"or the service is stopping): see GET /v1/jobs/{rollout_id}/result",
                    kind="unavailable",
                    stage="run",
                )
        except RaasError as exc:
            return JSONResponse(
                error_body(exc.kind, exc.message, exc.stage or "run"), status_code=shapes.error_status(exc)
            )
        return JSONResponse({"rollout_id": rollout_id, "job_id": rollout_id, "status": "closed"})

    routes = [
        Route("/v1/chat/completions", endpoint("chat", lambda s, b: from_chat(b)), methods=["POST"]),
        Route("/v1/responses", endpoint("responses", parse_responses), methods=["POST"]),
        Route("/v1/messages", endpoint("messages", lambda s, b: from_messages(b)), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/rollouts/{rollout_id}/close", close_rollout, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _routing_error})


_ORDER = {m: i for i, m in enumerate(("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"))}


async def _routing_error(request: Request, exc: Exception) -> Response:
    """Starlette's router found no route (404) or not this method (405): JSON, never its plain text."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    headers = dict(getattr(exc, "headers", None) or {})
    detail = str(getattr(exc, "detail", "")) or "internal error"
    kind = {404: "not_found", 413: "payload_too_large"}.get(
        status, "bad_request" if status < 500 else "internal"
    )
    allowed = None
    for name in [k for k in headers if k.lower() == "allow"]:
        # Starlette joins a set: put the methods in one order, so the header is the same every time.
        methods = {m.strip() for m in headers.pop(name).split(",") if m.strip()}
        allowed = headers["Allow"] = ", ".join(sorted(methods, key=lambda m: (_ORDER.get(m, 99), m)))
    message = route_error(status, request.method, request.url.path, detail, allowed)
    return JSONResponse(error_body(kind, message), status_code=status, headers=headers)


async def _has_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    return length != "0" if length is not None else "transfer-encoding" in request.headers


def _opt_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise RaasError(f"'{name}' must be a string", kind="bad_request", stage="run")
    return value


def _opt_dict(body: dict[str, Any], name: str) -> dict[str, Any]:
    value = body.get(name, {})
    if not isinstance(value, dict):
        raise RaasError(f"'{name}' must be a JSON object", kind="bad_request", stage="run")
    return value


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _conversation_after(req: ChatRequest, c: Completion) -> list[dict[str, Any]]:
    reply: dict[str, Any] = {"role": "assistant", "content": c.content}
    if c.tool_calls:
        reply["tool_calls"] = c.tool_calls
    return [*req.messages, reply]


def _body(req: ChatRequest, c: Completion, model: str, response_id: str) -> dict[str, Any]:
    if req.api == "chat":
        return shapes.chat_body(c, req, model)
    if req.api == "responses":
        return shapes.responses_body(c, req, model, response_id)
    return shapes.messages_body(c, req, model)
