"""The gateway as part of the service: a harness job submitted over the native API runs an agent in a bwrap
sandbox against the scripted policy and comes back rewarded and token-exact; the gateway's routes on the
service's own port answer rollout keys (not the API token) while the rest of the API still wants the token."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import pytest
from tests.agent.scripted import completions, tool_call
from tests.conftest import unavailable
from tests.doubles.scripted_llm import ScriptedLLM, replay
from tests.gateway.conftest import check_exact
from tests.gateway.test_sandbox import gold_script, harness_image, harness_instance  # noqa: F401 - fixture

from raas.api.app import served
from raas.core.jobs import Job
from raas.core.trajectory import RunOutput
from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from raas.trainer.client import RaasClient

pytestmark = pytest.mark.e2e

TOKEN = "s3cret-api-token"


async def test_a_harness_job_through_the_service_and_its_gateway_routes(
    tmp_path: Path,
    tok: ChatTokenizer,
    test_image: Path,
    harness_image: Path,  # noqa: F811 - the fixture
    backend_available: dict[str, str | None],
) -> None:
    if backend_available.get("bwrap"):
        unavailable(str(backend_available["bwrap"]))
    script = completions(tok, [*gold_script(tool_call("submit")), "a reply over the service's port"])
    async with ScriptedLLM(replay(script)) as llm:
        config = ServiceConfig(
            state_dir=tmp_path / "svc",
            sandbox={"backend": "bwrap", "image": str(test_image), "start_timeout_s": 120},
            llm_servers=[llm.url],
            tokenizer_dir=prepare_tokenizer(),
            agent={"max_turns": 8, "max_tokens_per_turn": 1024},
            api_token=TOKEN,
            shutdown_grace_s=0.0,
            default_timeout_s=300,
        )
        service = RolloutService(config)
        async with served(service) as url:
            async with RaasClient(url, token=TOKEN) as client:
                await client.submit(harness_instance("openai-tools"), job_id="harness-1")
                result = await client.wait("harness-1", timeout_s=300)
            assert result["status"] == "completed", result.get("error")
            assert result["reward"] == 1.0 and result["resolved"] is True and result["filter"] is False
            out = RunOutput.model_validate(
                {k: result[k] for k in ("messages", "turns", "token_trajectory", "segments")}
                | {"artifacts": result["artifacts"]}
            )
            check_exact(out, [list(r.prompt_ids) for r in llm.requests])
            assert result["artifacts"]["finish_reason"] == "agent_exit"
            assert result["artifacts"]["gateway"]["continued"] == 2
            assert service.gateway is not None and service.gateway.sessions == []  # closed with the job

            # the routes on the service's port: a rollout key opens them, the API token does not
            gateway = service.gateway
            session = gateway.open_session(Job(job_id="outside", instance={}, trajectory_id="outside"))
            try:
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    body = {"model": "p", "messages": [{"role": "user", "content": "hi"}]}
                    r = await http.post(
                        "/gateway/v1/chat/completions",
                        json=body,
                        headers={"Authorization": f"Bearer {TOKEN}"},
                    )
                    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
                    assert (
                        await http.get("/status")
                    ).status_code == 401  # the API itself still wants its token
                sdk = anthropic.AsyncAnthropic(base_url=f"{url}/gateway", api_key=session.key, max_retries=0)
                reply = await sdk.messages.create(
                    model="p", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
                )
                assert reply.content[0].text == "a reply over the service's port"
                assert len(session.turns) == 1
            finally:
                await gateway.close_session(session)
