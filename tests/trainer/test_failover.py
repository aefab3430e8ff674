"""Two raas services as real processes; one is SIGKILLed in the middle of a DAPO step. No group may be
lost or come back short: the client moves the dead service's jobs to the live one (same job ids)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from raas.trainer.dapo import DynamicSampler
from raas.trainer.rollout import RolloutClient
from tests.doubles.scripted_llm import ScriptedLLM, fixed
from tests.trainer.conftest import instance

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    """``python -m raas.api`` with the ``test.group`` handler, waited for without blocking the loop."""

    def __init__(self, state: Path, llm_url: str) -> None:
        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.llm_url = llm_url
        self.proc: asyncio.subprocess.Process | None = None
        self.log = state.parent / f"service-{self.port}.log"

    def _log_fd(self) -> int:
        return os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    async def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAAS_API_TOKEN"}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        log = self._log_fd()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "raas.api", "--port", str(self.port), "--state-dir", str(self.state),
                "--llm", self.llm_url, "--run-workers", "16", "--shutdown-grace", "0", "--log-level", "warning",
                "--handler", "test.group=tests.doubles.group_handler:GroupScriptHandler",
                cwd=REPO, env=env, stdout=log, stderr=log,
            )  # fmt: skip
        finally:
            os.close(log)
        async with httpx.AsyncClient(timeout=1) as http:
            for _ in range(600):
                assert self.proc.returncode is None, self.log.read_text()[-3000:]
                try:
                    if (await http.get(self.url + "/healthz")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError("service did not come up: " + self.log.read_text()[-3000:])

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)
            await asyncio.wait_for(self.proc.wait(), 60)


@pytest.fixture
async def two_services(tmp_path: Path) -> AsyncIterator[tuple[ServiceProcess, ServiceProcess]]:
    async with ScriptedLLM(fixed(3)) as llm:
        a, b = ServiceProcess(tmp_path / "a", llm.url), ServiceProcess(tmp_path / "b", llm.url)
        try:
            await asyncio.gather(a.start(), b.start())
            yield a, b
        finally:
            await asyncio.gather(a.stop(signal.SIGKILL), b.stop(), return_exceptions=True)


async def test_a_service_killed_mid_step_loses_no_group(
    two_services: tuple[ServiceProcess, ServiceProcess],
) -> None:
    a, b = two_services
    data = [instance(f"p{k}", rewards=[1, 0, 1, 0], turns=2, turn_sleep=0.8) for k in range(12)]
    async with RolloutClient([a.url, b.url], health_interval_s=0.25, dead_after_s=1.0) as client:
        sampler = DynamicSampler(client, data, group_size=4, target_groups=6, max_inflight_groups=8)
        step = asyncio.create_task(sampler.next_step())
        async with httpx.AsyncClient(timeout=5) as http:
            for _ in range(500):  # until A is running jobs it accepted
                running = (await http.get(a.url + "/status")).json()["stages"]["run"]["active"]
                if running > 0:
                    break
                await asyncio.sleep(0.02)
        held_by_a = set(next(s for s in client._services if s.url == a.url).outstanding)
        assert running > 0 and held_by_a
        await a.stop(signal.SIGKILL)
        batch, stats = await asyncio.wait_for(step, 120)
        assert len(batch) == 6 and not stats.exhausted
        for g in batch:
            assert sorted(g.results) == [0, 1, 2, 3], g.group_id
            assert all(r.reward is not None and not r.filter for r in g.samples)
        assert stats.failures["moved"] > 0 and stats.failed_groups == 0
        assert client.stats.services_down == 1 and client.stats.filtered == 0
        # jobs A held finished on B under their original ids and are part of the batch
        assert held_by_a & {r.job_id for g in batch for r in g.samples}
        await sampler.close()
