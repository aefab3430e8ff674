"""Per-prompt pass-rate tracking: settled prompts are deferred, uncertain ones preferred, and through the
real sampler against a real service the trainer stops paying for groups it would throw away."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from raas.errors import RaasError
from raas.trainer.dapo import DynamicSampler
from raas.trainer.pass_rates import PassRateFilter, prompt_key
from raas.trainer.rollout import RolloutClient
from tests.trainer.conftest import StackFactory, instance


def inst(iid: str) -> dict[str, Any]:
    return {"instance_id": iid}


@pytest.mark.unit
def test_a_prompt_is_deferred_only_after_enough_all_equal_samples() -> None:
    f = PassRateFilter(window=8, min_samples=4, revisit_every=3)
    solved, failed, mixed = inst("solved"), inst("failed"), inst("mixed")
    f.observe(solved, [1.0, 1.0, 1.0])
    assert f.admit(solved)  # 3 samples: not enough to judge
    f.observe(solved, [1.0])
    f.observe(failed, [0.0] * 4)
    f.observe(mixed, [1.0, 0.0, 0.0, 0.0])
    assert f.settled(solved) and f.settled(failed) and not f.settled(mixed)
    assert f.admit(mixed)
    # Deferred twice, let through the third time it comes up (a policy may since have changed).
    assert [f.admit(solved) for _ in range(6)] == [False, False, True, False, False, True]
    assert f.skipped == 4 and f.revisited == 2
    # A new failure pushes the oldest success out of the window: no longer settled.
    f.observe(solved, [1.0] * 4 + [0.0])
    assert not f.settled(solved) and f.pass_rate(solved) == pytest.approx(7 / 8)


@pytest.mark.unit
def test_the_prompt_nearest_half_is_chosen_among_the_lookahead() -> None:
    f = PassRateFilter(window=8, min_samples=8, lookahead=3)
    f.observe(inst("a"), [1.0] * 7 + [0.0])  # 7/8: score 0.11
    f.observe(inst("b"), [1.0, 0.0] * 4)  # 1/2: score 0.25
    f.observe(inst("c"), [0.0] * 7 + [1.0])  # 1/8
    buffer: list[dict[str, Any]] = []
    source = iter([inst("a"), inst("b"), inst("c"), inst("d")])
    assert f.choose(source, buffer) == inst("b")
    assert [prompt_key(i) for i in buffer] == ["a", "c"]
    # "d" was never sampled: it scores as p = 0.5 and is taken before the lopsided ones.
    assert f.choose(source, buffer) == inst("d")
    assert f.choose(source, buffer) in (inst("a"), inst("c"))


@pytest.mark.unit
def test_settled_prompts_are_skipped_not_dropped_and_the_data_end_is_seen() -> None:
    f = PassRateFilter(window=4, min_samples=4, revisit_every=2, lookahead=1)
    f.observe(inst("s"), [1.0] * 4)
    source = iter([inst("s"), inst("x"), inst("s")])
    buffer: list[dict[str, Any]] = []
    assert f.choose(source, buffer) == inst("x")  # "s" skipped the first time
    assert f.choose(source, buffer) == inst("s")  # and revisited the second
    assert f.choose(source, buffer) is None


@pytest.mark.unit
def test_keys_and_settings() -> None:
    assert prompt_key({"instance_id": "p1", "x": 1}) == "p1"
    assert prompt_key({"problem": "1+1"}) == prompt_key({"problem": "1+1"}) != prompt_key({"problem": "1+2"})
    for bad in ({"window": 0}, {"min_samples": 9, "window": 8}, {"revisit_every": 0}, {"lookahead": 0}):
        with pytest.raises(RaasError) as e:
            PassRateFilter(**bad)
        assert e.value.kind == "bad_request"


@pytest.mark.integration
async def test_the_sampler_stops_paying_for_settled_prompts(make_stack: StackFactory) -> None:
    """Epochs over four prompts, two always solved and one never: without tracking every epoch pays for
    the three uninformative groups again; with it, after the first epoch they are deferred and most
    groups the sampler runs are informative."""
    stack = await make_stack()
    data = [
        instance("always", rewards=[1, 1, 1, 1]),
        instance("never", rewards=[0, 0, 0, 0]),
        instance("half", rewards=[1, 0, 1, 0]),
        instance("always2", rewards=[1, 1, 1, 1]),
    ]
    results = {}
    for tracked in (False, True):
        async with RolloutClient(stack.urls) as client:
            sampler = DynamicSampler(
                client,
                itertools.cycle(data),
                group_size=4,
                target_groups=1,
                max_inflight_groups=1,
                pass_rates=PassRateFilter(window=4, min_samples=4, revisit_every=8, lookahead=1)
                if tracked
                else None,
            )
            steps = [(await sampler.next_step())[1] for _ in range(6)]
            await sampler.close()
        results[tracked] = steps
        assert all(g for g in steps)
    plain, tracked_steps = results[False], results[True]
    wasted_plain = sum(s.uninformative_groups for s in plain)
    wasted_tracked = sum(s.uninformative_groups for s in tracked_steps)
    # Data order: always, never, half, always2, always, ...: the first step pays for 2 uninformative
    # groups, every later one for 3. With tracking, each settled prompt is paid for once, then deferred.
    assert wasted_plain == 2 + 3 * 5
    assert wasted_tracked == 3
    assert sum(s.skipped_prompts for s in tracked_steps) == 2 + 3 * 4 and all(
        s.skipped_prompts == 0 for s in plain
    )
