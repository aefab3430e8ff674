"""How raas errors look on the wire: an HTTP status chosen by ``kind`` and a ``{stage, kind, message}`` body.

Every error body also carries ``detail`` (FastAPI's and the ProRL server's convention), so clients of
either API read a clear message.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from raas.errors import RaasError
from raas.pipeline.service import Overloaded

STATUS_OF_KIND: dict[str, int] = {
    "bad_request": 400,
    "not_found": 404,
    "payload_too_large": 413,
    "overloaded": 429,
    "unavailable": 503,
    "llm_unavailable": 503,
    "timeout": 504,
}


def error_body(kind: str, message: str, stage: str | None = "api") -> dict[str, Any]:
    return {"detail": message, "error": {"stage": stage, "kind": kind, "message": message}}


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


def install(app: FastAPI) -> None:
    """Map RaasError, validation errors and HTTP errors to the uniform body."""

    @app.exception_handler(RaasError)
    async def _raas(request: Request, exc: RaasError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in exc.errors()]
        body = error_body("bad_request", _summarize(errors))
        body["errors"] = [{**e, "loc": [str(x) for x in e.get("loc", ())]} for e in errors]
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {401: "unauthorized", 404: "not_found", 405: "bad_request", 413: "payload_too_large"}.get(
            exc.status_code, "bad_request" if exc.status_code < 500 else "internal"
        )
        return JSONResponse(
            error_body(kind, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )
