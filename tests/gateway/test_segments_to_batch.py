"""An agent that drops its unparseable replies (mini-swe-agent does) makes every turn a new token segment
behind the gateway; the trainer's batch still gets every sampled token, one row per segment."""

from __future__ import annotations

import pytest
from tests.gateway.conftest import check_exact, scripted_rig, sent_prompts

from raas.core.jobs import Job, Timing
from raas.llm.tokenizer import ChatTokenizer
from raas.pipeline.results import Outcome, build_result
from raas.trainer.grpo import assemble_batch
from raas.trainer.types import Group

pytestmark = pytest.mark.integration

REPLIES = ["I would list the files.", "Let me think about it.", "```bash\nls\n```"]


async def test_dropped_replies_become_segments_and_every_segment_a_row(tok: ChatTokenizer) -> None:
    async with scripted_rig(tok, REPLIES) as rig:
        ep = await rig.open()
        client = ep.openai()
        messages = [
            {"role": "system", "content": "Answer with one bash block."},
            {"role": "user", "content": "Which files are there?"},
        ]
        for _ in REPLIES:
            r = await client.chat.completions.create(model="p", messages=messages)  # type: ignore[arg-type]
            # the reply is dropped from the history; only a format error is added, as mini-swe-agent does
            assert r.choices[0].message.content is not None
            messages.append({"role": "user", "content": "Format error: reply with exactly one bash block."})
        out = ep.session.run_output()
        check_exact(out, sent_prompts(rig.server))
    assert len(out.segments) == 3 and [t.segment for t in out.turns] == [0, 1, 2]
    job = Job(job_id="j-seg", instance={"data_source": "x"}, trajectory_id="0")
    seg = build_result(job, Outcome(status="completed", reward=1.0), out, Timing())
    other = build_result(
        Job(job_id="j-one", instance={"data_source": "x"}, trajectory_id="1"),
        Outcome(status="completed", reward=0.0),
        out.model_copy(update={"segments": [], "turns": out.turns[-1:]}),
        Timing(),
    )
    g = Group(group_id="g", instance={"data_source": "x"}, size=2, results={0: seg, 1: other})
    batch = assemble_batch([g], 0, 512, 64)
    assert batch.job_ids == ["j-seg", "j-seg", "j-seg", "j-one"]
    assert batch.segment_index.tolist() == [0, 1, 2, 0] and batch.sample_index.tolist() == [0, 0, 0, 1]
    for b, turn in enumerate(out.turns):  # each row trains on exactly the IDs its turn sampled
        assert batch.responses[b][batch.loss_mask[b] == 1].tolist() == turn.output_ids
        assert batch.responses[b][batch.loss_mask[b] == 1].tolist() == rig.script[b].token_ids
    # one sample in the baseline per rollout: mean(1, 0) = 0.5
    assert float(batch.advantages[0][batch.loss_mask[0] == 1][0]) == pytest.approx(0.5)
    assert float(batch.advantages[3][batch.loss_mask[3] == 1][0]) == pytest.approx(-0.5)
