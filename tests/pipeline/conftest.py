"""Fixtures for pipeline tests: a real RolloutService on a temp state dir with a real SandboxManager
(``local`` backend) and the scripted test-double handler; every test ends with a leak check."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from raas.core.jobs import JobRequest, is_terminal
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from raas.sandbox import SandboxManager, procs
from tests.doubles.handlers import StageScriptHandler, script_registry


class RecordingSandboxManager(SandboxManager):
    """The real manager, remembering every sandbox id it started so a test can prove none survived."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.started_ids: list[str] = []
        self.opened: asyncio.Queue[str] = asyncio.Queue()
        super().__init__(*args, **kwargs)

    async def start(self, config: Any, *, owner: str, lease_s: float | None = None) -> Any:
        sb = await super().start(config, owner=owner, lease_s=lease_s)
        if sb.id not in self.started_ids:
            self.started_ids.append(sb.id)
        self.opened.put_nowait(sb.id)
        return sb


def assert_no_leftovers(manager: RecordingSandboxManager) -> None:
    assert manager.list() == [], f"sandboxes still open: {[s.id for s in manager.list()]}"
    for sid in manager.started_ids:
        assert procs.pids_with_env(sid) == [], f"processes of sandbox {sid} survived"
        assert not (manager.scratch_root / sid).exists(), f"scratch dir of {sid} survived"


@pytest.fixture
def script_handler() -> Any:
    StageScriptHandler.hook_calls.clear()
    yield StageScriptHandler
    StageScriptHandler.hook_calls.clear()


ServiceFactory = Callable[..., Awaitable[RolloutService]]


@pytest.fixture
async def make_service(tmp_path: Path, script_handler: Any) -> AsyncIterator[ServiceFactory]:
    """``await make_service(**config)``: a started service; shut down and leak-checked at teardown."""
    made: list[tuple[RolloutService, RecordingSandboxManager]] = []

    async def make(**overrides: Any) -> RolloutService:
        state = tmp_path / f"svc{len(made)}" if "state_dir" not in overrides else overrides.pop("state_dir")
        cfg = ServiceConfig(state_dir=state, **{"shutdown_grace_s": 0.0, **overrides})
        manager = RecordingSandboxManager(Path(state) / "sandboxes")
        svc = RolloutService(cfg, sandbox_manager=manager, handlers=script_registry())
        await svc.start()
        made.append((svc, manager))
        return svc

    yield make
    for svc, manager in made:
        await svc.shutdown(0)
        assert_no_leftovers(manager)
        assert not svc.ledger.running, "the ledger writer thread outlived shutdown"
        await manager.close_all()


def script(**stages: Any) -> dict[str, Any]:
    """An instance for the scripted handler: ``script(run={"sleep": 5})``."""
    return {"data_source": "test.script", **stages}


async def reach(svc: RolloutService, job_id: str, status: str, limit_s: float = 30.0) -> None:
    """Wait (event-driven, no polling) until ``job_id`` is in ``status``."""

    async def watch() -> None:
        async with svc.events() as sub:
            info = await svc.get(job_id)
            if info.status == status:
                return
            if is_terminal(info.status):
                raise AssertionError(f"{job_id} ended {info.status} before reaching {status}")
            async for event in sub:
                if event.job_id != job_id:
                    continue
                if event.status == status:
                    return
                if is_terminal(event.status):
                    raise AssertionError(f"{job_id} ended {event.status} before reaching {status}")

    await asyncio.wait_for(watch(), limit_s)


async def submit(svc: RolloutService, instance: dict[str, Any], **kw: Any) -> str:
    return (await svc.submit(JobRequest(instance=instance, **kw))).job_id
