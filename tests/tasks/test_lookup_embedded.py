"""The ``lookup`` task with the real model: the embedded llama.cpp server (SmolLM2-135M on CPU) behind the
HTTP service, bwrap sandboxes. What the model scores does not matter; the record must hold together: tool
observations are prompt tokens (loss mask 0), the result's ``tool_called`` flag matches the calls in the
turns, and a reward of 1 means the reply held the secret."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.api.conftest import APIFactory
from tests.tasks.service import bwrap_service, run_jobs

from raas.core.jobs import JobResult
from raas.llm.embedded import EmbeddedServer
from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer
from raas.tasks.datasets import load_dataset
from raas.tasks.lookup import PROMPT_MESSAGES, lookup_details

pytestmark = pytest.mark.e2e

SAMPLES = 4


async def test_lookup_rollouts_with_the_embedded_model(
    make_api: APIFactory, test_image: Path, backend_available: dict[str, str | None]
) -> None:
    api = await bwrap_service(make_api, test_image, backend_available, context_budget=1536)
    instances = load_dataset("builtin:lookup:2")
    jobs = [
        (f"lookup-{i}-{k}", inst, {"temperature": 1.0})
        for i, inst in enumerate(instances)
        for k in range(SAMPLES)
    ]
    async with EmbeddedServer(parallel=4, ctx_per_slot=1536) as llama:
        raw = await run_jobs(api, llama.url, jobs)
    tok = ChatTokenizer.from_pretrained(prepare_tokenizer())
    secrets = {inst["instance_id"]: inst["answer"] for inst in instances}
    called = 0
    for job_id, body in raw.items():
        r = JobResult.model_validate(body)
        assert r.status == "completed" and not r.filter and r.reward in (0.0, 1.0), (job_id, r.error)
        details = lookup_details(r)
        assert details is not None and details.ground_truth == secrets[str(r.instance_id)]
        secret = details.ground_truth
        traj = r.token_trajectory
        assert secret not in tok.decode(traj.prompt_ids)

        # the rollout's own messages: one sampled assistant message per turn, tool results in between
        own = r.messages[PROMPT_MESSAGES:]
        replies = [m for m in own if m.role == "assistant"]
        assert [m.output_ids for m in replies] == [t.output_ids for t in r.turns]
        bash_calls = [c for m in replies for c in (m.tool_calls or []) if c.name == "bash"]
        assert details.tool_called is bool(bash_calls) and details.bash_calls == len(bash_calls)
        assert not details.secret_seen or details.tool_called
        called += details.tool_called
        if r.reward == 1.0:
            assert details.answer == secret

        # the response is turn 0's output, then per later turn the environment's delta (mask 0: the tool
        # observations, error messages, template tokens) and the sampled output (mask 1)
        expected_ids: list[int] = list(r.turns[0].output_ids)
        expected_mask = [1] * len(r.turns[0].output_ids)
        for turn in r.turns[1:]:
            assert turn.prompt_is_delta and turn.prompt_ids
            expected_ids += turn.prompt_ids + turn.output_ids
            expected_mask += [0] * len(turn.prompt_ids) + [1] * len(turn.output_ids)
        assert traj.response_ids == expected_ids and traj.loss_mask == expected_mask
        # every tool observation the policy saw is in a mask-0 delta
        deltas = [tok.decode(t.prompt_ids) for t in r.turns[1:]]
        for obs in (m for m in own if m.role == "tool"):
            assert any(obs.content in d for d in deltas), obs.content
        if details.secret_seen:
            assert any(secret in d for d in deltas)
    # The untrained model calls the tool in about half of its rollouts (bench/lookup_task.py): none in 8
    # would happen about once in a thousand runs, and would most likely mean the prompt or parser broke.
    assert called > 0
