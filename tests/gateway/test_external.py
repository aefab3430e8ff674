"""Agents that run outside raas: a real service (uvicorn on a port) with the embedded llama.cpp model,
rollouts opened over the native API, driven by the real OpenAI and Anthropic SDKs through ``/gateway``,
closed with the agent's answer, graded by the task handler's own EVAL and read back as a normal job result.

Exactness is checked against what crossed the wire to llama-server (a recording proxy between the balancer
and the model server; streamed generations are recorded event by event)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from tests.e2e.recording_proxy import RecordingProxy
from tests.gateway.conftest import assert_output_is_servers, check_exact
from tests.gateway.test_sandbox import GOLD_PATCH, harness_instance

from raas.api.app import served
from raas.core.jobs import JobResult
from raas.core.trajectory import RunOutput
from raas.errors import RaasError
from raas.llm.embedded import EmbeddedServer
from raas.llm.models import prepare_tokenizer
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from raas.trainer.client import RaasClient
from raas.trainer.grpo import assemble_batch
from raas.trainer.types import Group

pytestmark = pytest.mark.e2e

TOKEN = "api-token-for-the-opener"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MATH = {"data_source": "math", "problem": "What is 2 + 2?", "answer": "4"}
SAMPLING = {"temperature": 1.0, "seed": 11, "max_tokens": 24}


@pytest.fixture(scope="module")
async def model() -> AsyncIterator[RecordingProxy]:
    server = EmbeddedServer(
        parallel=2, ctx_per_slot=2048, threads=int(os.environ.get("RAAS_TEST_LLAMA_THREADS", "1"))
    )
    await server.start()
    try:
        async with RecordingProxy(server.url) as proxy:
            yield proxy
    finally:
        await server.stop()


@pytest.fixture
async def service(tmp_path: Path, model: RecordingProxy) -> AsyncIterator[tuple[str, RolloutService]]:
    config = ServiceConfig(
        state_dir=tmp_path / "svc",
        sandbox={"backend": "local"},
        llm_servers=[model.url],
        tokenizer_dir=prepare_tokenizer(),
        agent={"max_turns": 8, "max_tokens_per_turn": 24, "context_budget": 2048},
        api_token=TOKEN,
        shutdown_grace_s=0.0,
        default_timeout_s=240,
    )
    svc = RolloutService(config)
    async with served(svc) as url:
        yield url, svc


async def _open(http: httpx.AsyncClient, **extra: Any) -> dict[str, Any]:
    body = {"instance": MATH, "sampling_params": SAMPLING, **extra}
    r = await http.post("/v1/gateway/rollouts", json=body, headers=AUTH)
    assert r.status_code == 201, r.text
    return r.json()


def _answers(proxy: RecordingProxy) -> dict[tuple[int, ...], Any]:
    """Prompt -> what llama-server answered (its JSON, or a stream's events)."""
    return {
        tuple(e.request["prompt"]): e.response
        for e in proxy.exchanges
        if e.path == "/completion" and e.status == 200
    }


async def test_an_external_agent_opens_drives_and_closes_a_rollout(
    service: tuple[str, RolloutService], model: RecordingProxy
) -> None:
    url, svc = service
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        opened = await _open(http)
        assert opened["openai_base_url"] == f"{url}/gateway/v1"
        assert opened["anthropic_base_url"] == f"{url}/gateway"
        key = opened["key"]

        oai = openai.AsyncOpenAI(base_url=opened["openai_base_url"], api_key=key, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "What is 2 + 2? Answer with a number."}]
        r = await oai.chat.completions.create(model=opened["model"], messages=messages, max_tokens=24)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        messages.append({"role": "user", "content": "Are you sure? Say it again."})
        text, chunks = "", 0
        async for chunk in await oai.chat.completions.create(
            model=opened["model"], messages=messages, max_tokens=24, stream=True
        ):
            chunks += 1
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        assert chunks >= 3  # role, text, finish at least
        messages.append({"role": "assistant", "content": text})

        ant = anthropic.AsyncAnthropic(base_url=opened["anthropic_base_url"], api_key=key, max_retries=0)
        async with ant.messages.stream(
            model=opened["model"],
            max_tokens=24,
            messages=[{"role": "user", "content": "Name a colour."}],
        ) as s:
            reply = await s.get_final_message()
        assert reply.usage.output_tokens > 0

        r2 = await http.post(
            f"/gateway/v1/rollouts/{opened['rollout_id']}/close",
            json={"answer": "4", "metadata": {"agent": "sdk-test"}},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r2.status_code == 200, r2.text
        res = await http.get(f"/v1/jobs/{opened['job_id']}/result", params={"wait": 120}, headers=AUTH)
        assert res.status_code == 200, res.text
        result = res.json()

    assert result["status"] == "completed", result.get("error")
    assert result["reward"] == 1.0 and result["filter"] is False  # the math handler's EVAL graded "4"
    assert result["artifacts"]["external"] == {"closed": True, "metadata": {"agent": "sdk-test"}}
    out = RunOutput.model_validate(
        {k: result[k] for k in ("messages", "turns", "token_trajectory", "segments")}
        | {"artifacts": result["artifacts"]}
    )
    assert len(out.turns) == 3
    assert len(out.segments) == 2  # the Anthropic conversation is another token sequence
    assert out.artifacts["gateway"]["by_api"] == {"chat": 2, "messages": 1}
    check_exact(out)
    wire = _answers(model)
    streamed = [e for e in model.exchanges if isinstance(e.response, list)]
    assert len(streamed) == 2  # the two streamed turns reached llama-server as streams
    by_segment: dict[int, list[int]] = {}
    for turn in out.turns:
        seq = by_segment.get(turn.segment, []) + turn.prompt_ids if turn.prompt_is_delta else turn.prompt_ids
        assert tuple(seq) in wire, f"turn {turn.index}: a prompt the server never received"
        assert_output_is_servers(turn.output_ids, turn.logprobs, wire[tuple(seq)])
        by_segment[turn.segment] = seq + turn.output_ids
    # what a trainer builds from it: a row per token sequence, training on exactly the sampled IDs
    group = Group(group_id="g", instance=MATH, size=1, results={0: JobResult.model_validate(result)})
    batch = assemble_batch([group], 0, 1024, 256)
    assert batch.job_ids == [opened["job_id"]] * 2
    for row in range(2):
        sampled = [t for turn in out.turns if turn.segment == row for t in turn.output_ids]
        assert batch.responses[row][batch.loss_mask[row] == 1].tolist() == sampled
    assert svc.gateway is not None and svc.gateway.sessions == []
    # the agent ran outside raas: math's INIT started no sandbox for it (the job's history lists every one)
    trail = [status for status, _, _ in await svc.ledger.transitions(opened["job_id"])]
    assert "init" in trail and "sandbox" not in trail


async def test_keys_are_scoped_to_their_rollout_and_die_with_it(service: tuple[str, RolloutService]) -> None:
    url, svc = service
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        a, b = await _open(http), await _open(http)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

        def bearer(key: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {key}"}

        # B's key cannot close A; no key, the API token or garbage cannot use the gateway
        r = await http.post(
            f"/gateway/v1/rollouts/{a['rollout_id']}/close", json={}, headers=bearer(b["key"])
        )
        assert r.status_code == 401 and r.json()["error"]["kind"] == "unauthorized"
        for headers in ({}, AUTH, bearer("raas-not-a-key")):
            r = await http.post("/gateway/v1/chat/completions", json=chat, headers=headers)
            assert r.status_code == 401, r.text
            body = r.json()
            assert body["error"]["type"] == "authentication_error" and body["error"]["kind"] == "unauthorized"
            assert body["detail"] == body["error"]["message"]
        # a bad body is a JSON error too
        r = await http.post(
            f"/gateway/v1/rollouts/{a['rollout_id']}/close", json={"answer": 4}, headers=bearer(a["key"])
        )
        assert r.status_code == 400 and r.json()["error"]["kind"] == "bad_request"
        r = await http.post("/gateway/v1/chat/completions", content=b"{nope", headers=bearer(a["key"]))
        assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]

        r = await http.post(f"/gateway/v1/rollouts/{a['rollout_id']}/close", headers=bearer(a["key"]))
        assert r.status_code == 200, r.text
        # after the close: A's key opens nothing, and cannot close again
        r = await http.post("/gateway/v1/chat/completions", json=chat, headers=bearer(a["key"]))
        assert r.status_code == 401 and r.json()["error"]["kind"] == "unauthorized"
        r = await http.post(f"/gateway/v1/rollouts/{a['rollout_id']}/close", headers=bearer(a["key"]))
        assert r.status_code == 401
        # B is untouched by all of it
        r = await http.post("/gateway/v1/chat/completions", json=chat, headers=bearer(b["key"]))
        assert r.status_code == 200, r.text
        r = await http.post(f"/gateway/v1/rollouts/{b['rollout_id']}/close", headers=bearer(b["key"]))
        assert r.status_code == 200
        for rollout in (a, b):
            res = await http.get(f"/v1/jobs/{rollout['job_id']}/result", params={"wait": 120}, headers=AUTH)
            assert res.json()["status"] == "completed", res.text
        # the opener's own route needs the API token
        r = await http.post("/v1/gateway/rollouts", json={"instance": MATH})
        assert r.status_code == 401
    assert svc.gateway is not None and svc.gateway.sessions == []


async def test_an_abandoned_rollout_is_reaped(service: tuple[str, RolloutService]) -> None:
    url, svc = service
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        opened = await _open(http, lease_s=0.5)
        res = await http.get(f"/v1/jobs/{opened['job_id']}/result", params={"wait": 60}, headers=AUTH)
        result = res.json()
        assert result["status"] == "cancelled" and result["filter"] is True and result["reward"] is None
        assert "abandoned" in result["error"]["message"]
        r = await http.post(
            "/gateway/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {opened['key']}"},
        )
        assert r.status_code == 401
        # requests renew the lease: a rollout busy for longer than its lease is not reaped
        busy = await _open(http, lease_s=1.5)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        key = {"Authorization": f"Bearer {busy['key']}"}
        started = asyncio.get_running_loop().time()
        while asyncio.get_running_loop().time() - started < 3.0:
            r = await http.post("/gateway/v1/chat/completions", json=chat, headers=key)
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.7)
        r = await http.post(f"/gateway/v1/rollouts/{busy['rollout_id']}/close", headers=key)
        assert r.status_code == 200, r.text
        res = await http.get(f"/v1/jobs/{busy['job_id']}/result", params={"wait": 60}, headers=AUTH)
        assert res.json()["status"] == "completed" and len(res.json()["turns"]) >= 3
        # a bad instance is refused at open, like a bad job at submit, and leaves nothing waiting
        r = await http.post("/v1/gateway/rollouts", json={"instance": {"data_source": "math"}}, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["kind"] == "bad_request"
    assert svc.gateway is not None and svc.gateway.sessions == []
    assert svc.gateway.external.get(opened["rollout_id"]) is None


async def test_a_harness_rollout_is_graded_on_the_patch_its_agent_sends(
    service: tuple[str, RolloutService],
) -> None:
    """EVAL applies the external agent's patch in a fresh sandbox, adds the hidden tests and runs the
    check, as for a sandboxed agent; without a patch the repository is as given and the check fails.
    The instance names no ``agent``: the agent is outside raas (a job, whose agent raas runs, needs one)."""
    url, _ = service
    instance = {k: v for k, v in harness_instance("command").items() if k != "agent"}
    rewards = []
    async with RaasClient(url, token=TOKEN) as client:  # the trainer side's client, this time
        with pytest.raises(RaasError) as err:
            await client.submit(instance)
        assert err.value.kind == "bad_request" and "'agent'" in err.value.message
        for patch in (GOLD_PATCH, None):
            opened = await client.open_rollout(instance, lease_s=60)
            assert (await client.close_rollout(opened, patch=patch))["status"] == "closed"
            result = await client.wait(opened["job_id"], timeout_s=120)
            assert result["status"] == "completed", result.get("error")
            assert result["filter"] is False and result["artifacts"]["patch"] == (patch or "")
            rewards.append((result["reward"], result["resolved"]))
        with pytest.raises(RaasError) as err:  # its key died with it
            await client.close_rollout(opened)
        assert err.value.kind == "unauthorized"
    assert rewards == [(1.0, True), (0.0, False)]
