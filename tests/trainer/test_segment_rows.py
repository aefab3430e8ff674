"""A rollout with several token segments (an agent that rewrote its history behind the gateway) becomes one
batch row per segment: every sampled token reaches the trainer, the rows share the sample's reward and
advantage, and stale-turn masking maps each segment's sampled runs to its own turns."""

from __future__ import annotations

import numpy as np
import pytest

from raas.errors import RaasError
from raas.trainer.adapters import nemo_rl_message_logs, to_nemo_rl, verl_arrays
from raas.trainer.grpo import assemble_batch, sampled_turn_of_tokens, segment_turns, token_segments
from raas.trainer.types import JobResult, TokenTrajectory, Turn
from tests.trainer.test_grpo import group, result

pytestmark = pytest.mark.unit

OBS = [9, 9]

# Per segment: its full first prompt, then its turns (sampled IDs, weight version). Like mini-swe-agent
# through the gateway: its reply is dropped and a format-error message added, so the next request no longer
# extends the record and opens a new segment (segment 1 holds two turns: that agent then kept its history).
SEGMENTS: list[tuple[list[int], list[tuple[list[int], str]]]] = [
    ([1, 2], [([5, 6], "step-3")]),
    ([1, 2, 3], [([7], "step-4"), ([8, 8], "step-3")]),
    ([1, 2, 3, 4], [([10, 11, 12], "step-4")]),
]


def segmented(job_id: str, reward: float) -> JobResult:
    """A result shaped as the gateway records one (raas.gateway.record.Segment.trajectory): per segment the
    first prompt, then turn outputs (mask 1) separated by ``OBS`` (mask 0); ``token_trajectory`` is the last."""
    trajs: list[TokenTrajectory] = []
    turns: list[Turn] = []
    for k, (prompt, outs) in enumerate(SEGMENTS):
        response: list[int] = []
        mask: list[int] = []
        lps: list[float | None] = []
        for j, (out, version) in enumerate(outs):
            if j:
                response += OBS
                mask += [0] * len(OBS)
                lps += [0.0] * len(OBS)
            turns.append(
                Turn(
                    index=len(turns),
                    prompt_ids=prompt if j == 0 else list(OBS),
                    prompt_is_delta=j > 0,
                    prompt_len=0,
                    output_ids=out,
                    logprobs=[-0.1 * (len(turns) + 1)] * len(out),
                    finish_reason="stop",
                    weight_version=version,
                    segment=k,
                )
            )
            response += out
            mask += [1] * len(out)
            lps += [-0.1 * len(turns)] * len(out)
        trajs.append(TokenTrajectory(prompt_ids=prompt, response_ids=response, loss_mask=mask, logprobs=lps))
    return JobResult(
        job_id=job_id,
        status="completed",
        reward=reward,
        filter=False,
        turns=turns,
        token_trajectory=trajs[-1],
        segments=trajs,
    )


def test_every_segment_is_a_row_with_exactly_its_sampled_tokens() -> None:
    s = segmented("s", 1.0)
    plain = result("p", 0.0, [1], [([4], "0")])
    batch = assemble_batch([group("g", [s, plain])], pad_id=0, max_prompt_len=4, max_response_len=8)
    assert batch.size == 4
    assert batch.job_ids == ["s", "s", "s", "p"]
    assert batch.sample_index.tolist() == [0, 0, 0, 1]
    assert batch.segment_index.tolist() == [0, 1, 2, 0]
    assert batch.group_index.tolist() == [0, 0, 0, 0]
    for b, (prompt, outs) in enumerate(SEGMENTS):
        assert batch.prompts[b][batch.attention_mask[b, :4] == 1].tolist() == prompt
        sampled = batch.responses[b][batch.loss_mask[b] == 1].tolist()
        assert sampled == [t for out, _ in outs for t in out]
        assert batch.rollout_logprobs[b][batch.loss_mask[b] == 1].tolist() == pytest.approx(
            [lp for t in s.turns if t.segment == b for lp in t.logprobs]
        )
    assert batch.responses[1].tolist() == [7, 9, 9, 8, 8, 0, 0, 0]
    assert batch.loss_mask[1].tolist() == [1, 0, 0, 1, 1, 0, 0, 0]
    # every token the policy sampled in the rollout is in exactly one row
    rows = [batch.responses[b][batch.loss_mask[b] == 1].tolist() for b in range(3)]
    assert [t for row in rows for t in row] == [t for turn in s.turns for t in turn.output_ids]
    # the baseline counts the sample once: mean(1, 0) = 0.5, not mean(1, 1, 1, 0) = 0.75
    assert batch.rewards.tolist() == [1.0, 1.0, 1.0, 0.0]
    for b in range(3):
        assert set(batch.advantages[b][batch.loss_mask[b] == 1].tolist()) == {0.5}
    assert batch.advantages[3].tolist() == [-0.5] + [0.0] * 7
    assert batch.segments[1] == [(0, 1, "assistant"), (1, 3, "environment"), (3, 5, "assistant")]


def test_one_segment_results_keep_their_layout() -> None:
    a = result("a", 1.0, [11, 12], [([21, 22], "0"), ([23], "0")])
    b = result("b", 0.0, [13], [([24], "0")])
    batch = assemble_batch([group("g", [a, b]), group("h", [b])], 0, 3, 6)
    assert batch.sample_index.tolist() == [0, 1, 2] and batch.segment_index.tolist() == [0, 0, 0]
    assert token_segments(a) == [a.token_trajectory] and segment_turns(a) == [[0, 1]]


def test_stale_turns_are_masked_in_the_segment_that_holds_them() -> None:
    s = segmented("s", 1.0)
    assert segment_turns(s) == [[0], [1, 2], [3]]
    assert sampled_turn_of_tokens(s, 0) == [0, 0]
    assert sampled_turn_of_tokens(s, 1) == [1, -1, -1, 2, 2]
    assert sampled_turn_of_tokens(s) == [3, 3, 3]  # token_trajectory: the last segment
    plain = result("p", 0.0, [1], [([4], "step-4")])
    batch = assemble_batch([group("g", [s, plain])], 0, 4, 8, mask_turns_before=4)
    # turns 0 and 2 were sampled by step-3: masked; turns 1 and 3 (step-4) kept
    assert batch.loss_mask[0].tolist() == [0] * 8
    assert batch.loss_mask[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert batch.loss_mask[2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert batch.stats["masked_stale_tokens"] == 4


def test_segments_that_disagree_with_their_turns_are_refused() -> None:
    s = segmented("s", 1.0)
    s.turns[3].segment = 1  # the turns now name two segments for three sequences
    with pytest.raises(RaasError) as e:
        assemble_batch([group("g", [s])], 0, 4, 8, mask_turns_before=1)
    assert e.value.kind == "bad_request" and "3 token segments but its turns name 2" in str(e.value)
    s = segmented("s", 1.0)
    s.segments[1].response_ids[3] = 99  # not what turn 2 sampled
    with pytest.raises(RaasError) as e:
        sampled_turn_of_tokens(s, 1)
    assert e.value.kind == "bad_request" and "token segment 1" in str(e.value)
    with pytest.raises(RaasError) as e:
        sampled_turn_of_tokens(s, 3)
    assert e.value.kind == "bad_request"
    s = segmented("s", 1.0)
    s.segments[0].logprobs.append(0.0)
    with pytest.raises(RaasError, match="token segment 0"):
        assemble_batch([group("g", [s])], 0, 4, 8)


def test_overlong_is_decided_per_segment_row() -> None:
    s = segmented("s", 1.0)
    plain = result("p", 0.0, [1], [([4], "0")])
    dropped = assemble_batch([group("g", [s, plain])], 0, 3, 8, overlong="drop")
    # segment 2's prompt (4 tokens) does not fit 3 columns: that row goes, the sample's others stay
    assert dropped.job_ids == ["s", "s", "p"] and dropped.segment_index.tolist() == [0, 1, 0]
    assert dropped.sample_index.tolist() == [0, 0, 1]
    assert dropped.advantages[0, 0] == pytest.approx(0.5)


def test_adapters_carry_the_row_identity() -> None:
    s = segmented("s", 1.0)
    plain = result("p", 0.0, [1], [([4], "0")])
    batch = assemble_batch([group("g", [s, plain])], 0, 4, 8)
    tensors, non_tensors = verl_arrays(batch)
    assert non_tensors["uid"].tolist() == ["g"] * 4  # one GRPO group, whatever the rows
    assert non_tensors["raas_job_id"].tolist() == ["s", "s", "s", "p"]
    assert non_tensors["raas_sample_index"].tolist() == [0, 0, 0, 1]
    assert non_tensors["raas_segment_index"].tolist() == [0, 1, 2, 0]
    assert all(len(v) == 4 for v in non_tensors.values())
    assert np.array_equal(tensors["advantages"], batch.advantages)
    logs = nemo_rl_message_logs(batch)
    sampled = np.concatenate([m["token_ids"][m["token_loss_mask"] == 1] for m in logs[1]]).tolist()
    assert sampled == [7, 8, 8]
    data = to_nemo_rl(batch)
    assert [int(x) for x in data["sample_index"]] == [0, 0, 0, 1]
    assert [int(x) for x in data["segment_index"]] == [0, 1, 2, 0]
