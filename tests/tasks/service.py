"""Driving task handlers through the real HTTP service: bwrap sandboxes, the SmolLM2 chat tokenizer and a
scripted policy that speaks the vLLM wire protocol (tests/doubles/scripted_llm.py).

One scripted server serves several jobs at once: each job's script is chosen by a marker its prompt holds
(text unique to the instance), and the turn by the number of assistant turns already in the prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from tests.agent.scripted import completions
from tests.api.conftest import APIFactory, LiveAPI
from tests.conftest import unavailable
from tests.doubles.scripted_llm import Completion, CompletionRequest, Responder

from raas.agent.config import AgentConfig
from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer

ASSISTANT_TURN = "<|im_start|>assistant"


def by_marker(tok: ChatTokenizer, scripts: dict[str, Sequence[str]]) -> Responder:
    """Answer each request from the script whose marker its prompt contains, turn by turn."""
    scripted = {marker: completions(tok, texts) for marker, texts in scripts.items()}

    def respond(req: CompletionRequest) -> Completion:
        prompt = tok.decode(req.prompt_ids)
        hits = [m for m in scripted if m in prompt]
        if len(hits) != 1:
            raise RuntimeError(f"prompt matches scripts {hits} (want exactly one)")
        turn = prompt.count(ASSISTANT_TURN) - 1
        script = scripted[hits[0]]
        if turn >= len(script):
            raise RuntimeError(f"script {hits[0]!r} has no turn {turn}")
        return script[turn]

    return respond


async def bwrap_service(
    make_api: APIFactory,
    test_image: Path,
    backend_available: dict[str, str | None],
    *,
    backend: str = "bwrap",
    **agent: Any,
) -> LiveAPI:
    """A live service whose jobs run in bwrap sandboxes of the test image (or the ``local`` backend)."""
    if backend_available.get(backend):
        unavailable(str(backend_available[backend]))
    sandbox: dict[str, Any] = {"backend": backend, "start_timeout_s": 120}
    if backend != "local":
        sandbox["image"] = str(test_image)
    return await make_api(
        sandbox=sandbox,
        tokenizer_dir=prepare_tokenizer(),
        agent=AgentConfig(**{"max_turns": 6, "max_tokens_per_turn": 1024, **agent}),
        init_workers=2,
        run_workers=4,
        eval_workers=2,
        default_timeout_s=300,
    )


async def run_jobs(
    api: LiveAPI, llm_url: str, jobs: Sequence[tuple[str, dict[str, Any], dict[str, Any]]]
) -> dict[str, dict[str, Any]]:
    """Submit ``(job_id, instance, sampling_params)`` jobs as one batch; their results by job id."""
    c = api.client
    r = await c.post("/v1/llm/servers", json={"address": llm_url})
    assert r.status_code == 200, r.text
    body = {"jobs": [{"job_id": j, "instance": inst, "sampling_params": sp} for j, inst, sp in jobs]}
    r = await c.post("/v1/jobs:batch", json=body)
    assert r.status_code == 202, r.text
    return dict(await asyncio.gather(*(_result(c, job_id) for job_id, _, _ in jobs)))


async def _result(c: httpx.AsyncClient, job_id: str) -> tuple[str, dict[str, Any]]:
    while True:
        r = await c.get(f"/v1/jobs/{job_id}/result", params={"wait": 60}, timeout=90)
        if r.status_code == 200:
            return job_id, r.json()
        assert r.status_code == 202, r.text


def tool_observations(result: dict[str, Any]) -> list[str]:
    return [m["content"] for m in result["messages"] if m["role"] == "tool"]
