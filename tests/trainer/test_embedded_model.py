"""The trainer side with the real embedded model (llama.cpp SmolLM2-135M on the CPU) behind a real
service: groups of ``builtin:addition`` rollouts come back typed and graded, and the assembled batch trains
on exactly the tokens the model sampled (checked against each result's ``turns``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from raas.cli.inprocess import service_in_process
from raas.llm.embedded import EmbeddedServer
from raas.llm.models import prepare_tokenizer
from raas.pipeline.config import ServiceConfig
from raas.tasks.datasets import load_dataset
from raas.trainer.adapters import to_nemo_rl, to_verl
from raas.trainer.grpo import assemble_batch
from raas.trainer.rollout import RolloutClient
from raas.trainer.types import JobResult

pytestmark = pytest.mark.e2e


@pytest.fixture
async def service_url(tmp_path: Path) -> AsyncIterator[str]:
    llama = EmbeddedServer(parallel=4, ctx_per_slot=1024)
    await llama.start()
    try:
        config = ServiceConfig(
            state_dir=tmp_path / "svc",
            llm_servers=[llama.url],
            tokenizer_dir=prepare_tokenizer(),
            run_workers=4,
            shutdown_grace_s=0.0,
            default_timeout_s=240,
        )
        async with service_in_process(config) as url:
            yield url
    finally:
        await llama.stop()


async def test_groups_of_real_rollouts_become_a_token_exact_batch(service_url: str) -> None:
    problems = load_dataset("builtin:addition:2")
    async with RolloutClient(service_url) as client:
        await client.set_weight_version("0")
        groups = [
            client.new_group(p, 4, sampling_params={"temperature": 1.0, "max_tokens": 16}) for p in problems
        ]
        await client.submit_groups(groups)
        done = [await client.next_group(timeout=600) for _ in groups]
    for g in done:
        assert not g.dropped and sorted(g.results) == [0, 1, 2, 3]
        for r in g.samples:
            assert isinstance(r, JobResult) and r.reward in (0.0, 1.0)
            assert len(r.turns) == 1 and r.turns[0].weight_version == "0"
            assert 0 < len(r.turns[0].output_ids) <= 16
    batch = assemble_batch(done, pad_id=2, max_prompt_len=128, max_response_len=32)
    assert batch.size == 8 and not batch.overlong.any()
    by_id = {r.job_id: r for g in done for r in g.samples}
    for row, job_id in enumerate(batch.job_ids):
        r = by_id[job_id]
        sampled = [t for turn in r.turns for t in turn.output_ids]
        assert batch.responses[row][batch.loss_mask[row] == 1].tolist() == sampled
        assert (
            batch.prompts[row][batch.attention_mask[row, :128] == 1].tolist() == r.token_trajectory.prompt_ids
        )
        assert batch.rewards[row] == r.reward
        # advantages: reward minus the group's mean reward, on the sampled tokens only
        g = next(g for g in done if job_id in {s.job_id for s in g.samples})
        mean = sum(g.rewards) / len(g.rewards)
        adv = batch.advantages[row][batch.loss_mask[row] == 1].tolist()
        assert adv == pytest.approx([r.reward - mean] * len(sampled))
    verl = to_verl(batch)  # a real verl.DataProto (verl is installed with the trainer extras)
    assert tuple(verl.batch["response_mask"].shape) == (8, 32)
    nemo = to_nemo_rl(batch)
    assert len(nemo["message_log"]) == 8
