"""Bounded executors per subsystem: each owner's pool is its own, so a slow subsystem cannot starve another.

The starvation tests block a pool completely (threads waiting on an event the test holds) and show that
the other subsystems still finish their work; each wait has a generous hang guard, not a timing bound.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from raas.core.executors import Executor
from raas.errors import RaasError
from raas.pipeline.ledger import Ledger
from raas.sandbox import SandboxManager
from raas.sandbox.config import make_config
from raas.sandbox.layers import LayerStore
from raas.tasks.swe.images import ImageGates

from .conftest import leftovers

HANG_GUARD_S = 120


class Blocker:
    """Occupies threads until released: ``hold`` is a blocking call that waits on the test's event and
    tells the loop (``started``) when it begins."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.release = threading.Event()
        self.started: asyncio.Queue[None] = asyncio.Queue()
        self.running = 0
        self.peak = 0
        self._loop = loop
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        self._loop.call_soon_threadsafe(self.started.put_nowait, None)
        try:
            self.release.wait(HANG_GUARD_S)
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture
async def blocker() -> AsyncIterator[Blocker]:
    b = Blocker(asyncio.get_running_loop())
    try:
        yield b
    finally:
        b.release.set()


async def occupied(
    run: Callable[[Callable[[], None]], Awaitable[None]], blocker: Blocker, n: int
) -> list[asyncio.Future[None]]:
    """``n`` calls of ``blocker.hold`` through ``run``, returned once all ``n`` are running."""
    calls = [asyncio.ensure_future(run(blocker.hold)) for _ in range(n)]
    async with asyncio.timeout(HANG_GUARD_S):
        for _ in range(n):
            await blocker.started.get()
    return calls


@pytest.mark.unit
async def test_an_executor_runs_at_most_its_workers_and_refuses_work_once_shut_down(blocker: Blocker) -> None:
    pool = Executor("test-pool", 2)
    calls = await occupied(pool.run, blocker, 2)
    queued = asyncio.ensure_future(pool.run(blocker.hold))
    await asyncio.sleep(0.05)
    assert blocker.peak == 2  # the third call waits for a worker
    queued.cancel()  # a call still queued is dropped, never run
    blocker.release.set()
    await asyncio.gather(*calls)
    assert queued.cancelled() and blocker.peak == 2
    await pool.aclose()
    with pytest.raises(RaasError) as err:
        await pool.run(blocker.hold)
    assert err.value.kind == "internal" and "shut down" in err.value.message
    assert not [t for t in threading.enumerate() if t.name.startswith("test-pool")]


@pytest.mark.unit
async def test_aclose_waits_for_started_calls(blocker: Blocker) -> None:
    pool = Executor("test-aclose", 1)
    [call] = await occupied(pool.run, blocker, 1)
    closing = asyncio.ensure_future(pool.aclose())
    await asyncio.sleep(0.05)
    assert not closing.done()  # the started call still runs
    blocker.release.set()
    async with asyncio.timeout(HANG_GUARD_S):
        await closing
    assert call.done() and call.exception() is None


@pytest.mark.integration
async def test_a_blocked_default_pool_starves_no_subsystem(tmp_path: Path, blocker: Blocker) -> None:
    """The loop's default pool is fully taken by slow work: sandboxes still start, run and close, the
    ledger opens and closes, image gates measure a tree, a layer store closes; none of them waits on that
    pool."""
    loop = asyncio.get_running_loop()
    previous = getattr(loop, "_default_executor", None)  # put back after: the loop may serve other tests
    default = ThreadPoolExecutor(max_workers=1, thread_name_prefix="test-default")
    loop.set_default_executor(default)
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.txt").write_text("a")
    calls = await occupied(lambda fn: loop.run_in_executor(None, fn), blocker, 1)
    manager = SandboxManager(tmp_path / "state")
    try:
        async with asyncio.timeout(HANG_GUARD_S):
            async with manager.sandbox(make_config(backend="local"), owner="t") as sb:
                workdir = (await sb.tools.bash("echo up")).cwd
                assert await sb.tools.upload_dir(source, f"{workdir}/copy") == 1  # the client's own pool
            ledger = Ledger(tmp_path / "ledger.db")
            await ledger.open()
            await ledger.close()
            assert not ledger.running
            gates = ImageGates(1, 1)
            assert await gates.repo_mb(tmp_path, "/state") >= 0
            store = LayerStore(tmp_path / "layers")
            assert store.sweep() == 0
            await store.close()  # removes its dir on the store's own pool
            assert not store.dir.exists()
            assert not [t for t in threading.enumerate() if t.name.startswith("raas-layers")]
        assert blocker.running == 1  # the default pool was held the whole time
    finally:
        await manager.close_all()
        blocker.release.set()
        await asyncio.gather(*calls)
        loop._default_executor = previous  # type: ignore[attr-defined]
        default.shutdown(wait=False)
    assert leftovers(manager) == {}


@pytest.mark.integration
async def test_slow_sandbox_starts_do_not_hold_up_closes(tmp_path: Path, blocker: Blocker) -> None:
    """Every start worker is busy (as with slow image conversions): a running sandbox still closes and
    leaves nothing behind, because closes have workers of their own."""
    manager = SandboxManager(tmp_path / "state")
    calls: list[asyncio.Future[None]] = []
    try:
        sb = await manager.start(make_config(backend="local"), owner="t")
        await sb.tools.bash("sleep 300 &")
        calls = await occupied(manager.executors.start.run, blocker, manager.executors.start.max_workers)
        async with asyncio.timeout(HANG_GUARD_S):
            await sb.close()
        assert blocker.running == manager.executors.start.max_workers
        assert leftovers(manager) == {}
    finally:
        blocker.release.set()
        await asyncio.gather(*calls)
        await manager.close_all()
