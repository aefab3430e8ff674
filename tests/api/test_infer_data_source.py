"""``POST /v1/jobs`` infers a missing ``data_source`` from the instance's fields, with the same function
``raas run`` uses for a dataset file (:func:`raas.tasks.datasets.infer_data_source`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raas.llm.models import prepare_tokenizer
from raas.tasks.datasets import infer_data_source
from tests.api.conftest import APIFactory

pytestmark = pytest.mark.integration

SWE_ROW = json.loads(
    (Path(__file__).parents[1] / "tasks" / "swe" / "data" / "swebench_records.jsonl")
    .read_text()
    .splitlines()[0]
)


async def test_submit_without_data_source_uses_the_cli_inference(make_api: APIFactory) -> None:
    api = await make_api(tokenizer_dir=prepare_tokenizer())
    c = api.client
    math = {"problem": "What is 6 times 7?", "answer": "42"}
    r = await c.post("/v1/jobs", json={"instance": math, "job_id": "inferred-math"})
    assert r.status_code == 202, r.text
    info = (await c.get("/v1/jobs/inferred-math")).json()
    assert info["data_source"] == infer_data_source(math) == "math"
    swe = {k: v for k, v in SWE_ROW.items() if k != "data_source"}
    r = await c.post("/v1/jobs", json={"instance": swe, "job_id": "inferred-swe"})
    assert r.status_code == 202, r.text
    assert (await c.get("/v1/jobs/inferred-swe")).json()["data_source"] == "swebench"
    await c.delete("/v1/jobs/inferred-math")
    await c.delete("/v1/jobs/inferred-swe")


async def test_submit_with_nothing_to_infer_from_is_a_clear_400(make_api: APIFactory) -> None:
    api = await make_api(tokenizer_dir=prepare_tokenizer())
    r = await api.client.post("/v1/jobs", json={"instance": {"prompt": "hello"}})
    assert r.status_code == 400
    assert "data_source is missing and the instance's fields imply no task" in r.json()["detail"]
    r = await api.client.post(
        "/v1/jobs:batch", json={"jobs": [{"instance": {"problem": "1+1?", "answer": "2"}}]}
    )
    assert r.status_code == 202, r.text
    job_id = r.json()["jobs"][0]["job_id"]
    assert (await api.client.get(f"/v1/jobs/{job_id}")).json()["data_source"] == "math"
    await api.client.delete(f"/v1/jobs/{job_id}")


def test_an_external_rollout_infers_it_too() -> None:
    """``POST /v1/gateway/rollouts`` takes the instance through the same rule (and its schema says so)."""
    from raas.api.rollouts import RolloutRequest

    body = RolloutRequest(instance={"problem": "What is 2 + 3?", "answer": "5"})
    assert body.instance["data_source"] == "math"
    schema = RolloutRequest.model_json_schema()["properties"]["instance"]
    assert "data_source" not in schema.get("required", [])
