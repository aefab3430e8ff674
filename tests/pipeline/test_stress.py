"""A randomized storm of submits, idempotent resubmits, cancels, errors and timeouts: whatever the
interleaving, every job ends exactly once, with no reward unless it completed, and the ledger agrees."""

from __future__ import annotations

import asyncio
import random

import pytest

from raas.core.jobs import JobRequest
from raas.errors import RaasError
from tests.pipeline.conftest import ServiceFactory

pytestmark = pytest.mark.integration

N = 400


def _requests(rng: random.Random) -> list[JobRequest]:
    out = []
    for i in range(N):
        instance: dict[str, object] = {"data_source": "test.script"}
        for stage in ("init", "run", "eval"):
            r = rng.random()
            if r < 0.05:
                instance[stage] = {"raise": "boom"}
            elif r < 0.4:
                instance[stage] = {"sleep": rng.random() * 0.05}
            elif r < 0.43:
                instance[stage] = {"sleep": 0.3}
        kw: dict[str, object] = {}
        if rng.random() < 0.1:
            kw["timeout_s"] = 0.03
        if rng.random() < 0.3:
            kw["priority"] = rng.randint(-3, 3)
        out.append(JobRequest(instance=instance, job_id=f"j{i}", **kw))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("seed", [11])
async def test_storm_keeps_every_invariant(make_service: ServiceFactory, seed: int) -> None:
    rng = random.Random(seed)
    svc = await make_service(
        init_workers=3, run_workers=5, eval_workers=2, stage_timeouts={"eval": 0.2}, result_cache_size=8
    )
    requests = _requests(rng)

    async def cancel_some() -> None:
        for _ in range(100):
            await asyncio.sleep(rng.random() * 0.02)
            try:
                await svc.cancel(f"j{rng.randrange(N)}")
            except RaasError as exc:
                assert exc.kind == "not_found"  # not submitted yet

    async def submit_all() -> None:
        for i in range(0, N, 50):
            if rng.random() < 0.5:
                await svc.submit_many(requests[i : i + 50])
            else:
                await asyncio.gather(*(svc.submit(r) for r in requests[i : i + 50]))
            assert not (await svc.submit(requests[rng.randrange(i + 1)])).created
            await asyncio.sleep(0.01)

    await asyncio.gather(submit_all(), cancel_some())
    statuses: dict[str, int] = {}
    for i in range(N):
        result = await svc.wait(f"j{i}", 60)
        assert result is not None, f"j{i} did not finish"
        statuses[result.status] = statuses.get(result.status, 0) + 1
        assert (result.reward is not None) == (result.status == "completed")
        assert result.filter == (result.status != "completed")
        assert (result.error is None) == (result.status == "completed")
    assert svc.status()["pending"] == 0
    assert await svc.ledger.counts() == statuses
    assert set(statuses) <= {"completed", "failed", "timeout", "cancelled"} and len(statuses) == 4
