"""Per-handler stage policy (timeouts and pool shares per data_source), the per-service handler registry,
and the tokenizer check at submit: a real service, ledger and sandbox manager with scripted handlers."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest

from raas.core.jobs import JobRequest
from raas.core.policy import StagePolicy, StageShares, StageTimeouts
from raas.core.trajectory import EvalOutput
from raas.errors import RaasError
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from raas.tasks.base import Env, Job
from tests.doubles.handlers import StageScriptHandler
from tests.pipeline.conftest import RecordingSandboxManager, ServiceFactory, reach, script, submit

pytestmark = pytest.mark.integration


class CappedScript(StageScriptHandler):
    """A slow task that may hold at most half of the EVAL pool."""

    name: ClassVar[str] = "test.capped"
    policy: ClassVar[StagePolicy] = StagePolicy(max_share=StageShares(eval=0.5))


class QuickEvalLimit(StageScriptHandler):
    """A task whose EVAL has a 0.3 s ceiling of its own."""

    name: ClassVar[str] = "test.quick-eval"
    policy: ClassVar[StagePolicy] = StagePolicy(stage_timeouts=StageTimeouts(eval=0.3))


class RewardOne(StageScriptHandler):
    name: ClassVar[str] = "test.two"

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        return EvalOutput(reward=1.0)


class RewardQuarter(StageScriptHandler):
    name: ClassVar[str] = "test.two"

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        return EvalOutput(reward=0.25)


class NeedsTokenizer(StageScriptHandler):
    name: ClassVar[str] = "test.needs-tokenizer"
    needs_tokenizer: ClassVar[bool] = True


def as_source(source: str, **stages: Any) -> dict[str, Any]:
    return {**script(**stages), "data_source": source}


# -- pool shares -------------------------------------------------------------------------------------------


async def test_a_capped_slow_handler_leaves_the_eval_pool_to_others(make_service: ServiceFactory) -> None:
    """eval_workers=2, a slow handler capped at share 0.5: one of its jobs evaluates, the others wait
    without blocking the fast handler's jobs queued behind them."""
    svc = await make_service(eval_workers=2)
    svc.handlers.register(CappedScript)
    slow = [await submit(svc, as_source("test.capped", eval={"sleep": 3600})) for _ in range(3)]
    await _settle_in_eval(svc, slow)
    assert svc.stage_snapshot()["eval"]["active"] == 1
    fast = [await submit(svc, script()) for _ in range(4)]  # queued after every slow job
    for job_id in fast:
        result = await svc.wait(job_id, 60)
        assert result is not None and result.status == "completed", result
    assert sorted([(await svc.get(j)).status for j in slow]) == ["eval", "queued_eval", "queued_eval"]
    for job_id in slow:
        await svc.cancel(job_id)
    assert {(await svc.wait(j, 30)).status for j in slow} == {"cancelled"}  # type: ignore[union-attr]


async def test_without_a_share_the_slow_jobs_take_every_worker(make_service: ServiceFactory) -> None:
    """The control: the same handler with its cap lifted by the service config fills both EVAL workers,
    and a fast job waits behind it until they are cancelled."""
    svc = await make_service(eval_workers=2, handler_policies={"test.capped": {"max_share": {"eval": 1.0}}})
    svc.handlers.register(CappedScript)
    slow = [await submit(svc, as_source("test.capped", eval={"sleep": 3600})) for _ in range(2)]
    for job_id in slow:
        await reach(svc, job_id, "eval")
    fast = await submit(svc, script())
    await reach(svc, fast, "queued_eval")
    assert svc.stage_snapshot()["eval"]["active"] == 2
    assert (await svc.get(fast)).status == "queued_eval"  # both workers are held for an hour
    for job_id in slow:
        await svc.cancel(job_id)
    result = await svc.wait(fast, 60)
    assert result is not None and result.status == "completed"


async def test_the_config_can_cap_a_handler_that_declares_no_share(make_service: ServiceFactory) -> None:
    svc = await make_service(eval_workers=3, handler_policies={"test.script": {"max_share": {"eval": 0.34}}})
    jobs = [await submit(svc, script(eval={"sleep": 3600})) for _ in range(2)]
    await _settle_in_eval(svc, jobs)
    assert svc.stage_snapshot()["eval"]["active"] == 1  # floor(0.34 * 3) = 1 of 3 workers
    for job_id in jobs:
        await svc.cancel(job_id)


async def _settle_in_eval(svc: RolloutService, jobs: list[str]) -> None:
    """Wait (event-driven) until every job is queued for EVAL or inside it, and one is inside. Each job
    was offered to the pool in the same step that queued it, so the pool's count is final by then."""

    async def watch() -> None:
        async with svc.events() as sub:
            while True:
                statuses = [(await svc.get(j)).status for j in jobs]
                if set(statuses) <= {"queued_eval", "eval"} and "eval" in statuses:
                    return
                assert await sub.get() is not None, "the event bus closed"

    await asyncio.wait_for(watch(), 30)


# -- stage timeouts per handler ----------------------------------------------------------------------------


async def test_a_handler_stage_timeout_applies_to_its_jobs_only(make_service: ServiceFactory) -> None:
    svc = await make_service()
    svc.handlers.register(QuickEvalLimit)
    limited = await submit(svc, as_source("test.quick-eval", eval={"sleep": 60}))
    other = await submit(svc, script(eval={"sleep": 0.6}))
    result = await svc.wait(limited, 30)
    assert result is not None and result.status == "timeout"
    assert result.error is not None and result.error.message == "eval exceeded its stage limit of 0.3s"
    result = await svc.wait(other, 30)
    assert result is not None and result.status == "completed"


async def test_the_config_overrides_a_handler_stage_timeout(make_service: ServiceFactory) -> None:
    svc = await make_service(handler_policies={"test.quick-eval": {"stage_timeouts": {"eval": 30}}})
    svc.handlers.register(QuickEvalLimit)
    job_id = await submit(svc, as_source("test.quick-eval", eval={"sleep": 0.6}))
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "completed"


def test_policy_merging_and_limits() -> None:
    base = StagePolicy(stage_timeouts=StageTimeouts(eval=600, run=60), max_share=StageShares(eval=0.5))
    merged = base.overridden_by(StagePolicy.model_validate({"stage_timeouts": {"eval": 30, "run": None}}))
    assert merged.stage_timeouts == StageTimeouts(eval=30, run=None) and merged.max_share.eval == 0.5
    filled = merged.with_default_timeouts(StageTimeouts(init=5, run=7, eval=9))
    assert filled.stage_timeouts == StageTimeouts(init=5, run=7, eval=30)
    assert [StageShares(eval=s).limit("eval", 4) for s in (0.1, 0.25, 0.5, 0.74, 1.0)] == [1, 1, 2, 2, 4]
    assert StageShares().limit("run", 8) == 8
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValueError):
            StageShares(eval=bad)
    with pytest.raises(RaasError):
        ServiceConfig.load(None, handler_policies={"math": {"max_share": {"eval": 2}}})


# -- per-service registry ----------------------------------------------------------------------------------


async def test_two_services_keep_their_own_handlers(tmp_path: Any) -> None:
    """Two services in one process register different handlers under the same data_source; each runs
    its own, and a third that registered nothing does not know the name."""
    made = []
    try:
        for i, target in enumerate(("RewardOne", "RewardQuarter", None)):
            extra = {"test.two": f"tests.pipeline.test_policy:{target}"} if target else {}
            cfg = ServiceConfig(state_dir=tmp_path / f"s{i}", shutdown_grace_s=0.0, extra_handlers=extra)
            manager = RecordingSandboxManager(tmp_path / f"s{i}" / "sandboxes")
            svc = RolloutService(cfg, sandbox_manager=manager)
            await svc.start()
            made.append((svc, manager))
        (one, _), (quarter, _), (bare, _) = made
        rewards = []
        for svc in (one, quarter):
            job_id = await submit(svc, as_source("test.two"))
            result = await svc.wait(job_id, 30)
            assert result is not None and result.status == "completed"
            rewards.append(result.reward)
        assert rewards == [1.0, 0.25]
        with pytest.raises(RaasError) as e:
            await submit(bare, as_source("test.two"))
        assert e.value.kind == "bad_request" and "unknown data_source 'test.two'" in e.value.message
    finally:
        for svc, manager in made:
            await svc.shutdown(0)
            await manager.close_all()


# -- tokenizer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["math", "test.needs-tokenizer"])
async def test_a_handler_that_needs_a_tokenizer_is_refused_at_submit(
    make_service: ServiceFactory, source: str
) -> None:
    svc = await make_service()
    svc.handlers.register(NeedsTokenizer)
    instance = {"data_source": source, "problem": "1+1?", "answer": "2"}
    with pytest.raises(RaasError) as e:
        await svc.submit(JobRequest(instance=instance))
    assert e.value.kind == "bad_request"
    assert f"data_source {source!r}" in e.value.message and "needs a chat tokenizer" in e.value.message
    assert "--tokenizer DIR" in e.value.message
    with pytest.raises(RaasError):  # the whole batch, too
        await svc.submit_many([JobRequest(instance=script()), JobRequest(instance=instance)])
    assert await svc.ledger.counts() == {}
