"""The trainer client against a real service on a real port (uvicorn), with the stage-scripted test handler
so each API behaviour can be provoked on purpose."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tests.doubles.scripted_llm import ScriptedLLM, fixed

from raas.cli.inprocess import service_in_process
from raas.errors import RaasError
from raas.pipeline.config import ServiceConfig
from raas.trainer.client import RaasClient

pytestmark = pytest.mark.integration


def script(job_sleep: float = 0.0, **eval_: Any) -> dict[str, Any]:
    return {"data_source": "test.script", "run": {"sleep": job_sleep}, "eval": eval_ or {"reward": 1.0}}


@pytest.fixture
async def service(tmp_path: Path) -> AsyncIterator[tuple[str, ScriptedLLM]]:
    async with ScriptedLLM(fixed(3)) as llm:
        config = ServiceConfig(
            state_dir=tmp_path / "svc",
            sandbox={"backend": "local"},
            llm_servers=[llm.url],
            extra_handlers={"test.script": "tests.doubles.handlers:StageScriptHandler"},
            init_workers=2,
            run_workers=2,
            eval_workers=2,
            shutdown_grace_s=0.0,
        )
        async with service_in_process(config) as url:
            yield url, llm


async def test_submit_wait_and_idempotency(service: tuple[str, ScriptedLLM]) -> None:
    url, _ = service
    async with RaasClient(url) as c:
        acc = await c.submit(script(), job_id="j-1")
        assert acc["job_id"] == "j-1" and acc["created"] is True
        again = await c.submit(script(), job_id="j-1")
        assert again["created"] is False
        res = await c.wait("j-1", timeout_s=60)
        assert res["status"] == "completed" and res["reward"] == 1.0 and res["filter"] is False
        assert (await c.get("j-1"))["status"] == "completed"
        assert await c.result("j-1") == res


async def test_batch_events_and_results(service: tuple[str, ScriptedLLM]) -> None:
    url, _ = service
    async with RaasClient(url) as c:
        seen: dict[str, list[str]] = {}

        async def follow() -> None:
            async for ev in c.events():
                seen.setdefault(ev["job_id"], []).append(ev["status"])
                if sum(1 for v in seen.values() if v[-1] in ("completed", "failed")) == 3:
                    return

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.2)
        jobs = [{"instance": script(), "job_id": f"b-{i}"} for i in range(2)]
        jobs.append(
            {
                "instance": {"data_source": "test.script", "run": {"raise": "boom", "kind": "sandbox_dead"}},
                "job_id": "b-bad",
            }
        )
        accepted = await c.submit_batch(jobs)
        assert [a["job_id"] for a in accepted] == ["b-0", "b-1", "b-bad"]
        await asyncio.wait_for(follower, 60)
        results = {j["job_id"]: await c.wait(j["job_id"], timeout_s=30) for j in jobs}
    assert seen["b-0"][-1] == "completed" and "run" in seen["b-0"]
    bad = results["b-bad"]
    assert bad["status"] == "failed" and bad["reward"] is None and bad["filter"] is True
    assert bad["error"]["kind"] == "sandbox_dead" and bad["error"]["stage"] == "run"


async def test_cancel_and_long_poll_timeout(service: tuple[str, ScriptedLLM]) -> None:
    url, _ = service
    async with RaasClient(url) as c:
        await c.submit(script(job_sleep=30), job_id="slow")
        assert await c.result("slow", wait_s=0.3) is None
        with pytest.raises(RaasError) as e:
            await c.wait("slow", timeout_s=0.5, poll_s=0.2)
        assert e.value.kind == "timeout"
        await c.cancel("slow")
        res = await c.wait("slow", timeout_s=30)
        assert res["status"] == "cancelled" and res["filter"] is True and res["reward"] is None


async def test_typed_errors(service: tuple[str, ScriptedLLM]) -> None:
    url, _ = service
    async with RaasClient(url) as c:
        with pytest.raises(RaasError) as e:
            await c.get("does-not-exist")
        assert e.value.kind == "not_found"
        with pytest.raises(RaasError) as e:
            await c.submit({"data_source": "no-such-task"})
        assert e.value.kind == "bad_request" and "no-such-task" in e.value.message
        with pytest.raises(RaasError) as e:
            await c.submit({"problem": "no data source"})
        assert e.value.kind == "bad_request"
        with pytest.raises(RaasError) as e:  # the math handler checks its instances at submit time
            await c.submit({"data_source": "math", "problem": ""})
        assert e.value.kind == "bad_request" and "problem" in e.value.message
    async with RaasClient("http://127.0.0.1:9") as dead:
        with pytest.raises(RaasError) as e:
            await dead.health()
        assert e.value.kind == "unavailable"


async def test_llm_server_management(service: tuple[str, ScriptedLLM]) -> None:
    url, llm = service
    async with RaasClient(url) as c:
        servers = (await c.servers())["servers"]
        assert [s["address"] for s in servers] == [llm.url]
        await c.add_server("http://127.0.0.1:9/v1", weight_version="w2")
        addrs = {s["address"] for s in (await c.servers())["servers"]}
        assert len(addrs) == 2
        await c.remove_server(next(a for a in addrs if a != llm.url))
        assert [s["address"] for s in (await c.servers())["servers"]] == [llm.url]
        await c.pause()
        await c.resume()
        st = await c.status()
        assert isinstance(st, dict) and st
        assert (await c.health()) is not None


async def test_full_service_is_retried_after_retry_after(tmp_path: Path) -> None:
    async with ScriptedLLM(fixed(3)) as llm:
        config = ServiceConfig(
            state_dir=tmp_path / "svc",
            sandbox={"backend": "local"},
            llm_servers=[llm.url],
            extra_handlers={"test.script": "tests.doubles.handlers:StageScriptHandler"},
            max_pending=1,
            retry_after_s=0.2,
            shutdown_grace_s=0.0,
        )
        async with service_in_process(config) as url:
            async with RaasClient(url, max_retries_429=0) as impatient, RaasClient(url) as patient:
                await patient.submit(script(job_sleep=1.0), job_id="first")
                with pytest.raises(RaasError) as e:
                    await impatient.submit(script(), job_id="second")
                assert e.value.kind == "overloaded"
                # The patient client waits out the 429s and gets in once the first job is done.
                await patient.submit(script(), job_id="second")
                assert (await patient.wait("first", timeout_s=30))["status"] == "completed"
                assert (await patient.wait("second", timeout_s=30))["status"] == "completed"


async def test_drive_reports_unfetchable_results_as_filtered_failures(
    service: tuple[str, ScriptedLLM],
) -> None:
    """The ``raas run`` driver: a result the client cannot fetch is a typed, filtered failure, not a crash."""
    from raas.cli.run import RunProgress, drive

    url, _ = service

    class Forgetful(RaasClient):
        async def wait(self, job_id: str, timeout_s: float | None = None, poll_s: float = 30.0) -> dict:
            if job_id == "d-1":
                raise RaasError("gone", kind="not_found")
            return await super().wait(job_id, timeout_s, poll_s)

    async with Forgetful(url) as c:
        jobs = [{"instance": script(), "job_id": f"d-{i}"} for i in range(3)]
        results = await drive(c, jobs, RunProgress(len(jobs)))
    assert [r["status"] for r in results] == ["completed", "failed", "completed"]
    assert results[1]["filter"] is True and results[1]["reward"] is None
    assert results[1]["error"] == {"stage": "client", "kind": "not_found", "message": "gone"}
