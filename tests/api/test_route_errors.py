"""Unknown routes and unsupported methods answer the API's typed JSON error (``ErrorBody``) with 404 / 405,
over real HTTP, on the API's own routes and on the agent gateway mounted at ``/gateway`` (a bare Starlette
app, which would otherwise answer Starlette's plain text)."""

from __future__ import annotations

import pytest

from tests.api.conftest import APIFactory
from tests.api.test_error_bodies import assert_error_body

pytestmark = pytest.mark.integration


async def test_unknown_routes_and_methods_answer_json_everywhere(make_api: APIFactory) -> None:
    api = await make_api()
    c = api.client
    for path in ("/gateway/v1/nowhere", "/gateway/", "/gateway/v2/chat", "/nope", "/v1/nowhere/deeper"):
        body = assert_error_body(await c.get(path), 404, "not_found")
        assert body["detail"] == f"not found: no route GET {path}"
    r = await c.put("/v1/jobs")
    body = assert_error_body(r, 405, "bad_request")
    assert body["detail"] == "method not allowed: PUT /v1/jobs (allowed: POST)"
    assert r.headers["allow"] == "POST"
    for method, path, allow in (
        ("GET", "/gateway/v1/chat/completions", "POST"),
        ("DELETE", "/gateway/v1/messages", "POST"),
        ("POST", "/gateway/v1/models", "GET, HEAD"),
    ):
        r = await c.request(method, path)
        body = assert_error_body(r, 405, "bad_request")
        assert r.headers["allow"] == allow
        assert body["detail"] == f"method not allowed: {method} {path} (allowed: {allow})"
    # the routes themselves still answer in their own API's shape (an OpenAI error for a missing key)
    r = await c.post("/gateway/v1/chat/completions", json={"model": "p", "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
