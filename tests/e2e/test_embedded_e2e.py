"""The whole product: real service (uvicorn on a port) + real embedded llama.cpp SmolLM2 server + bwrap
sandboxes, driven over HTTP through the native API and the ProRL-compatible API.

Token exactness is checked against the inference server's own answers: raas talks to llama-server through a
transparent recording proxy, and every turn's prompt and sampled IDs must equal what crossed the wire.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.conftest import leftovers, unavailable
from tests.e2e.recording_proxy import Exchange, RecordingProxy

from raas.cli.inprocess import service_in_process
from raas.llm.embedded import EmbeddedServer
from raas.llm.models import prepare_tokenizer
from raas.pipeline.config import ServiceConfig
from raas.sandbox import SandboxManager
from raas.tasks.datasets import builtin_math
from raas.trainer.client import RaasClient

pytestmark = pytest.mark.e2e

AGENT = {"max_turns": 2, "max_tokens_per_turn": 40, "context_budget": 2048, "stop_on_no_tool_call": False}
SAMPLING = {"temperature": 1.0, "seed": 1234}


@pytest.fixture
async def stack(
    tmp_path: Path,
    test_image: Path,
    backend_available: dict[str, str | None],
) -> AsyncIterator[tuple[str, RecordingProxy]]:
    """llama-server ← recording proxy ← raas service (bwrap sandboxes); yields (service URL, proxy).
    Afterwards neither the model server nor any sandbox the service started may be left."""
    if backend_available.get("bwrap"):
        unavailable(str(backend_available["bwrap"]))
    manager = SandboxManager(tmp_path / "sandboxes")
    llama = EmbeddedServer(parallel=4, ctx_per_slot=2048)
    await llama.start()
    try:
        async with RecordingProxy(llama.url) as proxy:
            config = ServiceConfig(
                state_dir=tmp_path / "svc",
                sandbox={"backend": "bwrap", "image": str(test_image)},
                llm_servers=[proxy.url],
                tokenizer_dir=prepare_tokenizer(),
                agent=AGENT,
                init_workers=2,
                run_workers=4,
                eval_workers=2,
                shutdown_grace_s=0.0,
                default_timeout_s=240,
            )
            async with service_in_process(config, sandbox_manager=manager) as url:
                yield url, proxy
            # The service closed every sandbox of every job before it stopped; nothing is left to close.
            assert manager.started_ids, "the jobs never opened a sandbox"
            assert not leftovers(manager), f"sandbox leftovers after shutdown: {leftovers(manager)}"
    finally:
        pid = llama.pid
        await llama.stop()
        await manager.close_all()
    assert pid is not None and not pid_alive(pid), "llama-server outlived the test"


def pid_alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


def generations(proxy: RecordingProxy) -> list[Exchange]:
    return [e for e in proxy.exchanges if e.path == "/completion" and e.status == 200]


def assert_exact_against_server(result: dict[str, Any], proxy: RecordingProxy) -> None:
    """Each turn's full prompt was sent verbatim and its output is exactly what the server returned."""
    wire = {tuple(e.request["prompt"]): e.response for e in generations(proxy)}
    seq: list[int] = []
    assert result["turns"], "a completed rollout has at least one turn"
    for turn in result["turns"]:
        seq += turn["prompt_ids"]
        assert turn["prompt_len"] == len(seq)
        answer = wire.get(tuple(seq))
        assert answer is not None, "raas recorded a prompt the server never received"
        assert turn["output_ids"] == answer["tokens"]
        assert turn["logprobs"] == pytest.approx([p["logprob"] for p in answer["completion_probabilities"]])
        seq += turn["output_ids"]
    traj = result["token_trajectory"]
    assert traj["prompt_ids"] + traj["response_ids"] == seq
    sampled = [t for turn in result["turns"] for t in turn["output_ids"]]
    assert [t for t, m in zip(traj["response_ids"], traj["loss_mask"], strict=True) if m] == sampled
    assert [t for m in result["messages"] for t in m["input_ids"] + (m.get("output_ids") or [])] == seq


async def test_batch_over_http_is_token_exact_and_rewarded(stack: tuple[str, RecordingProxy]) -> None:
    url, proxy = stack
    problems = builtin_math(4)
    async with RaasClient(url) as client:
        accepted = await client.submit_batch(
            [
                {"instance": p, "sampling_params": SAMPLING, "job_id": f"e2e-{i}"}
                for i, p in enumerate(problems)
            ]
        )
        assert len(accepted) == 4
        results = [await client.wait(f"e2e-{i}", timeout_s=240) for i in range(4)]
    for res in results:
        assert res["status"] in ("completed", "failed", "timeout", "cancelled")
        if res["status"] == "completed":
            assert res["filter"] is False and res["reward"] in (0.0, 1.0)
            assert_exact_against_server(res, proxy)
        else:  # an infrastructure failure is filtered, never rewarded
            assert res["filter"] is True and res["reward"] is None and res["error"]["kind"]
    assert sum(r["status"] == "completed" for r in results) >= 3, [r.get("error") for r in results]


async def test_prorl_process_is_token_exact(stack: tuple[str, RecordingProxy]) -> None:
    """A ProRL-style client: /start, then blocking /process per instance, reading messages' token fields."""
    url, proxy = stack
    instance = dict(builtin_math(5)[4])
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        assert (await http.post("/start")).status_code == 200
        r = await http.post(
            "/process",
            json={
                "instance": instance,
                "sampling_params": {
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "seed": 7,
                    "max_iterations": 2,
                    "model": "hosted_vllm/x",
                },
            },
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert (await http.post("/stop")).status_code == 200
    assert out["filter"] is False and out["critical_error"] is None
    assert out["reward"] in (0.0, 1.0) and isinstance(out["resolved"], bool)
    messages = out["messages"]
    assert messages[-1]["role"] == "assistant"
    seq = [t for m in messages for t in (m.get("input_ids") or []) + (m.get("token_ids") or [])]
    last = next(
        e for e in reversed(generations(proxy)) if seq[: len(e.request["prompt"])] == e.request["prompt"]
    )
    assert seq == last.request["prompt"] + last.response["tokens"]
