"""A service started without a chat tokenizer refuses math jobs at submit with a 400 that names the
handler and how to give it a tokenizer (instead of accepting them and failing each in RUN)."""

from __future__ import annotations

import pytest

from raas.api.models import ErrorBody
from tests.api.conftest import APIFactory
from tests.pipeline.conftest import script

pytestmark = pytest.mark.integration

MATH = {"data_source": "math", "problem": "What is 6 times 7?", "answer": "42"}


async def test_math_without_a_tokenizer_is_a_clear_400(make_api: APIFactory) -> None:
    api = await make_api()
    c = api.client
    for path, body in (
        ("/v1/jobs", {"instance": MATH}),
        ("/v1/jobs:batch", {"jobs": [{"instance": script()}, {"instance": MATH}]}),
    ):
        r = await c.post(path, json=body)
        assert r.status_code == 400, r.text
        err = ErrorBody.model_validate(r.json()).error
        assert err.kind == "bad_request"
        assert "'math'" in err.message and "raas.tasks.math.MathHandler" in err.message
        assert "needs a chat tokenizer" in err.message and "--tokenizer DIR" in err.message
    assert (await c.post("/start")).status_code == 200
    await c.post("/add_llm_server", json={"address": "http://127.0.0.1:9"})
    r = await c.post("/process", json={"instance": MATH})
    assert r.status_code == 400 and "needs a chat tokenizer" in r.json()["detail"]
    assert await api.service.ledger.counts() == {}  # nothing was accepted
