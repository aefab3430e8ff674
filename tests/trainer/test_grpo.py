"""GRPO advantages against hand-computed values, and the padded batch layout, on hand-built results."""

from __future__ import annotations

import numpy as np
import pytest

from raas.errors import RaasError
from raas.trainer.grpo import assemble_batch, group_advantages, sampled_turn_of_tokens
from raas.trainer.types import Group, JobResult, TokenTrajectory, Turn, version_number

pytestmark = pytest.mark.unit


def result(
    job_id: str,
    reward: float | None,
    prompt: list[int],
    turns: list[tuple[list[int], str | None]],
    obs: list[int] = (9, 9),  # type: ignore[assignment]
    *,
    status: str = "completed",
    filtered: bool = False,
) -> JobResult:
    """A result whose response is turn outputs separated by ``obs`` (mask 0), like the agent loop's."""
    response: list[int] = []
    mask: list[int] = []
    lps: list[float | None] = []
    recs = []
    for k, (out, version) in enumerate(turns):
        if k:
            response += list(obs)
            mask += [0] * len(obs)
            lps += [0.0] * len(obs)
        recs.append(
            Turn(
                index=k,
                prompt_ids=prompt if k == 0 else list(obs),
                prompt_is_delta=k > 0,
                prompt_len=0,
                output_ids=out,
                logprobs=[-0.5] * len(out),
                finish_reason="stop",
                weight_version=version,
            )
        )
        response += out
        mask += [1] * len(out)
        lps += [-0.5] * len(out)
    return JobResult(
        job_id=job_id,
        status=status,  # type: ignore[arg-type]
        reward=reward,
        filter=filtered,
        turns=recs,
        token_trajectory=TokenTrajectory(
            prompt_ids=prompt, response_ids=response, loss_mask=mask, logprobs=lps
        ),
    )


def group(gid: str, results: list[JobResult]) -> Group:
    g = Group(group_id=gid, instance={"data_source": "x"}, size=len(results))
    for i, r in enumerate(results):
        g.results[i] = r
    return g


def test_mean_centred_advantages_by_hand() -> None:
    # rewards 1, 0, 1, 0 → mean 0.5 → +0.5, -0.5, +0.5, -0.5
    assert group_advantages([1, 0, 1, 0]).tolist() == [0.5, -0.5, 0.5, -0.5]
    # rewards 3, 1, 2 → mean 2 → 1, -1, 0
    assert group_advantages([3, 1, 2]).tolist() == [1.0, -1.0, 0.0]


def test_std_normalized_uses_sample_std() -> None:
    # rewards 1,0,1,0: sample std = sqrt(((.5^2)*4)/3) = sqrt(1/3) = 0.57735
    adv = group_advantages([1, 0, 1, 0], std_normalize=True, eps=0.0)
    assert adv.tolist() == pytest.approx([0.8660254, -0.8660254, 0.8660254, -0.8660254])
    # all equal: no signal, no division blow-up
    assert group_advantages([1, 1, 1], std_normalize=True).tolist() == [0.0, 0.0, 0.0]


def test_leave_one_out_by_hand() -> None:
    # rewards 1, 0, 0: baselines (0+0)/2=0, (1+0)/2=.5, .5 → 1, -.5, -.5
    assert group_advantages([1, 0, 0], leave_one_out=True).tolist() == [1.0, -0.5, -0.5]
    # equals n/(n-1) * (r - mean)
    r = [0.2, 0.9, 0.4, 0.7]
    expect = np.array(r) - np.mean(r)
    assert group_advantages(r, leave_one_out=True) == pytest.approx(expect * 4 / 3)
    assert group_advantages([1.0], leave_one_out=True).tolist() == [0.0]
    assert group_advantages([]).tolist() == []


def test_layout_left_padded_prompt_right_padded_response() -> None:
    a = result("a", 1.0, [11, 12, 13], [([21, 22], "0"), ([23], "0")])
    b = result("b", 0.0, [14], [([24, 25, 26], "0")])
    batch = assemble_batch([group("g", [a, b])], pad_id=0, max_prompt_len=4, max_response_len=6)
    assert batch.input_ids.tolist() == [
        [0, 11, 12, 13, 21, 22, 9, 9, 23, 0],
        [0, 0, 0, 14, 24, 25, 26, 0, 0, 0],
    ]
    assert batch.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 0, 1, 2, 3, 4, 5, 6, 7, 7], [0, 0, 0, 0, 1, 2, 3, 3, 3, 3]]
    assert batch.loss_mask.tolist() == [[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]]
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.advantages.tolist() == [[0.5, 0.5, 0, 0, 0.5, 0], [-0.5, -0.5, -0.5, 0, 0, 0]]
    assert batch.rollout_logprobs[0].tolist() == [-0.5, -0.5, 0, 0, -0.5, 0]
    assert batch.segments[0] == [(0, 2, "assistant"), (2, 4, "environment"), (4, 5, "assistant")]
    assert batch.responses.shape == (2, 6) and batch.prompts.shape == (2, 4)
    assert batch.input_ids.dtype == np.int64 and batch.advantages.dtype == np.float32


def test_loss_mask_is_exactly_the_sampled_tokens() -> None:
    r = result("a", 1.0, [1, 2], [([5, 6, 7], "0"), ([8], "0"), ([9, 10], "0")], obs=[3, 3, 3])
    batch = assemble_batch([group("g", [r, result("b", 0.0, [1], [([4], "0")])])], 0, 2, 16)
    row = batch.responses[0][batch.loss_mask[0] == 1].tolist()
    assert row == [t for turn in r.turns for t in turn.output_ids]
    assert sampled_turn_of_tokens(r) == [0, 0, 0, -1, -1, -1, 1, -1, -1, -1, 2, 2]


def test_filtered_results_never_enter_a_batch_or_a_baseline() -> None:
    good = [result(f"ok{i}", r, [1], [([5], "0")]) for i, r in enumerate([1.0, 0.0, 0.0])]
    bad = result("infra", None, [1], [([5], "0")], status="failed", filtered=True)
    zero_but_filtered = result("fake-zero", 0.0, [1], [([5], "0")], filtered=True)
    g = group("g", [*good, bad, zero_but_filtered])
    batch = assemble_batch([g], 0, 2, 4)
    assert batch.job_ids == ["ok0", "ok1", "ok2"]
    # baseline over the three usable rewards only: mean 1/3
    assert batch.advantages[:, 0].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert batch.stats["excluded_results"] == 2
    dropped = group("d", good)
    dropped.dropped = True
    assert assemble_batch([dropped], 0, 2, 4).size == 0


def test_overlong_mask_or_drop() -> None:
    long = result("long", 1.0, [1, 2, 3, 4, 5], [([6, 7, 8, 9], "0")])
    short = result("short", 0.0, [1], [([6], "0")])
    masked = assemble_batch([group("g", [long, short])], 0, 3, 2, overlong="mask")
    assert masked.size == 2 and masked.overlong.tolist() == [True, False]
    assert masked.input_ids[0].tolist() == [3, 4, 5, 6, 7]  # last prompt tokens, first response tokens
    assert masked.loss_mask[0].tolist() == [0, 0] and masked.advantages[0].tolist() == [0, 0]
    assert masked.advantages[1, 0] == pytest.approx(-0.5)  # the overlong row still counts in the baseline
    dropped = assemble_batch([group("g", [long, short])], 0, 3, 2, overlong="drop")
    assert dropped.job_ids == ["short"] and dropped.stats["dropped_overlong"] == 1
    with pytest.raises(RaasError):
        assemble_batch([], 0, 0, 2)


def test_mask_turns_sampled_by_an_older_policy() -> None:
    carried = result("c", 1.0, [1], [([5, 5], "step-3"), ([6], "step-4"), ([7, 7], "step-4")])
    fresh = result("f", 0.0, [1], [([5], "step-4")])
    batch = assemble_batch([group("g", [carried, fresh])], 0, 1, 10, mask_turns_before=4)
    assert batch.loss_mask[0].tolist() == [0, 0, 0, 0, 1, 0, 0, 1, 1, 0]
    assert batch.stats["masked_stale_tokens"] == 2
    assert batch.advantages[0].tolist() == [0, 0, 0, 0, 0.5, 0, 0, 0.5, 0.5, 0]


def test_trajectory_that_disagrees_with_its_turns_is_refused() -> None:
    r = result("a", 1.0, [1], [([5, 6], "0")])
    r.token_trajectory.response_ids[1] = 99
    with pytest.raises(RaasError) as e:
        sampled_turn_of_tokens(r)
    assert e.value.kind == "bad_request"


def test_version_numbers() -> None:
    assert version_number("7") == 7 and version_number("step-12") == 12
    assert version_number(None) is None and version_number("latest") is None
