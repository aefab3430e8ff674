"""Every error the API can answer has the one declared shape, ``ErrorBody``, whichever layer produced it
(raas's typed errors, request validation, Starlette's routing, unexpected exceptions, the guard
middleware), and the OpenAPI document declares it for every error status."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import pytest

from raas.api.models import ErrorBody
from tests.api.conftest import APIFactory, LiveAPI

pytestmark = pytest.mark.integration


def assert_error_body(r: Any, status: int, kind: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    parsed = ErrorBody.model_validate(body)
    assert parsed.error.kind == kind and parsed.detail == parsed.error.message and parsed.detail
    assert set(body) <= {"detail", "error", "errors"}
    return body  # type: ignore[no-any-return]


async def raw_exchange(api: LiveAPI, data: bytes) -> tuple[bytes, bytes]:
    host, port = urlsplit(api.url).hostname, urlsplit(api.url).port
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        response = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return head, body


async def test_each_layer_answers_errors_in_the_declared_shape(make_api: APIFactory) -> None:
    api = await make_api(max_request_bytes=4096)
    c = api.client

    assert_error_body(await c.get("/v1/jobs/nope"), 404, "not_found")  # RaasError
    # A schema-invalid body (an empty data_source; a missing one is inferred or refused with a 400).
    r = await c.post("/v1/jobs", json={"instance": {"data_source": ""}})
    body = assert_error_body(r, 422, "bad_request")
    assert body["errors"] and all(isinstance(x, str) for x in body["errors"][0]["loc"])
    assert_error_body(await c.get("/v1/nowhere"), 404, "not_found")  # Starlette's router
    r = await c.put("/v1/jobs/x")
    assert_error_body(r, 405, "bad_request")
    assert r.headers["allow"] == "GET, DELETE"  # every route of the path, not just the first
    r = await c.post("/v1/jobs", content=b"x" * 5000, headers={"content-type": "application/json"})
    assert_error_body(r, 413, "payload_too_large")  # the guard middleware
    for garbage in (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}", b"\x00\r\n\r\n"):
        head, body = await raw_exchange(api, garbage)  # what the HTTP parser itself refuses
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower()
        assert ErrorBody.model_validate_json(body).error.kind == "bad_request"
    r = await c.post("/v1/jobs", json={"instance": {"data_source": "nope"}})
    assert_error_body(r, 400, "bad_request")
    assert_error_body(await c.post("/stop"), 503, "unavailable")  # ProRL's lifecycle


async def test_an_unexpected_exception_is_a_500_in_the_declared_shape(make_api: APIFactory) -> None:
    api = await make_api()

    async def broken() -> None:
        raise RuntimeError("a bug")

    # A test-only route on the real app: nothing in raas fails like this on purpose.
    api.served.uvicorn_config.app.add_api_route("/test-broken", broken)  # type: ignore[union-attr]
    body = assert_error_body(await api.client.get("/test-broken"), 500, "internal")
    assert "RuntimeError" in body["detail"] and "a bug" not in body["detail"]


async def test_the_token_guard_answers_in_the_declared_shape(make_api: APIFactory) -> None:
    api = await make_api(api_token="s3cret")
    r = await api.client.get("/status")
    assert_error_body(r, 401, "unauthorized")
    assert r.headers["www-authenticate"] == "Bearer"


async def test_openapi_declares_error_body_for_every_error_status(make_api: APIFactory) -> None:
    api = await make_api()
    spec = (await api.client.get("/openapi.json")).json()
    assert "HTTPValidationError" not in spec["components"]["schemas"]  # FastAPI's own 422 shape is gone
    for path, item in spec["paths"].items():
        for method, op in item.items():
            errors = {code: r for code, r in op["responses"].items() if code[0] in "45"}
            assert {"500", "503"} <= set(errors), (method, path)
            for code, response in errors.items():
                ref = response["content"]["application/json"]["schema"]["$ref"]
                allowed = {"#/components/schemas/ErrorBody", "#/components/schemas/ProcessFailure"}
                assert ref in allowed, (method, path, code, ref)
