"""On a rollout's own socket the gateway answers an unknown path or method with the API's typed JSON error
(404, 405 with ``Allow``), not Starlette's plain text; the OpenAI SDK reads its message."""

from __future__ import annotations

import openai
import pytest
from tests.gateway.conftest import scripted_rig

from raas.api.models import ErrorBody
from raas.llm.tokenizer import ChatTokenizer

pytestmark = pytest.mark.integration


async def test_unknown_route_and_method_on_a_rollout_socket(tok: ChatTokenizer) -> None:
    async with scripted_rig(tok, ["ok"]) as rig:
        ep = await rig.open()
        async with ep.http() as http:
            r = await http.get("/v1/embeddings", headers={"authorization": f"Bearer {ep.session.key}"})
            assert r.status_code == 404 and r.headers["content-type"] == "application/json"
            body = ErrorBody.model_validate(r.json())
            assert body.error.kind == "not_found" and body.detail == "not found: no route GET /v1/embeddings"
            r = await http.get("/v1/chat/completions")
            assert r.status_code == 405 and r.headers["allow"] == "POST"
            body = ErrorBody.model_validate(r.json())
            assert body.error.kind == "bad_request"
            assert body.detail == "method not allowed: GET /v1/chat/completions (allowed: POST)"
        with pytest.raises(openai.NotFoundError) as e:
            await ep.openai().embeddings.create(model="p", input="x")
        assert e.value.status_code == 404 and "not found: no route POST /v1/embeddings" in e.value.message
        assert ep.session.run_output().turns == []  # nothing reached the policy


async def test_every_gateway_error_is_the_apis_json(
    tok: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bad keys, bad bodies and raas's own failures: each answered in the API's error body (``detail``,
    ``error.kind``/``stage``/``message``) that also carries the SDK's own fields (OpenAI ``error.type``,
    Anthropic ``type: error``)."""
    async with scripted_rig(tok, ["ok"]) as rig:
        ep = await rig.open()
        key = {"authorization": f"Bearer {ep.session.key}"}
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        async with ep.http() as http:
            cases = [
                ("/v1/chat/completions", {"json": chat}, {}, 401, "unauthorized"),
                (
                    "/v1/chat/completions",
                    {"json": chat},
                    {"authorization": "Bearer raas-wrong"},
                    401,
                    "unauthorized",
                ),
                ("/v1/messages", {"json": chat}, {"x-api-key": "raas-wrong"}, 401, "unauthorized"),
                ("/v1/chat/completions", {"content": b"{not json"}, key, 400, "bad_request"),
                ("/v1/chat/completions", {"json": {"model": "m", "messages": "hi"}}, key, 400, "bad_request"),
                ("/v1/messages", {"json": [1, 2]}, key, 400, "bad_request"),
            ]
            for path, body, headers, status, kind in cases:
                r = await http.post(path, headers=headers, **body)
                assert r.status_code == status and r.headers["content-type"] == "application/json", r.text
                parsed = ErrorBody.model_validate(r.json())
                assert parsed.error.kind == kind and parsed.detail == parsed.error.message
                if path == "/v1/messages":
                    assert r.json()["type"] == "error"
                else:
                    assert r.json()["error"]["type"] in ("authentication_error", "invalid_request_error")

            async def broken(self: object, *args: object, **kwargs: object) -> None:
                raise RuntimeError("a bug")

            monkeypatch.setattr("raas.gateway.session.GatewaySession.complete", broken)
            for stream in (False, True):
                r = await http.post("/v1/chat/completions", headers=key, json={**chat, "stream": stream})
                assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
                parsed = ErrorBody.model_validate(r.json())
                assert parsed.error.kind == "internal" and "RuntimeError: a bug" in parsed.detail
