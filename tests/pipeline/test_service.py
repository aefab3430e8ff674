"""The rollout service with a real ledger, a real sandbox manager and the scripted test-double handler."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest

from raas.core.jobs import JobRequest
from raas.errors import RaasError
from raas.pipeline.admission import NotAccepting, Overloaded
from raas.sandbox import procs
from tests.conftest import unavailable
from tests.pipeline.conftest import ServiceFactory, reach, script, submit

pytestmark = pytest.mark.integration

STAGES = ("init", "run", "eval")


async def test_completes_with_reward_timing_and_ledger_trail(make_service: ServiceFactory) -> None:
    svc = await make_service()
    job_id = await submit(
        svc, script(eval={"reward": 0.5, "resolved": False}, instance_id="i-1", trajectory_id="t-9")
    )
    result = await svc.wait(job_id, 30)
    assert result is not None
    assert (result.status, result.reward, result.resolved, result.filter) == ("completed", 0.5, False, False)
    assert (result.instance_id, result.trajectory_id, result.error) == ("i-1", "t-9", None)
    assert result.token_trajectory.response_ids == [7, 8]
    assert result.artifacts["patch"].startswith("diff") and result.artifacts["finish_reason"] == "finish_tool"
    t = result.timing
    assert t.total_s >= t.queue_s + t.init_s + t.run_s + t.eval_s - 1e-6
    trail = [s for s, _, _ in await svc.ledger.transitions(job_id)]
    # "checkpoint": RUN's output committed before EVAL (a restart would resume the job there)
    assert trail == ["queued", "init", "queued_run", "run", "checkpoint", "queued_eval", "eval", "completed"]
    row = await svc.ledger.get(job_id)
    assert row is not None and row.status == "completed" and row.result is not None
    assert row.result["reward"] == 0.5


async def test_job_id_is_idempotent(make_service: ServiceFactory) -> None:
    svc = await make_service(init_workers=1)
    first = await svc.submit(JobRequest(instance=script(init={"sleep": 30}), job_id="same-1"))
    again = await svc.submit(JobRequest(instance=script(), job_id="same-1"))
    assert first.created and not again.created and again.job_id == "same-1"
    await svc.cancel("same-1")
    done = await svc.submit(JobRequest(instance=script(), job_id="same-1"))
    assert not done.created and done.status == "cancelled"
    assert (await svc.ledger.counts()) == {"cancelled": 1}


@pytest.mark.parametrize("stage", STAGES)
async def test_cancel_inside_each_stage(
    make_service: ServiceFactory, script_handler: type, stage: str
) -> None:
    svc = await make_service()
    job_id = await submit(svc, script(**{stage: {"sleep": 60}}))
    await reach(svc, job_id, stage)
    info = await svc.cancel(job_id)
    assert info.status == "cancelled"
    result = await svc.result(job_id)
    assert result is not None and result.status == "cancelled" and result.reward is None and result.filter
    assert result.error is not None and (result.error.stage, result.error.kind) == (stage, "cancelled")
    assert (job_id, stage, "RaasError") in script_handler.hook_calls  # type: ignore[attr-defined]
    assert (await svc.cancel(job_id)).status == "cancelled"  # idempotent


async def test_cancel_while_queued(make_service: ServiceFactory) -> None:
    svc = await make_service(init_workers=1)
    blocker = await submit(svc, script(init={"sleep": 60}))
    await reach(svc, blocker, "init")
    waiting = await submit(svc, script())
    assert (await svc.get(waiting)).status == "queued"
    await svc.cancel(waiting)
    result = await svc.result(waiting)
    assert result is not None and result.status == "cancelled"
    assert result.error is not None and result.error.stage == "queue"
    await svc.cancel(blocker)


@pytest.mark.parametrize("stage", STAGES)
async def test_timeout_inside_each_stage(
    make_service: ServiceFactory, script_handler: type, stage: str
) -> None:
    svc = await make_service()
    job_id = await submit(svc, script(**{stage: {"sleep": 60}}), timeout_s=0.3)
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "timeout" and result.reward is None and result.filter
    assert result.error is not None and (result.error.stage, result.error.kind) == (stage, "timeout")
    t = result.timing
    assert t.init_s + t.run_s + t.eval_s >= 0.3  # the whole budget was used inside stages
    assert (job_id, stage, "RaasError") in script_handler.hook_calls  # type: ignore[attr-defined]


async def test_queue_wait_does_not_count_against_the_budget(make_service: ServiceFactory) -> None:
    svc = await make_service(init_workers=1)
    blocker = await submit(svc, script(init={"sleep": 0.8}))
    await reach(svc, blocker, "init")
    patient = await submit(svc, script(), timeout_s=0.4)
    result = await svc.wait(patient, 30)
    assert result is not None and result.status == "completed"
    assert result.timing.queue_s > 0.4  # it waited longer than its whole budget, and that was fine
    assert (await svc.wait(blocker, 30)).status == "completed"  # type: ignore[union-attr]


async def test_per_stage_ceiling(make_service: ServiceFactory) -> None:
    svc = await make_service(stage_timeouts={"eval": 0.3})
    job_id = await submit(svc, script(eval={"sleep": 60}), timeout_s=600)
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "timeout"
    assert result.error is not None and result.error.stage == "eval" and "stage limit" in result.error.message


@pytest.mark.parametrize("stage", STAGES)
async def test_handler_exception_in_each_stage(
    make_service: ServiceFactory, script_handler: type, stage: str
) -> None:
    svc = await make_service()
    job_id = await submit(svc, script(**{stage: {"raise": "boom"}}))
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "failed" and result.reward is None and result.filter
    assert result.error is not None and (result.error.stage, result.error.kind) == (stage, "handler_error")
    assert "boom" in result.error.message and "RuntimeError" in result.artifacts["traceback"]
    assert (job_id, stage, "RuntimeError") in script_handler.hook_calls  # type: ignore[attr-defined]


async def test_typed_handler_errors_keep_their_kind(make_service: ServiceFactory) -> None:
    svc = await make_service()
    job_id = await submit(svc, script(run={"raise": "ctx", "kind": "context_window_exceeded"}))
    result = await svc.wait(job_id, 30)
    assert result is not None and result.error is not None
    assert (result.status, result.error.kind, result.filter) == ("failed", "context_window_exceeded", True)


async def test_missing_reward_is_never_fabricated(make_service: ServiceFactory) -> None:
    svc = await make_service()
    job_id = await submit(svc, script(eval={"reward": None}))
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "failed" and result.reward is None and result.filter
    assert result.messages  # the trajectory is still reported, just not trainable


async def test_unknown_data_source_and_bad_instance_are_rejected(make_service: ServiceFactory) -> None:
    svc = await make_service()
    with pytest.raises(RaasError) as e:
        await svc.submit(JobRequest(instance={"data_source": "no-such-task"}))
    assert e.value.kind == "bad_request" and "no-such-task" in e.value.message
    with pytest.raises(RaasError) as e:
        await svc.submit(JobRequest(instance=script(run="not a dict")))
    assert e.value.kind == "bad_request"
    with pytest.raises(RaasError) as e:
        await svc.get("never-submitted")
    assert e.value.kind == "not_found"
    assert await svc.ledger.counts() == {}


async def test_backpressure(make_service: ServiceFactory) -> None:
    svc = await make_service(max_pending=2, init_workers=1, retry_after_s=3)
    a = await submit(svc, script(init={"sleep": 60}))
    b = await submit(svc, script())
    with pytest.raises(Overloaded) as e:
        await submit(svc, script())
    assert e.value.retry_after_s == 3
    with pytest.raises(Overloaded):
        await svc.submit_many([JobRequest(instance=script())])
    assert not (await svc.submit(JobRequest(instance=script(), job_id=b))).created  # known ids still answer
    await svc.cancel(a)
    await svc.wait(b, 30)
    assert (await svc.submit(JobRequest(instance=script()))).created


async def test_batch_is_all_or_nothing(make_service: ServiceFactory) -> None:
    svc = await make_service()
    with pytest.raises(RaasError) as e:
        await svc.submit_many([JobRequest(instance=script()), JobRequest(instance={"data_source": "nope"})])
    assert "jobs[1]" in e.value.message
    assert await svc.ledger.counts() == {}
    accepted = await svc.submit_many([JobRequest(instance=script()) for _ in range(20)])
    results = [await svc.wait(a.job_id, 30) for a in accepted]
    assert all(r is not None and r.status == "completed" for r in results)


async def test_priority_orders_each_queue(make_service: ServiceFactory) -> None:
    svc = await make_service(init_workers=1)
    blocker = await submit(svc, script(init={"sleep": 60}))
    await reach(svc, blocker, "init")
    order: list[str] = []
    async with svc.events() as sub:
        low = await submit(svc, script(), priority=-5)
        mid = await submit(svc, script())
        high = await submit(svc, script(), priority=5)
        await svc.cancel(blocker)  # frees the only INIT worker once all three wait
        async for event in sub:
            if event.status == "init" and event.job_id in (low, mid, high):
                order.append(event.job_id)
                if len(order) == 3:
                    break
    assert order == [high, mid, low]


async def test_events_stream_every_transition(make_service: ServiceFactory) -> None:
    svc = await make_service()
    async with svc.events() as sub:
        job_id = await submit(svc, script())
        seen = []
        async for event in sub:
            if event.job_id == job_id:
                seen.append(event.status)
                if event.status == "completed":
                    assert event.reward == 1.0 and event.filter is False
                    break
    assert seen == ["queued", "init", "queued_run", "run", "queued_eval", "eval", "completed"]


def sandbox_for(backend: str, request: pytest.FixtureRequest) -> dict[str, object]:
    """The default SandboxConfig for ``backend``; bwrap runs the shared test image (tests/conftest.py)."""
    if backend == "local":
        return {"backend": "local"}
    reason = request.getfixturevalue("backend_available")[backend]
    if reason:
        unavailable(reason)
    return {"backend": backend, "image": str(request.getfixturevalue("test_image"))}


@pytest.mark.parametrize("backend", ["local", "bwrap"])
async def test_run_sandbox_is_closed_before_eval(
    make_service: ServiceFactory, backend: str, request: pytest.FixtureRequest
) -> None:
    # Without warm pools: the test counts sandbox starts (pools start more, ahead of demand).
    svc = await make_service(sandbox=sandbox_for(backend, request), warm_pool={"enabled": False})
    job_id = await submit(svc, script(init={"sandbox": True}, run={"bash": "echo hi"}, eval={"sleep": 60}))
    await reach(svc, job_id, "eval")
    manager = svc.sandbox_manager
    assert len(manager.started_ids) == 1  # type: ignore[union-attr]
    assert manager.list(owner=job_id) == []
    assert procs.pids_with_env(manager.started_ids[0]) == []  # type: ignore[union-attr]
    await svc.cancel(job_id)


async def test_eval_sandbox_and_cancel_release_everything(make_service: ServiceFactory) -> None:
    svc = await make_service(warm_pool={"enabled": False})  # every sandbox started is the job's
    job_id = await submit(svc, script(init={"sandbox": True}, eval={"sandbox": True, "bash": "sleep 60"}))
    await reach(svc, job_id, "eval")
    manager = svc.sandbox_manager
    for _ in range(2):  # the INIT sandbox, then the EVAL sandbox
        await asyncio.wait_for(manager.opened.get(), 60)  # type: ignore[union-attr]
    assert len(manager.list(owner=job_id)) == 1
    await svc.cancel(job_id)
    assert manager.list(owner=job_id) == []
    assert all(procs.pids_with_env(s) == [] for s in manager.started_ids)  # type: ignore[union-attr]


@pytest.mark.parametrize("backend", ["local", "bwrap"])
async def test_sandbox_killed_mid_run(
    make_service: ServiceFactory, backend: str, request: pytest.FixtureRequest
) -> None:
    svc = await make_service(sandbox=sandbox_for(backend, request))
    job_id = await submit(svc, script(init={"sandbox": True}, run={"bash": "sleep 60"}))
    await reach(svc, job_id, "run")
    manager = svc.sandbox_manager
    (sandbox,) = manager.list(owner=job_id)
    for pid in procs.pids_with_env(sandbox.id):
        with contextlib.suppress(ProcessLookupError):  # killing bwrap takes its whole PID namespace along
            os.kill(pid, signal.SIGKILL)
    result = await svc.wait(job_id, 60)
    assert result is not None and result.status == "failed" and result.filter and result.reward is None
    assert result.error is not None and result.error.stage == "run"
    assert result.error.kind in ("sandbox_dead", "tool_error", "tool_unavailable"), result.error


async def test_graceful_shutdown(make_service: ServiceFactory, tmp_path: object) -> None:
    svc = await make_service(state_dir=tmp_path / "gs")  # type: ignore[operator]
    quick = await submit(svc, script(run={"sleep": 0.3}))
    stuck = await submit(svc, script(run={"sleep": 60}), resume_on_restart=False)
    retry = await submit(svc, script(run={"sleep": 60}), retry_on_restart=True)
    replay = await submit(svc, script(run={"sleep": 60}))  # inside RUN: left to replay its turns
    await reach(svc, quick, "run")
    await reach(svc, retry, "run")
    await reach(svc, replay, "run")
    await svc.shutdown(grace_s=1.5)
    with pytest.raises(NotAccepting):
        await svc.submit(JobRequest(instance=script()))
    again = await make_service(state_dir=tmp_path / "gs")  # type: ignore[operator]
    assert (await again.result(quick)).status == "completed"  # type: ignore[union-attr]
    interrupted = await again.result(stuck)
    assert interrupted is not None and interrupted.status == "failed" and interrupted.reward is None
    assert interrupted.error is not None and interrupted.error.kind == "interrupted"
    info = await again.get(retry)
    assert info.attempts == 2
    await again.cancel(retry)  # it was re-queued and is running again: stop it
    assert (await again.result(retry)).status == "cancelled"  # type: ignore[union-attr]
    info = await again.get(replay)
    assert info.attempts == 2 and info.status in ("queued", "init", "queued_run", "run")
    await again.cancel(replay)


@pytest.mark.parametrize("name", ["max_turns", "max_iterations"])
async def test_agent_overrides_in_sampling_params_are_validated(
    make_service: ServiceFactory, name: str
) -> None:
    svc = await make_service()
    job_id = await submit(svc, script(), sampling_params={name: 0, "temperature": 0.7})
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "failed"
    assert result.error is not None and (result.error.stage, result.error.kind) == ("run", "bad_request")


async def test_llm_pause_does_not_count_against_run_budget(make_service: ServiceFactory) -> None:
    from raas.llm import LLMBalancer

    balancer = LLMBalancer(health_interval_s=0)
    svc = await make_service()
    svc.layers.balancer = balancer  # a real balancer with no servers: pausing only holds new requests
    try:
        job_id = await submit(svc, script(run={"sleep": 0.6}), timeout_s=0.5)
        await reach(svc, job_id, "run")
        await svc.pause_llm()
        assert svc.status()["llm_paused"] is True
        await asyncio.sleep(0.4)  # a weight sync
        await svc.resume_llm()
        result = await svc.wait(job_id, 30)
        assert result is not None and result.status == "completed", result.error
        assert (
            result.timing.run_s >= 0.6
        )  # wall time in RUN exceeded the budget; the paused part did not count
        job_id = await submit(svc, script(run={"sleep": 60}), timeout_s=0.3)  # without a pause: times out
        assert (await svc.wait(job_id, 30)).status == "timeout"  # type: ignore[union-attr]
    finally:
        await balancer.aclose()


async def test_results_are_served_from_the_ledger_when_not_cached(make_service: ServiceFactory) -> None:
    svc = await make_service(result_cache_size=0)
    job_id = await submit(svc, script(eval={"reward": 0.75}))
    waited = await svc.wait(job_id, 30)
    again = await svc.result(job_id)  # no in-memory copy any more: read back from SQLite
    assert waited is not None and again == waited and again.reward == 0.75
    assert (await svc.wait(job_id, 0)) == waited
