"""RolloutClient against real services (in-process, real ports, real SSE) and the scripted policy."""

from __future__ import annotations

import asyncio

import pytest

from raas.errors import RaasError
from raas.trainer.client import RaasClient
from raas.trainer.grpo import assemble_batch
from raas.trainer.rollout import FailurePolicy, RolloutClient
from raas.trainer.sync import SyncRolloutClient
from raas.trainer.types import JobResult
from tests.trainer.conftest import StackFactory, instance
from tests.trainer.tcp_proxy import CuttableProxy

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("consume", ["sse", "poll"])
async def test_groups_complete_with_typed_results(make_stack: StackFactory, consume: str) -> None:
    stack = await make_stack(services=2)
    async with RolloutClient(stack.urls, consume=consume) as client:  # type: ignore[arg-type]
        groups = [
            client.new_group(instance(f"i{k}", turns=2, rewards=[1, 0, 0, 1]), 4, sampling_params={"seed": k})
            for k in range(3)
        ]
        await client.submit_groups(groups)
        # least-outstanding: 12 jobs over two services, 6 each
        assert sorted(s["outstanding"] for s in client.services) == [6, 6]
        done = [await client.next_group(timeout=60) for _ in groups]
    assert {g.group_id for g in done} == {g.group_id for g in groups}
    for g in done:
        assert not g.dropped and sorted(g.results) == [0, 1, 2, 3]
        for i, r in g.results.items():
            assert isinstance(r, JobResult) and r.trajectory_id == str(i) and r.status == "completed"
            assert len(r.turns) == 2 and r.filter is False
        assert g.rewards == [1.0, 0.0, 0.0, 1.0] and g.informative
    assert client.stats.usable == 12 and client.stats.filtered == 0


async def test_failure_policy_resubmits_bounded_and_keeps_failures_out(make_stack: StackFactory) -> None:
    stack = await make_stack()
    policy = FailurePolicy(max_resubmits=2, min_group_size=2)
    async with RolloutClient(stack.urls, policy=policy) as client:
        inst = instance("f", rewards=[1, 0, 0, 1], fail={"1": "sandbox_dead"}, fail_once=[2])
        g = await client.submit_group(inst, 4)
        done = await client.next_group(timeout=60)
    assert done is g and not g.dropped
    assert sorted(g.results) == [0, 2, 3]  # 2 came back on its second attempt, 1 never did
    assert [f.error.kind for f in g.failures] == ["sandbox_dead"]  # type: ignore[union-attr]
    assert g.failures[0].filter and g.failures[0].reward is None
    s = client.stats
    assert (s.filtered, s.resubmitted, s.dropped_samples) == (4, 3, 1)  # sample 1: 3 attempts; sample 2: 1
    batch = assemble_batch([g], 0, 4, 8)
    assert len(batch.job_ids) == 3 and all(not j.startswith(f"{g.group_id}.1.") for j in batch.job_ids)
    # the group baseline is over the three usable rewards (1, 0, 1): mean 2/3
    assert batch.advantages[:, 0].tolist() == pytest.approx([1 / 3, -2 / 3, 1 / 3])


async def test_small_groups_are_dropped_or_refilled(make_stack: StackFactory) -> None:
    stack = await make_stack()
    failing = {"0": "sandbox_dead", "1": "llm_unavailable", "2": "sandbox_dead"}
    async with RolloutClient(stack.urls, policy=FailurePolicy(resubmit=False, min_group_size=2)) as client:
        g = await client.submit_group(instance("d", fail=failing), 4)
        assert (await client.next_group(timeout=60)) is g
        assert g.dropped and list(g.results) == [3] and client.stats.dropped_groups == 1
        assert assemble_batch([g], 0, 4, 8).size == 0
    refill = FailurePolicy(resubmit=False, min_group_size=3, refill=True, max_refill_samples=2)
    async with RolloutClient(stack.urls, policy=refill) as client:
        g = await client.submit_group(instance("r", fail=failing), 4)
        assert (await client.next_group(timeout=60)) is g
        assert not g.dropped and sorted(g.results) == [3, 4, 5]  # two new samples, trajectory ids 4 and 5
        assert client.stats.refilled_samples == 2


async def test_cancel_stops_jobs_and_closes_their_sandboxes(make_stack: StackFactory) -> None:
    stack = await make_stack()
    async with RolloutClient(stack.urls) as client, RaasClient(stack.urls[0]) as raw:
        g = await client.submit_group(instance("slow", sandbox=True, run_sleep=120), 3)
        for _ in range(200):  # until every sample holds its sandbox
            if len(stack.managers[0].list()) == 3:
                break
            await asyncio.sleep(0.05)
        assert len(stack.managers[0].list()) == 3
        assert await client.cancel_groups([g]) == 3
        for i in range(3):
            assert (await raw.get(f"{g.group_id}.{i}.0"))["status"] == "cancelled"
        assert stack.managers[0].list() == []
        assert client.stats.cancelled == 3 and client.in_flight_groups == 0
        assert client.finished_nowait() == []  # a cancelled group is never handed out


async def test_results_survive_a_dropped_event_stream(make_stack: StackFactory) -> None:
    stack = await make_stack()
    async with CuttableProxy(stack.urls[0]) as proxy, RolloutClient(proxy.url) as client:
        groups = [client.new_group(instance(f"s{k}", run_sleep=0.6), 3) for k in range(4)]
        await client.submit_groups(groups)
        await asyncio.sleep(0.2)
        proxy.cut()  # the SSE stream dies; jobs finish while nobody listens
        await asyncio.sleep(1.0)
        proxy.reopen()
        done = [await client.next_group(timeout=60) for _ in groups]
        assert all(sorted(g.results) == [0, 1, 2] for g in done)
        assert client.stats.stream_reconnects >= 1 and client.stats.moved == 0


async def test_weight_sync_stamps_exactly_the_weights_that_sampled_each_turn(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(services=2)
    async with RolloutClient(stack.urls) as client:
        await client.set_weight_version("0")
        groups = [client.new_group(instance(f"w{k}", turns=8, turn_sleep=0.15), 2) for k in range(3)]
        await client.submit_groups(groups)
        for v in (1, 2):
            await asyncio.sleep(0.25)

            async def load(v: int = v) -> None:
                stack.weights.version = v  # the policy now samples with the new weights

            await client.weight_sync(str(v), load)
        done = [await client.next_group(timeout=60) for _ in groups]
    straddled = 0
    for g in done:
        for r in g.samples:
            stamped = [int(t.weight_version) for t in r.turns]  # type: ignore[arg-type]
            produced = [t.output_ids[0] // 1000 for t in r.turns]
            assert stamped == produced, (stamped, produced)
            assert stamped == sorted(stamped)
            straddled += len(set(stamped)) > 1
    # Trajectories of 8 turns really ran across the syncs (how many depends on the machine's speed).
    assert straddled > 0


async def test_submit_errors_are_typed_and_leave_nothing_behind(make_stack: StackFactory) -> None:
    stack = await make_stack()
    async with RolloutClient(stack.urls) as client:
        with pytest.raises(RaasError) as e:
            await client.submit_group({"data_source": "no.such.task"}, 2)
        assert e.value.kind == "bad_request"
        assert client.in_flight_groups == 0 and client.outstanding_jobs == 0
        with pytest.raises(RaasError):
            await client.submit_group(instance("x"), 0)
        with pytest.raises(RaasError):
            client.new_group(instance("x"), 2, group_id="bad id with spaces")
    with pytest.raises(RaasError) as e:
        await RolloutClient("http://127.0.0.1:9").start()
    assert e.value.kind == "unavailable"


async def test_sync_facade(make_stack: StackFactory) -> None:
    stack = await make_stack()

    def trainer() -> list[float]:
        with SyncRolloutClient(stack.urls) as client:
            with pytest.raises(TimeoutError):
                client.next_group(timeout=0.05)  # nothing submitted yet; the wait leaves no reader behind
            client.submit_group(instance("sync", rewards=[0, 1]), 2)
            g = client.next_group(timeout=60)
            client.weight_sync("5", sync=lambda: None)
            assert client.stats["usable"] == 2
            return g.rewards

    assert await asyncio.to_thread(trainer) == [0.0, 1.0]
