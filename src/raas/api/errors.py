"""How raas errors look on the wire: an HTTP status chosen by ``kind`` and one body shape, the OpenAPI
schema ``ErrorBody``: ``{"detail": message, "error": {stage, kind, message}}`` (plus ``errors``, the
per-field problems, on a 422).

``detail`` is FastAPI's and the ProRL server's field, so clients of either API read a clear message.
Every error path answers in this shape: raas's typed errors, validation errors, Starlette's HTTP errors
(404, 405), unexpected exceptions (500), and the guards that run before routing (401, 408, 413, 503).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from raas.errors import RaasError, route_error
from raas.errors import error_body as error_body
from raas.pipeline.admission import Overloaded

STATUS_OF_KIND: dict[str, int] = {
    "bad_request": 400,
    "not_found": 404,
    "payload_too_large": 413,
    "overloaded": 429,
    "unavailable": 503,
    "llm_unavailable": 503,
    "timeout": 504,
}


def error_response(exc: RaasError) -> JSONResponse:
    status = STATUS_OF_KIND.get(exc.kind, 500)
    headers = {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    return JSONResponse(
        error_body(exc.kind, exc.message, exc.stage or "api"), status_code=status, headers=headers
    )


def _summarize(errors: list[Any]) -> str:
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    more = f" (+{len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route accepts for this request's path (asked of the routes themselves)."""
    routes = request.app.router.routes
    return [
        method
        for method in HTTP_METHODS
        if any(route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes)
    ]


def install(app: FastAPI) -> None:
    """Map RaasError, validation errors and HTTP errors to the uniform body."""

    @app.exception_handler(RaasError)
    async def _raas(request: Request, exc: RaasError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {
                "loc": [str(x) for x in e.get("loc", ())],
                "msg": str(e.get("msg", "invalid")),
                "type": str(e.get("type", "value_error")),
            }
            for e in exc.errors()
        ]
        body = error_body("bad_request", _summarize(errors))
        body["errors"] = errors
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {401: "unauthorized", 404: "not_found", 405: "bad_request", 413: "payload_too_large"}.get(
            exc.status_code, "bad_request" if exc.status_code < 500 else "internal"
        )
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            # Starlette names only the first route that matched the path; a path served by several
            # routes (GET and DELETE /v1/jobs/{job_id}) allows all their methods.
            headers["Allow"] = ", ".join(allowed_methods(request))
        message = route_error(
            exc.status_code, request.method, request.url.path, str(exc.detail), headers.get("Allow")
        )
        return JSONResponse(error_body(kind, message), status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not a bad request: answer in the documented shape (Starlette re-raises the exception
        # after this response, so the server still logs it with its traceback).
        return JSONResponse(
            error_body("internal", f"internal error ({type(exc).__name__}); see the service log"),
            status_code=500,
        )
