"""The EVAL prewarm hook: a handler's ``prewarm_eval`` runs alongside RUN, its sandbox outlives RUN's and
reaches EVAL, and it is closed on every path (success, failure, cancel, timeout)."""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import pytest

from raas.tasks.base import Env, EvalOutput, Job, JobSandboxes
from tests.doubles.handlers import StageScriptHandler
from tests.pipeline.conftest import ServiceFactory, reach, script, submit

pytestmark = pytest.mark.integration


class PrewarmScriptHandler(StageScriptHandler):
    """The scripted handler plus a prewarm scripted by ``instance["prewarm"]``: ``sleep`` first, then
    ``raise`` or open a sandbox and write a marker into it; EVAL scores 1 when it finds the marker in
    the sandbox it was handed."""

    name: ClassVar[str] = "test.prewarm"
    seen: ClassVar[dict[str, dict[str, Any]]] = {}

    async def prewarm_eval(self, job: Job, sandboxes: JobSandboxes) -> Any:
        script_ = job.instance.get("prewarm") or {}
        if script_.get("sleep"):
            await asyncio.sleep(float(script_["sleep"]))
        if "raise" in script_:
            raise RuntimeError(str(script_["raise"]))
        sandbox = await sandboxes.open()
        workspace = (await sandbox.tools.bash("pwd")).output.strip()  # private to this sandbox
        await sandbox.tools.write_file(f"{workspace}/prewarmed", job.job_id.encode())
        self.seen.setdefault(job.job_id, {})["marker"] = f"{workspace}/prewarmed"
        self.seen.setdefault(job.job_id, {})["prewarm_sandbox"] = sandbox.id
        return sandbox

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        seen = self.seen.setdefault(job.job_id, {})
        seen["prewarm_error"] = env.prewarm_error
        if env.prewarmed is None:
            seen["fresh"] = True
            return EvalOutput(reward=0.0, resolved=False)
        marker = await env.prewarmed.tools.read_file(seen["marker"])
        ok = marker == job.job_id.encode()
        return EvalOutput(reward=1.0 if ok else 0.0, resolved=ok)


@pytest.fixture
async def svc(make_service: ServiceFactory) -> Any:
    service = await make_service()
    service.handlers.register(PrewarmScriptHandler, replace=True)
    PrewarmScriptHandler.seen.clear()
    return service


def prewarm_job(**stages: Any) -> dict[str, Any]:
    return {**script(**stages), "data_source": "test.prewarm"}


async def test_the_prewarmed_sandbox_outlives_run_and_reaches_eval(svc: Any) -> None:
    job_id = await submit(svc, prewarm_job(init={"sandbox": True}, run={"sleep": 0.5}))
    result = await svc.wait(job_id, 60)
    assert result is not None and result.status == "completed", result
    assert result.reward == 1.0  # EVAL read the marker written during RUN
    manager = svc.sandbox_manager
    assert len(manager.started_ids) == 2  # the RUN sandbox and the prewarmed EVAL sandbox
    assert PrewarmScriptHandler.seen[job_id]["prewarm_sandbox"] in manager.started_ids
    assert result.timing.prewarm_s > 0.0
    assert manager.list(owner=job_id) == []


async def test_the_prewarm_runs_while_run_is_still_going(svc: Any) -> None:
    job_id = await submit(svc, prewarm_job(init={"sandbox": True}, run={"sleep": 60}))
    await reach(svc, job_id, "run")
    manager = svc.sandbox_manager
    opened = [await asyncio.wait_for(manager.opened.get(), 60) for _ in range(2)]  # INIT's, then prewarm's
    assert {s.id for s in manager.list(owner=job_id)} == set(opened)
    assert (await svc.get(job_id)).status == "run"
    await svc.cancel(job_id)
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "cancelled"
    assert manager.list(owner=job_id) == []  # the prewarmed sandbox was closed with the job


async def test_a_prewarm_still_starting_is_cancelled_when_run_fails(svc: Any) -> None:
    job_id = await submit(svc, prewarm_job(prewarm={"sleep": 60}, run={"raise": "boom"}))
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "failed" and result.error.stage == "run"
    assert svc.sandbox_manager.list(owner=job_id) == []
    assert "prewarm_sandbox" not in PrewarmScriptHandler.seen.get(job_id, {})


async def test_a_run_timeout_closes_the_prewarmed_sandbox(svc: Any) -> None:
    job_id = await submit(svc, prewarm_job(run={"sleep": 60}), timeout_s=2)
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "timeout"
    assert PrewarmScriptHandler.seen[job_id]["prewarm_sandbox"] in svc.sandbox_manager.started_ids
    assert svc.sandbox_manager.list(owner=job_id) == []


async def test_a_failed_prewarm_leaves_eval_to_set_up_on_its_own(svc: Any) -> None:
    job_id = await submit(svc, prewarm_job(prewarm={"raise": "image gone"}))
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "completed" and result.reward == 0.0
    seen = PrewarmScriptHandler.seen[job_id]
    assert seen["fresh"] and "image gone" in seen["prewarm_error"]


async def test_eval_waits_for_a_prewarm_that_is_not_ready(svc: Any) -> None:
    job_id = await submit(svc, prewarm_job(prewarm={"sleep": 1.5}))
    result = await svc.wait(job_id, 30)
    assert result is not None and result.reward == 1.0  # EVAL waited and got the prewarmed sandbox
    assert result.timing.prewarm_s >= 1.5


async def test_handlers_without_a_prewarm_get_none(svc: Any) -> None:
    assert not StageScriptHandler.prewarms_eval() and PrewarmScriptHandler.prewarms_eval()
    job_id = await submit(svc, script())
    result = await svc.wait(job_id, 30)
    assert result is not None and result.status == "completed" and result.timing.prewarm_s == 0.0
