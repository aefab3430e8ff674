"""DAPO dynamic sampling against real services and the scripted policy: filtering, cancel of surplus,
carry-over across weight updates, the staleness bound."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from raas.trainer.client import RaasClient
from raas.trainer.dapo import DynamicSampler
from raas.trainer.rollout import RolloutClient
from tests.trainer.conftest import Stack, StackFactory, instance

pytestmark = pytest.mark.integration

INFORMATIVE = [1, 0, 1, 0]
ALL_ONE = [1, 1, 1, 1]


async def wait_until_cancelled(stack: Stack, job_ids: list[str]) -> None:
    async with RaasClient(stack.urls[0]) as raw:
        for _ in range(400):
            states = [(await raw.get(j))["status"] for j in job_ids]
            if all(s == "cancelled" for s in states) and stack.managers[0].list() == []:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"not cancelled: {states}, sandboxes {stack.managers[0].list()}")


async def test_filters_all_equal_groups_and_cancels_surplus(make_stack: StackFactory) -> None:
    stack = await make_stack()
    slow = {"sandbox": True, "run_sleep": 120, "rewards": INFORMATIVE}
    data = [
        instance("u0", rewards=ALL_ONE),
        instance("slow0", **slow),
        instance("i0", rewards=INFORMATIVE),
        instance("u1", rewards=[0, 0, 0, 0]),
        instance("slow1", **slow),
        instance("i1", rewards=INFORMATIVE),
        instance("i2", rewards=[0, 0, 1, 1]),
    ]
    async with RolloutClient(stack.urls) as client:
        sampler = DynamicSampler(client, data, group_size=4, target_groups=3, max_inflight_groups=7)
        batch, stats = await sampler.next_step()
        assert sorted(g.instance["instance_id"] for g in batch) == ["i0", "i1", "i2"]
        assert all(g.informative for g in batch)
        assert stats.accepted_groups == 3 and stats.uninformative_groups == 2
        assert stats.informative_fraction == pytest.approx(3 / 5)
        assert stats.cancelled_groups == 2 and stats.cancelled_jobs == 8
        assert stats.rollouts_used == 12 and stats.rollouts_wasted == 8
        assert stats.staleness == {0: 3} and stats.carried_over_groups == 0
        slow_jobs = [f"{client.run_id}-g{k}.{i}.0" for k in (1, 4) for i in range(4)]
    # The service stopped them and closed every sandbox they held.
    await wait_until_cancelled(stack, slow_jobs)


async def test_carry_over_keeps_every_turns_version(make_stack: StackFactory) -> None:
    stack = await make_stack()
    data = [instance("fast", rewards=INFORMATIVE, turns=1)] + [
        instance(f"long{k}", rewards=INFORMATIVE, turns=3, turn_sleep=0.4) for k in range(3)
    ]
    async with RolloutClient(stack.urls) as client:
        await client.set_weight_version("0")
        sampler = DynamicSampler(
            client, data, group_size=2, target_groups=1, max_inflight_groups=4, carry_over=True
        )
        batch0, s0 = await sampler.next_step()
        assert [g.instance["instance_id"] for g in batch0] == ["fast"]
        # admission: in flight + accepted <= (1 + 1) * 1, so two long groups keep running into step 1
        assert s0.carried_over_groups == 2 and s0.cancelled_jobs == 0

        async def load() -> None:
            stack.weights.version = 1

        await asyncio.sleep(0.2)
        assert await sampler.update_weights(load) == 1
        carried: list[Any] = []
        carried_in = 0
        for _ in range(3):
            batch, stats = await sampler.next_step()
            carried += batch
            carried_in += stats.carried_in_groups
            assert set(stats.staleness) <= {0, 1}
        assert carried_in == 2  # long0 and long1 were submitted under version 0
    straddling = 0
    for g in carried:
        for r in g.samples:
            stamped = [int(t.weight_version) for t in r.turns]  # type: ignore[arg-type]
            assert stamped == [t.output_ids[0] // 1000 for t in r.turns]  # the weights that sampled it
            straddling += stamped[0] == 0 and stamped[-1] == 1
    assert straddling >= 1, "no trajectory ran across the weight update"
    # Masking stale turns: only the tokens sampled by the current policy (version 1) stay trainable.
    sampler.mask_stale_turns = True
    b = sampler.assemble(carried, 0, 4, 16)
    for row, job_id in enumerate(b.job_ids):
        r = next(s for g in carried for s in g.samples if s.job_id == job_id)
        fresh = [tok for t in r.turns if t.weight_version == "1" for tok in t.output_ids]
        assert b.responses[row][b.loss_mask[row] == 1].tolist() == fresh


@pytest.mark.parametrize("stale", ["drop", "rerun"])
async def test_staleness_bound_holds(make_stack: StackFactory, stale: str) -> None:
    stack = await make_stack()
    data = [instance("ancient", rewards=INFORMATIVE, turns=3, turn_sleep=0.7)] + [
        instance(f"f{k}", rewards=INFORMATIVE) for k in range(6)
    ]
    async with RolloutClient(stack.urls) as client:
        await client.set_weight_version("0")
        sampler = DynamicSampler(
            client,
            data,
            2,
            target_groups=2,
            max_inflight_groups=3,
            carry_over=True,
            max_staleness=1,
            stale=stale,
        )
        accepted: list[Any] = []
        all_stats = []
        for _ in range(5):
            batch, stats = await sampler.next_step()
            all_stats.append(stats)
            accepted += batch
            assert sampler.in_flight + len(sampler._ready) <= sampler.admission_limit
            for g in batch:
                assert sampler.policy_version - g.oldest_version() <= 1
            if stats.exhausted:
                break
            await sampler.update_weights()
    assert all(max(s.staleness, default=0) <= 1 for s in all_stats)
    ancient_accepted = [g for g in accepted if g.instance["instance_id"] == "ancient"]
    if stale == "drop":
        assert sum(s.stale_dropped_groups for s in all_stats) == 1 and ancient_accepted == []
    else:
        assert sum(s.stale_rerun_groups for s in all_stats) == 1
        assert len(ancient_accepted) == 1 and ancient_accepted[0].submit_version >= 2


async def test_admission_rule_bounds_in_flight_plus_accepted(make_stack: StackFactory) -> None:
    stack = await make_stack()
    data = (instance(f"a{k}", rewards=INFORMATIVE, run_sleep=0.05) for k in itertools.count())
    async with RolloutClient(stack.urls) as client:
        sampler = DynamicSampler(
            client, data, 2, target_groups=3, max_inflight_groups=50, carry_over=True, max_staleness=0
        )
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, client.in_flight_groups)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            for _ in range(3):
                batch, _ = await sampler.next_step()
                assert len(batch) == 3
                await sampler.update_weights()
        finally:
            watcher.cancel()
        assert 0 < peak <= sampler.admission_limit == 3
        await sampler.close()
        # without carry-over nothing outlives its step: only the in-flight cap limits admission
        free = DynamicSampler(client, data, 2, target_groups=3, max_inflight_groups=5, max_staleness=0)
        assert free.admission_limit == 8
