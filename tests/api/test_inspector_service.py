"""The inspector over a running service's ledger (``/dashboard/api/jobs`` on ``raas serve``'s app): the list
and its filters read the ledger (running jobs included), a job's data and raw result, and the dashboard's
auth on every new route — the token, or the dashboard's cookie for a ``GET``; nothing new takes a POST."""

from __future__ import annotations

import pytest

from raas.api.dashboard import COOKIE_NAME, session_value
from raas.llm.models import prepare_tokenizer
from tests.api.conftest import APIFactory
from tests.doubles.scripted_llm import ScriptedLLM, fixed

pytestmark = pytest.mark.integration

TOKEN = "inspect-s3cret"


async def test_the_list_reads_the_ledger_with_its_filters_and_auth(make_api: APIFactory) -> None:
    api = await make_api(api_token=TOKEN, run_workers=4, tokenizer_dir=prepare_tokenizer())
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    async with ScriptedLLM(fixed(3)) as llm:
        r = await api.client.post(
            "/v1/llm/servers", json={"address": llm.url, "weight_version": "7"}, headers=bearer
        )
        assert r.status_code == 200
        jobs = [
            {
                "job_id": f"grpA.{i}.0",
                "instance": {
                    "data_source": "test.script",
                    "run": {"generate": [5, 6]},
                    "eval": {"reward": x},
                },
            }
            for i, x in enumerate([1.0, 0.0, 0.5])
        ]
        jobs[0]["instance"]["init"] = {"sandbox": True}  # type: ignore[index]
        jobs.append(
            {
                "job_id": "lone.0.0",
                "instance": {"data_source": "test.script", "run": {"raise": "boom", "kind": "llm_error"}},
            }
        )
        jobs.append({"job_id": "held", "instance": {"data_source": "test.script", "run": {"sleep": 60}}})
        r = await api.client.post("/v1/jobs:batch", json={"jobs": jobs}, headers=bearer)
        assert r.status_code == 202, r.text
        for job in jobs[:4]:
            r = await api.client.get(f"/v1/jobs/{job['job_id']}/result", params={"wait": 30}, headers=bearer)
            assert r.status_code == 200

        async def ids(**params: object) -> list[str]:
            r = await api.client.get("/dashboard/api/jobs", params=params, headers=bearer)
            assert r.status_code == 200, r.text
            return sorted(j["job_id"] for j in r.json()["jobs"])

        assert await ids() == ["grpA.0.0", "grpA.1.0", "grpA.2.0", "held", "lone.0.0"]  # the running one too
        assert await ids(group="grpA") == ["grpA.0.0", "grpA.1.0", "grpA.2.0"]
        assert await ids(min_reward=0.5) == ["grpA.0.0", "grpA.2.0"]
        assert await ids(max_reward=0.4) == ["grpA.1.0"]
        assert await ids(outcome="resolved") == ["grpA.0.0"]
        assert await ids(outcome="filtered") == ["lone.0.0"]
        assert await ids(status="run") == ["held"]
        assert await ids(weight_version="7") == ["grpA.0.0", "grpA.1.0", "grpA.2.0"]
        assert await ids(q="LONE") == ["lone.0.0"]
        assert await ids(data_source="other") == []
        r = await api.client.get("/dashboard/api/jobs", params={"limit": 2, "offset": 1}, headers=bearer)
        page = r.json()
        assert page["total"] == 5 and page["offset"] == 1 and len(page["jobs"]) == 2
        failed = (await api.client.get("/dashboard/api/jobs", params={"q": "lone"}, headers=bearer)).json()
        assert failed["jobs"][0]["error"].startswith("run/llm_error")

        r = await api.client.get("/dashboard/api/jobs/grpA.0.0", headers=bearer)
        detail = r.json()
        assert detail["row"]["reward"] == 1.0 and detail["row"]["weight_versions"] == ["7"]
        assert detail["tokens"] is not None and detail["tokens"]["sampled"] > 0  # the service's tokenizer
        # the job's history: its states in order, and the sandbox its INIT opened
        states = [t["status"] for t in detail["transitions"]]
        assert states[0] == "queued" and states[-1] == "completed" and {"init", "run", "eval"} <= set(states)
        times = [t["at_s"] for t in detail["transitions"]]
        assert times == sorted(times)
        [box] = detail["sandboxes"]
        assert box["backend"] == "local" and box["id"]
        assert (await api.client.get("/dashboard/api/jobs/grpA.1.0", headers=bearer)).json()[
            "sandboxes"
        ] == []
        raw = (await api.client.get("/dashboard/api/jobs/grpA.0.0/raw", headers=bearer)).json()
        assert (
            raw["job_id"] == "grpA.0.0"
            and raw["token_trajectory"]
            == (await api.client.get("/v1/jobs/grpA.0.0/result", headers=bearer)).json()["token_trajectory"]
        )
        assert (await api.client.get("/dashboard/api/jobs/held", headers=bearer)).status_code == 404
        assert (await api.client.get("/dashboard/api/jobs/nope", headers=bearer)).status_code == 404

        # auth: every new route needs the token or the dashboard's cookie, and only for GET
        for path in (
            "/dashboard/jobs",
            "/dashboard/jobs/grpA.0.0",
            "/dashboard/api/jobs",
            "/dashboard/api/jobs/grpA.0.0",
            "/dashboard/api/jobs/grpA.0.0/raw",
            "/dashboard/inspector/inspector.js",
        ):
            assert (await api.client.get(path)).status_code == 401, path
            cookie = {"Cookie": f"{COOKIE_NAME}={session_value(TOKEN)}"}
            assert (await api.client.get(path, headers=cookie)).status_code == 200, path
            wrong = {"Cookie": f"{COOKIE_NAME}={session_value('other')}"}
            assert (await api.client.get(path, headers=wrong)).status_code == 401, path
            assert (await api.client.post(path, headers=bearer)).status_code in (404, 405), path
