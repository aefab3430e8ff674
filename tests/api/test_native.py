"""The native /v1 API over real HTTP: lifecycle of a job, long-poll, SSE, auth, bad input, backpressure."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import quote

import httpx
import pytest

from tests.api.conftest import APIFactory, sse
from tests.doubles.scripted_llm import ScriptedLLM, fixed

pytestmark = pytest.mark.integration


def script(**stages: object) -> dict[str, object]:
    return {"data_source": "test.script", **stages}


async def test_submit_poll_long_poll_and_result(make_api: APIFactory) -> None:
    api = await make_api()
    c = api.client
    r = await c.post("/v1/jobs", json={"instance": script(run={"sleep": 0.5}), "job_id": "job-a"})
    assert r.status_code == 202 and r.json() == {"job_id": "job-a", "status": "queued", "created": True}
    r = await c.post("/v1/jobs", json={"instance": script(), "job_id": "job-a"})
    assert r.status_code == 202 and r.json()["created"] is False
    r = await c.get("/v1/jobs/job-a/result")
    assert r.status_code == 202 and r.json()["status"] not in ("completed", "failed")
    r = await c.get("/v1/jobs/job-a/result", params={"wait": 30})
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "completed" and body["reward"] == 1.0 and body["filter"] is False
    assert set(body) == {
        "job_id",
        "instance_id",
        "trajectory_id",
        "status",
        "reward",
        "resolved",
        "error",
        "filter",
        "messages",
        "turns",
        "token_trajectory",
        "segments",
        "artifacts",
        "timing",
    }
    assert body["segments"] == []  # one token sequence
    assert set(body["timing"]) == {
        "queue_s",
        "init_s",
        "run_s",
        "eval_s",
        "total_s",
        "prewarm_s",
        "resumed_at",
    }
    assert body["timing"]["resumed_at"] is None  # it ran in one go
    assert body["timing"]["run_s"] >= 0.5
    info = (await c.get("/v1/jobs/job-a")).json()
    assert info["status"] == "completed" and info["data_source"] == "test.script"


async def test_batch_and_cancel(make_api: APIFactory) -> None:
    api = await make_api()
    c = api.client
    r = await c.post(
        "/v1/jobs:batch", json={"jobs": [{"instance": script(run={"sleep": 60})}, {"instance": script()}]}
    )
    assert r.status_code == 202
    slow, quick = (j["job_id"] for j in r.json()["jobs"])
    assert (await c.get(f"/v1/jobs/{quick}/result", params={"wait": 30})).json()["status"] == "completed"
    r = await c.delete(f"/v1/jobs/{slow}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    result = (await c.get(f"/v1/jobs/{slow}/result")).json()
    assert result["status"] == "cancelled" and result["reward"] is None and result["filter"] is True
    assert result["error"] == {"stage": "run", "kind": "cancelled", "message": "cancelled by request"}
    r = await c.post(
        "/v1/jobs:batch", json={"jobs": [{"instance": script()}, {"instance": {"data_source": "zz"}}]}
    )
    assert r.status_code == 400 and "jobs[1]" in r.json()["detail"]


async def test_sse_streams_state_changes(make_api: APIFactory) -> None:
    api = await make_api()
    async with sse(api.client, params={"terminal_only": "false"}) as events:
        job_id = (await api.client.post("/v1/jobs", json={"instance": script()})).json()["job_id"]
        statuses = []
        async for name, data in events:
            assert name == "job"
            if data["job_id"] == job_id:
                statuses.append(data["status"])
                if data["status"] == "completed":
                    assert data["reward"] == 1.0
                    break
    assert statuses == ["queued", "init", "queued_run", "run", "queued_eval", "eval", "completed"]


async def test_backpressure_answers_429_with_retry_after(make_api: APIFactory) -> None:
    api = await make_api(max_pending=1, retry_after_s=2)
    c = api.client
    first = (await c.post("/v1/jobs", json={"instance": script(init={"sleep": 60})})).json()["job_id"]
    r = await c.post("/v1/jobs", json={"instance": script()})
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["kind"] == "overloaded"
    await c.delete(f"/v1/jobs/{first}")
    assert (await c.post("/v1/jobs", json={"instance": script()})).status_code == 202


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "phrase"),
    [
        ("POST", "/v1/jobs", b"{not json", 422, "json"),
        ("POST", "/v1/jobs", b'{"instance": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", 400, "pars"),
        ("POST", "/v1/jobs", b"\xff\xfe", 422, "json"),
        ("POST", "/v1/jobs", {"instance": "x"}, 422, "instance"),
        ("POST", "/v1/jobs", {"instance": {"data_source": 5}}, 422, "data_source"),
        (
            "POST",
            "/v1/jobs",
            {"instance": {"data_source": "test.script"}, "timeout_s": "soon"},
            422,
            "timeout_s",
        ),
        ("POST", "/v1/jobs", {"instance": {"data_source": "test.script"}, "surprise": 1}, 422, "surprise"),
        ("POST", "/v1/jobs", {"instance": {"data_source": "no-such-task"}}, 400, "no-such-task"),
        ("POST", "/v1/jobs", {"instance": {"data_source": "test.script", "run": 3}}, 400, "instance.run"),
        (
            "POST",
            "/v1/jobs",
            {"instance": {"data_source": "test.script"}, "job_id": "bad id/"},
            422,
            "job_id",
        ),
        ("GET", "/v1/jobs/unknown-job", None, 404, "unknown-job"),
        ("GET", "/v1/jobs/unknown-job/result", None, 404, "unknown-job"),
        ("DELETE", "/v1/jobs/unknown-job", None, 404, "unknown-job"),
        ("GET", "/v1/jobs/unknown-job/result?wait=-1", None, 422, "wait"),
        ("GET", "/v1/nothing-here", None, 404, "not found"),
        ("POST", "/v1/llm/servers", {"address": "ftp://x"}, 422, "http"),  # the schema says http(s)
    ],
)
async def test_bad_input_gets_a_clear_4xx(
    make_api: APIFactory, method: str, path: str, body: object, status: int, phrase: str
) -> None:
    api = await make_api()
    content = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    r = await api.client.request(method, path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    payload = r.json()
    text = json.dumps(payload).lower()
    assert phrase.lower() in text, payload
    assert payload["error"]["kind"] and payload["error"]["message"] and payload["detail"]


async def test_huge_payloads_are_refused_before_parsing(make_api: APIFactory) -> None:
    api = await make_api(max_request_bytes=4096)
    big = json.dumps({"instance": {"data_source": "test.script", "blob": "x" * 10_000}}).encode()
    r = await api.client.post("/v1/jobs", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["kind"] == "payload_too_large"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked transfer
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    r = await api.client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert await api.service.ledger.counts() == {}


async def test_bearer_token(make_api: APIFactory) -> None:
    api = await make_api(api_token="s3cret")
    c = api.client
    assert (await c.get("/healthz")).status_code == 200
    for path in ("/status", "/metrics", "/v1/jobs/x", "/openapi.json"):
        r = await c.get(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
    assert (await c.get("/status", headers={"Authorization": "Bearer wrong"})).status_code == 401
    assert (await c.post("/process", json={}, headers={"Authorization": "Basic s3cret"})).status_code == 401
    ok = await c.get("/status", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["accepting"] is True


async def test_status_and_metrics(make_api: APIFactory) -> None:
    api = await make_api(init_workers=2, run_workers=3, eval_workers=1)
    c = api.client
    job_id = (await c.post("/v1/jobs", json={"instance": script(eval={"raise": "x"})})).json()["job_id"]
    await c.get(f"/v1/jobs/{job_id}/result", params={"wait": 30})
    s = (await c.get("/status")).json()
    assert s["stages"]["run"] == {"queued": 0, "active": 0, "workers": 3}
    assert s["finished"] == {"failed": 1} and s["pending"] == 0 and s["status"] == "stopped"
    m = (await c.get("/metrics")).text
    assert 'raas_stage_queued{stage="init"} 0.0' in m
    assert 'raas_stage_active{stage="eval"} 0.0' in m
    assert 'raas_stage_duration_seconds_count{outcome="error",stage="eval"}' in m
    assert 'raas_errors_total{kind="handler_error",stage="eval"}' in m
    assert "raas_tool_latency_seconds" in m and "raas_llm_attempt_seconds" in m


async def test_llm_server_management(make_api: APIFactory) -> None:
    api = await make_api()
    c = api.client
    async with ScriptedLLM(fixed(2)) as llm:
        r = await c.post("/v1/llm/servers", json={"address": llm.url + "/v1", "weight_version": "w1"})
        assert r.status_code == 200
        (server,) = r.json()["servers"]
        assert server["address"] == llm.url and server["weight_version"] == "w1"
        job = {"instance": script(run={"generate": [1, 2, 3]})}
        job_id = (await c.post("/v1/jobs", json=job)).json()["job_id"]
        result = (await c.get(f"/v1/jobs/{job_id}/result", params={"wait": 30})).json()
        assert result["status"] == "completed", result
        assert result["turns"][0]["output_ids"] == [42, 42] and result["turns"][0]["server"] == llm.url
        assert llm.requests[0].prompt_ids == [1, 2, 3]
        scrape = (await c.get("/metrics")).text
        assert f'raas_llm_attempt_seconds_count{{outcome="ok",server="{llm.url}"}} 1.0' in scrape
        assert (await c.post("/v1/llm:pause")).status_code == 200
        assert (await c.get("/status")).json()["llm_paused"] is True
        assert (await c.post("/v1/llm:resume")).status_code == 200
        assert (await c.get("/status")).json()["llm_paused"] is False
        assert (await c.delete("/v1/llm/servers/" + quote("http://127.0.0.1:1", safe=""))).status_code == 404
        r = await c.delete("/v1/llm/servers/" + quote(llm.url, safe=""))
        assert r.status_code == 200 and r.json()["servers"] == []
        await c.post("/v1/llm/servers", json={"address": llm.url})
        assert (await c.post("/v1/llm/servers:clear")).status_code == 200
        assert (await c.get("/v1/llm/servers")).json() == {"servers": []}


async def test_llm_server_down_fails_the_job_typed(make_api: APIFactory) -> None:
    api = await make_api()
    c = api.client
    async with ScriptedLLM(fixed(2)) as llm:
        url = llm.url
    await c.post("/v1/llm/servers", json={"address": url})  # nothing listens there any more
    job_id = (await c.post("/v1/jobs", json={"instance": script(run={"generate": [1, 2]})})).json()["job_id"]
    result = (await c.get(f"/v1/jobs/{job_id}/result", params={"wait": 60})).json()
    assert result["status"] == "failed" and result["reward"] is None and result["filter"] is True
    assert result["error"]["stage"] == "run" and result["error"]["kind"] == "llm_unavailable", result["error"]


async def test_openapi_is_published(make_api: APIFactory) -> None:
    api = await make_api()
    spec = (await api.client.get("/openapi.json")).json()
    for path in (
        "/v1/jobs",
        "/v1/jobs:batch",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/result",
        "/v1/events",
        "/v1/llm/servers",
        "/v1/llm/servers:clear",
        "/v1/llm:pause",
        "/v1/llm:resume",
        "/healthz",
        "/status",
        "/metrics",
        "/process",
        "/start",
        "/stop",
        "/cancel",
        "/add_llm_server",
        "/clear_llm_server",
    ):
        assert path in spec["paths"], path


async def test_cancel_from_another_client_while_long_polling(make_api: APIFactory) -> None:
    api = await make_api()
    c = api.client
    job_id = (await c.post("/v1/jobs", json={"instance": script(init={"sleep": 60})})).json()["job_id"]
    poll = asyncio.create_task(c.get(f"/v1/jobs/{job_id}/result", params={"wait": 60}))
    async with httpx.AsyncClient(base_url=api.url) as other:
        assert (await other.delete(f"/v1/jobs/{job_id}")).status_code == 200
    r = await asyncio.wait_for(poll, 30)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
