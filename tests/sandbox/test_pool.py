"""Warm pools, attacked: a claimed sandbox is never handed out twice, a pooled sandbox that died while
idle is never handed out (not even before the event loop noticed), pools follow config changes and the
memory budget, and stopping them leaves nothing (the ``sandbox_manager`` fixture's leak check).

Runs on ``local`` and ``bwrap``, as root and (CI's second pass) as an unprivileged user.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from raas.sandbox import Sandbox, SandboxConfig, SandboxManager
from raas.sandbox import procs as sbprocs
from raas.sandbox.config import make_config
from raas.sandbox.pool import POOL_OWNER, PoolSettings, WarmPool, WarmPools, config_key

BACKENDS = pytest.mark.parametrize("backend", ["local", "bwrap"])
ROOT = os.geteuid() == 0


def settings(**kw: object) -> PoolSettings:
    return PoolSettings.model_validate({"enabled": True, "refill_concurrency": 4, **kw})


def pool_of(manager: SandboxManager, config: SandboxConfig) -> WarmPool:
    return manager.pools._pools[config_key(config)]


async def filled(manager: SandboxManager, config: SandboxConfig, n: int, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while len(pool_of(manager, config).idle) < n:
        assert time.monotonic() < deadline, manager.pools.snapshot()
        await asyncio.sleep(0.05)


def wait_dead_sync(pid: int, limit_s: float = 10.0) -> None:
    """Block (without letting the event loop run) until ``pid`` has exited: gone or a zombie."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not die")


def server_pid(sb: Sandbox) -> int:
    """The host pid of the sandbox's Python tool server (for bwrap: not the bwrap processes)."""
    for pid in sbprocs.pids_with_env(sb.id):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"raas_toolserver" in cmdline and not cmdline.startswith((b"bwrap", b"/usr/bin/bwrap")):
            if b"setpriv" not in cmdline.split(b"\0")[0]:
                return pid
    raise AssertionError(f"no tool server process in {sb.id}")


# -- sizing (no sandboxes) -------------------------------------------------------------------------------


@pytest.mark.unit
async def test_target_follows_demand_backlog_and_bounds(tmp_path: Path) -> None:
    pools = WarmPools(SandboxManager(tmp_path / "state"))
    pools.settings = settings(min_size=1, max_size=20, window_s=10)
    backlog = [0]
    pools.backlog = lambda: backlog[0]
    pool = WarmPool(config=make_config(), key="k")
    now = 1000.0
    assert pools.target_of(pool, now) == 1  # no demand: min_size
    pool.demand.extend([now - 12.0] * 4 + [now - 1.0] * 3)  # 3 requests within the window, 4 before it
    assert pools.target_of(pool, now) == 3
    assert len(pool.demand) == 3
    backlog[0] = 5  # INIT jobs waiting count while demand lasts
    assert pools.target_of(pool, now) == 8
    backlog[0] = 500
    assert pools.target_of(pool, now) == 20  # max_size
    assert pools.target_of(pool, now + 20) == 1  # demand aged out: back to min_size, backlog ignored
    assert not pool.demand
    assert PoolSettings(memory_budget_mb=100, sandbox_mb=16).budget_slots == 6


@pytest.mark.unit
async def test_a_dropped_pool_starts_nothing(tmp_path: Path) -> None:
    """A refill step that runs after stop() (Python 3.11's wait_for can swallow the loop's cancellation
    when a wake-up arrives with it) must not start a sandbox that stop() no longer waits for."""
    pools = WarmPools(SandboxManager(tmp_path / "state"))
    pools.configure(settings(min_size=2, max_size=2), [make_config()])
    pool = next(iter(pools._pools.values()))
    await pools.stop()
    pool.demand.append(time.monotonic())
    pools._refill_step(pool)
    assert not pool.starting


@pytest.mark.unit
def test_settings_reject_nonsense() -> None:
    for bad in ({"min_size": -1}, {"sandbox_mb": 0}, {"refill_concurrency": 0}, {"surprise": 1}):
        with pytest.raises(ValueError):
            PoolSettings.model_validate(bad)


# -- real sandboxes --------------------------------------------------------------------------------------


@pytest.mark.integration
@BACKENDS
async def test_a_claimed_sandbox_is_never_served_twice(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str
) -> None:
    sandbox_manager.pools.configure(settings(min_size=3, max_size=6), [sandbox_config])
    await filled(sandbox_manager, sandbox_config, 3)
    seen: set[str] = set()
    uids: set[int] = set()
    for round_ in range(3):
        # Many jobs at once, each planting a marker for whoever might get its sandbox next.
        claimed = await asyncio.gather(
            *(sandbox_manager.start(sandbox_config, owner=f"job-{round_}-{i}") for i in range(6))
        )
        ids = [sb.id for sb in claimed]
        assert len(set(ids)) == len(ids), "one sandbox handed to two jobs at once"
        assert not seen & set(ids), "a sandbox came back after its job"
        seen |= set(ids)
        for i, sb in enumerate(claimed):
            assert sb.owner == f"job-{round_}-{i}"
            # (a local sandbox shares the host's /tmp; its workspace and home are its own)
            dirs = "~ ." if backend == "local" else "/tmp ~ ."
            plant = " ".join(f"{d}/pool-marker" for d in dirs.split())
            out = (await sb.tools.bash(f"ls -A {dirs} 2>/dev/null; tee {plant} <<< planted")).output
            assert "pool-marker" not in out
            if sb.identity.dedicated:
                uids.add(sb.identity.uid)
        await asyncio.gather(*(sb.close() for sb in claimed))
        for sid in ids:
            assert sbprocs.pids_with_env(sid) == []
    stats = pool_of(sandbox_manager, sandbox_config).stats
    assert stats.claims + stats.misses == 18 and stats.claims >= 3
    assert all(sb.owner == POOL_OWNER for sb in sandbox_manager.list() if sb.id not in seen)
    if ROOT and backend == "bwrap":
        assert len(uids) == 18, "every sandbox runs under a uid of its own"


@pytest.mark.integration
@BACKENDS
@pytest.mark.parametrize("victim", ["launcher", "server"])
async def test_a_pooled_sandbox_killed_while_idle_is_not_handed_out(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str, victim: str
) -> None:
    if backend == "local" and victim == "server":
        pytest.skip("a local sandbox's launcher is its tool server")
    sandbox_manager.pools.configure(settings(min_size=2, max_size=2), [sandbox_config])
    await filled(sandbox_manager, sandbox_config, 2)
    pool = pool_of(sandbox_manager, sandbox_config)
    doomed = pool.idle[-1].sandbox  # the one a claim would take next
    assert doomed.pid is not None
    pid = doomed.pid if victim == "launcher" else server_pid(doomed)
    os.kill(pid, signal.SIGKILL)
    wait_dead_sync(pid)
    if victim == "server":
        wait_dead_sync(doomed.pid)  # bwrap follows its child
    # No await between the death and the claim: the event loop has not seen the exit yet.
    sb = sandbox_manager.pools.claim(sandbox_config, "attacker-job")
    assert sb is None or sb.id != doomed.id
    assert pool.stats.discarded >= 1
    if sb is not None:
        assert (await sb.tools.bash("echo alive")).output.strip() == "alive"
        await sb.close()
    await doomed.wait_closed()
    assert sbprocs.pids_with_env(doomed.id) == []
    await filled(sandbox_manager, sandbox_config, 2)  # replaced
    assert doomed.id not in {e.sandbox.id for e in pool.idle}


@pytest.mark.integration
@BACKENDS
async def test_an_idle_death_is_noticed_and_replaced_without_a_claim(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str
) -> None:
    sandbox_manager.pools.configure(settings(min_size=2, max_size=2), [sandbox_config])
    await filled(sandbox_manager, sandbox_config, 2)
    pool = pool_of(sandbox_manager, sandbox_config)
    doomed = pool.idle[0].sandbox
    for pid in sbprocs.pids_with_env(doomed.id):
        sbprocs.kill_quietly(pid, signal.SIGKILL)
    await asyncio.wait_for(doomed.wait_closed(), 30)
    assert pool.stats.discarded == 1 and pool.stats.claims == 0
    await filled(sandbox_manager, sandbox_config, 2)
    assert doomed.id not in {e.sandbox.id for e in pool.idle}
    assert sbprocs.pids_with_env(doomed.id) == []


@pytest.mark.integration
@BACKENDS
async def test_config_change_and_budget(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str
) -> None:
    pools = sandbox_manager.pools
    # The memory budget wins over min_size: 40 MB at 16 MB each holds two.
    pools.configure(settings(min_size=5, memory_budget_mb=40, sandbox_mb=16), [sandbox_config])
    await filled(sandbox_manager, sandbox_config, 2)
    await asyncio.sleep(0.5)
    assert len(pool_of(sandbox_manager, sandbox_config).idle) == 2
    old = [sb.id for sb in sandbox_manager.list(owner=POOL_OWNER)]
    # Another config: the old pool's sandboxes are closed, the new pool fills.
    other = sandbox_config.model_copy(update={"env": {"POOL_TEST": "1"}})
    pools.configure(settings(min_size=1), [other])
    await filled(sandbox_manager, other, 1)
    assert config_key(sandbox_config) not in pools._pools
    for sid in old:
        for _ in range(200):
            if sbprocs.pids_with_env(sid) == [] and sid not in {s.id for s in sandbox_manager.list()}:
                break
            await asyncio.sleep(0.05)
        assert sbprocs.pids_with_env(sid) == []
    sb = await sandbox_manager.start(other, owner="job")
    assert (await sb.tools.bash("echo $POOL_TEST")).output.strip() == "1"
    await sb.close()
    # A config without a pool starts cold and is not counted anywhere.
    cold = await sandbox_manager.start(sandbox_config, owner="job2")
    assert cold.owner == "job2"
    await cold.close()
    # Disabled: every pool goes.
    pools.configure(PoolSettings(enabled=False), [other])
    await pools.stop()
    assert sandbox_manager.list(owner=POOL_OWNER) == []


@pytest.mark.integration
@BACKENDS
async def test_stop_while_refilling_leaves_nothing(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str
) -> None:
    sandbox_manager.pools.configure(settings(min_size=8, max_size=8, refill_concurrency=8), [sandbox_config])
    await asyncio.sleep(0.05)  # starts under way
    await sandbox_manager.close_all()
    assert sandbox_manager.list() == []
    # (the fixture checks processes, records, scratch dirs, mounts and sockets)


@pytest.mark.integration
@BACKENDS
async def test_sandboxes_of_a_replaced_bundle_are_not_handed_out(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str
) -> None:
    sandbox_manager.pools.configure(settings(min_size=2, max_size=2), [sandbox_config])
    await filled(sandbox_manager, sandbox_config, 2)
    old_bundle = sandbox_manager.current_bundle()
    assert old_bundle is not None
    victim = next(p for p in old_bundle.rglob("*.py"))
    victim.chmod(0o644)
    with victim.open("a") as f:
        f.write("\n# changed on disk\n")
    # The next start checks the bundle's digest, throws the changed one away and builds a fresh one.
    new_bundle = await sandbox_manager.bundle_dir()
    assert new_bundle != old_bundle
    pool = pool_of(sandbox_manager, sandbox_config)
    stale = {e.sandbox.id for e in pool.idle if e.sandbox.bundle_dir == old_bundle}
    assert len(stale) == 2  # the pool was full: nothing was started meanwhile
    assert sandbox_manager.pools.claim(sandbox_config, "job") is None
    assert pool.stats.discarded == 2 and pool.stats.misses == 1
    await filled(sandbox_manager, sandbox_config, 2)  # refilled from the fresh bundle
    sb = await sandbox_manager.start(sandbox_config, owner="job")
    assert sb.bundle_dir == new_bundle and sb.id not in stale
    await sb.close()


@pytest.mark.integration
async def test_a_claimed_sandbox_gets_its_lease_and_an_idle_one_none(sandbox_manager: SandboxManager) -> None:
    config = make_config(backend="local")
    sandbox_manager.default_lease_s = 0.3
    sandbox_manager.pools.configure(settings(min_size=1, max_size=1), [config])
    await filled(sandbox_manager, config, 1)
    idle = pool_of(sandbox_manager, config).idle[0].sandbox
    await asyncio.sleep(0.6)  # past the default lease: an idle pooled sandbox has none
    assert not idle.closed and idle.lease_deadline is None
    sb = await sandbox_manager.start(config, owner="leased")
    assert sb is idle and pool_of(sandbox_manager, config).stats.claims == 1
    assert sb.lease_deadline is not None
    await asyncio.wait_for(sb.wait_closed(), 30)  # its lease ran out: closed by the manager
    assert pool_of(sandbox_manager, config).stats.discarded == 0


@pytest.mark.integration
async def test_pools_follow_demand_up_and_back_down(sandbox_manager: SandboxManager) -> None:
    config = make_config(backend="local")
    sandbox_manager.pools.configure(settings(window_s=3.0, keep_idle_s=0.0), [config])
    pool = pool_of(sandbox_manager, config)
    await asyncio.sleep(0.2)
    assert pool.size() == 0  # no demand, min_size 0: nothing started
    # Asked for together: both find the pool empty (one after the other, a refill could be ready for the second).
    first, second = await asyncio.gather(
        sandbox_manager.start(config, owner="j1"), sandbox_manager.start(config, owner="j2")
    )
    assert pool.stats.misses == 2
    assert pool.target == 2  # two were asked for: two are started to be kept ready
    await asyncio.gather(first.close(), second.close())
    deadline = time.monotonic() + 60
    # ... then demand ages out and the idle ones are closed.
    while pool.stats.refills < 2 or pool.size() or sandbox_manager.list():
        assert time.monotonic() < deadline, sandbox_manager.pools.snapshot()
        assert pool.stats.refill_failures == 0
        await asyncio.sleep(0.1)
    assert pool.stats.trimmed == 2 and pool.target == 0 and pool.stats.claims == 0
