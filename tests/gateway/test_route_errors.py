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
