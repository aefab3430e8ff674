"""ProRL Agent Server compatibility, tested with a client written from *that* project's documentation.

Sources (NVIDIA-NeMo/ProRL-Agent-Server): ``README.md`` ("Test the server (HTTP I/O)": ``POST /process``
with ``{instance: {data_source, instance_id, trajectory_id, ...}, sampling_params: {...}, job_id?}``);
``scripts/tests/test_server_token.py`` (the trainer-side calls: ``add_llm_server(address)`` with an address
ending in ``/v1``, ``start_server()``, concurrent ``process_request(instance, sampling_params)``,
``stop_server()``; it reads ``result['messages'][i]['content' | 'tool_calls' | 'input_ids' | 'token_ids']``,
``result['tools']`` and ``result['critical_error']``); ``scripts/start_server.py`` (status codes: /process
while stopped → 503, no LLM server → 503, unregistered data_source → 400, timeout → 504; /start twice → 400;
/stop, /status, /cancel while stopped → 503; bodies ``{'status': ...}`` or ``{'detail': ...}``); and
``openhands/nvidia/timer.py`` (``timing``: ``init_time, run_time, eval_time, others_time``).

Nothing below imports raas: the client speaks plain HTTP + JSON as a ProRL trainer does (raas's own
event stream is only used to know when a job is inside a stage).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import pytest

from tests.api.conftest import APIFactory, sse
from tests.doubles.scripted_llm import ScriptedLLM, fixed

pytestmark = pytest.mark.integration


class ProRLTrainerClient:
    """The trainer side, as in the reference's test script (there with aiohttp; the wire is the same)."""

    def __init__(self, base: str) -> None:
        self.base = base

    async def _post(
        self, path: str, payload: dict[str, Any] | None = None, limit_s: float = 60
    ) -> httpx.Response:
        async with httpx.AsyncClient(timeout=limit_s) as session:
            return await session.post(self.base + path, json=payload)

    async def start_server(self) -> httpx.Response:
        return await self._post("/start")

    async def stop_server(self) -> httpx.Response:
        return await self._post("/stop")

    async def get_status(self) -> httpx.Response:
        async with httpx.AsyncClient() as session:
            return await session.get(self.base + "/status")

    async def add_llm_server(self, address: str) -> httpx.Response:
        return await self._post("/add_llm_server", {"address": address})

    async def clear_llm_server(self) -> httpx.Response:
        return await self._post("/clear_llm_server")

    async def cancel(self, job_id: str) -> httpx.Response:
        return await self._post("/cancel", {"job_id": job_id})

    async def process_request(
        self,
        instance: dict[str, Any],
        sampling_params: dict[str, Any] | None = None,
        job_id: str | None = None,
    ) -> httpx.Response:
        payload: dict[str, Any] = {"instance": instance, "sampling_params": sampling_params or {}}
        if job_id is not None:
            payload["job_id"] = job_id
        return await self._post("/process", payload, limit_s=300)


# The README's example instance, routed to the test-double handler (whose RUN asks the policy for tokens).
INSTANCE = {
    "data_source": "test.script",
    "instance_id": "repo__issue__hash",
    "trajectory_id": "t0",
    "patch": "",
    "metadata": {},
    "run": {"generate": [11, 12, 13], "max_tokens": 5},
}
# The sampling params of the reference's token-level test: LLM settings mixed with agent settings.
SAMPLING = {
    "model": "hosted_vllm/Qwen/Qwen3-8B",
    "api_key": "mykey",
    "modify_params": False,
    "native_tool_calling": True,
    "temperature": 0.6,
    "top_p": 0.9,
    "max_iterations": 35,
    "token_level_generation": True,
    "max_output_tokens": 4096,
    "max_model_len": 32768,
}


def summarize_like_the_reference(result: dict[str, Any]) -> dict[str, Any]:
    """What the reference test script does with a result before printing it (it must not raise)."""
    result = copy.deepcopy(result)
    for message in result["messages"]:
        message["content"] = len(message["content"])
        if "tool_calls" in message and message["tool_calls"] is not None:
            message["tool_calls"] = len(message["tool_calls"])
        if "input_ids" in message and message["input_ids"] is not None:
            message["input_ids"] = len(message["input_ids"])
        message["token_ids"] = len(message["token_ids"])
    result["tools"] = len(result["tools"])
    return result


async def test_trainer_flow_from_the_reference(make_api: APIFactory) -> None:
    api = await make_api()
    client = ProRLTrainerClient(api.url)
    async with ScriptedLLM(fixed(5, token_id=77)) as llm:
        r = await client.add_llm_server(llm.url + "/v1")  # "You address should also contain /v1 at the end."
        assert r.status_code == 200 and "status" in r.json()
        r = await client.process_request(INSTANCE, SAMPLING)
        assert r.status_code == 503 and "not running" in r.json()["detail"]  # not started yet
        r = await client.start_server()
        assert r.status_code == 200 and r.json() == {"status": "Server started successfully"}
        assert (await client.start_server()).status_code == 400
        status = (await client.get_status()).json()
        assert status["status"] == "running" and status["pending_jobs"] == 0

        tasks = []
        for i in range(4):
            instance = copy.deepcopy(INSTANCE)
            instance["trajectory_id"] = i
            tasks.append(client.process_request(instance, dict(SAMPLING)))
        responses = await asyncio.gather(*tasks)
        for i, r in enumerate(responses):
            assert r.status_code == 200, r.text
            res = r.json()
            assert res["critical_error"] is None, res
            summarize_like_the_reference(res)
            assert res["instance_id"] == "repo__issue__hash" and res["trajectory_id"] == i
            assert res["resolved"] is True and res["success"] is True and res["filter"] is False
            assert res["finish"] is True and res["end_properly"] is True and res["error"] is None
            assert res["git_patch"] == "diff --git a/x b/x"
            assert set(res["timing"]) >= {"init_time", "run_time", "eval_time", "others_time"}
            assert all(isinstance(res["timing"][k], float) for k in ("init_time", "run_time", "eval_time"))
            for m in res["messages"]:
                assert {"role", "content", "tool_calls", "input_ids", "token_ids", "logprobs"} <= set(m)
            # Token level: what the policy sampled is in the assistant message, and the messages in order
            # rebuild the whole sequence.
            (assistant,) = [m for m in res["messages"] if m["role"] == "assistant"]
            assert assistant["token_ids"] == [77] * 5 and assistant["output_ids"] == [77] * 5
            assert len(assistant["logprobs"]) == 5
            sequence = [t for m in res["messages"] for t in m["input_ids"] + m["token_ids"]]
            traj = res["token_trajectory"]
            assert sequence == traj["prompt_ids"] + traj["response_ids"]
        assert [q.prompt_ids for q in llm.requests] == [[11, 12, 13]] * 4
        assert all(q.body["temperature"] == 0.6 and q.body["top_p"] == 0.9 for q in llm.requests)

        r = await client.stop_server()
        assert r.status_code == 200 and r.json() == {"status": "Server stopped successfully"}
        assert (await client.stop_server()).status_code == 503
        assert (await client.cancel("anything")).status_code == 503
        assert (await client.process_request(INSTANCE, SAMPLING)).status_code == 503


async def test_error_semantics(make_api: APIFactory) -> None:
    api = await make_api(default_timeout_s=2.0)
    client = ProRLTrainerClient(api.url)
    async with ScriptedLLM(fixed(2)) as llm:
        await client.start_server()
        r = await client.process_request(INSTANCE, SAMPLING)
        assert r.status_code == 503 and "No LLM server" in r.json()["detail"]
        await client.add_llm_server(llm.url)
        r = await client.process_request({**INSTANCE, "data_source": "not_registered"}, SAMPLING)
        assert r.status_code == 400 and "not registered" in r.json()["detail"]
        r = await client.process_request({**INSTANCE, "run": {"sleep": 30}}, SAMPLING)
        assert r.status_code == 504
        res = r.json()
        assert res["critical_error"] == "timeout" and res["filter"] is True and res["resolved"] is False
        assert res["timing"]["timeout_triggered"] is True
        r = await client.process_request({**INSTANCE, "eval": {"raise": "grader crashed"}}, SAMPLING)
        assert r.status_code == 200
        res = r.json()
        assert res["critical_error"] == "eval" and "grader crashed" in res["error"] and res["filter"] is True
        assert "RuntimeError" in res["traceback"] and res["success"] is False
        await client.clear_llm_server()
        assert (await client.process_request(INSTANCE, SAMPLING)).status_code == 503


async def test_cancel_and_stop_end_blocked_process_calls(make_api: APIFactory) -> None:
    api = await make_api()
    client = ProRLTrainerClient(api.url)
    async with ScriptedLLM(fixed(2)) as llm:
        await client.add_llm_server(llm.url + "/v1/")
        await client.start_server()
        async with sse(api.client) as events:  # raas's event stream says when both are inside a stage
            cancelled = asyncio.create_task(
                client.process_request({**INSTANCE, "run": {"sleep": 60}}, SAMPLING, job_id="prorl-job-1")
            )
            stopped = asyncio.create_task(
                client.process_request({**INSTANCE, "init": {"sleep": 60}}, SAMPLING, job_id="prorl-job-2")
            )
            waiting = {("prorl-job-1", "run"), ("prorl-job-2", "init")}
            async for _, event in events:
                waiting.discard((event["job_id"], event["status"]))
                if not waiting:
                    break
        r = await client.cancel("prorl-job-1")
        assert r.status_code == 200 and r.json() == {"status": "Cancel requested for job prorl-job-1"}
        r = await asyncio.wait_for(cancelled, 30)
        assert r.status_code == 200 and r.json()["critical_error"] == "timeout" and r.json()["filter"] is True
        assert (await client.stop_server()).status_code == 200
        r = await asyncio.wait_for(stopped, 30)
        assert r.status_code == 503 and r.json()["status"] == "cancelled" and r.json()["filter"] is True
