"""Start/stop many sandboxes with random kills mid-command: nothing may be left behind.

200 rounds for local and bwrap; apptainer starts cost ~0.3-1 s each on 2 cores, so it gets 30 rounds
(the same kill paths, fewer repetitions). The ``sandbox_manager`` fixture checks at teardown that no
tagged process, record, scratch dir, mount or socket survived.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import signal

import pytest

from raas.errors import RaasError
from raas.sandbox import Sandbox, SandboxConfig, SandboxManager
from raas.sandbox import procs as sbprocs

pytestmark = pytest.mark.integration

ACTIONS = (
    "close_mid_command",
    "kill_launcher",
    "kill_server_inside",
    "kill_random_process",
    "cancel_call",
    "normal",
)


async def _one_round(manager: SandboxManager, config: SandboxConfig, rng: random.Random, i: int) -> str:
    action = rng.choice(ACTIONS)
    sb: Sandbox = await manager.start(config, owner=f"leak-{i % 4}")
    call: asyncio.Task[object] | None = None
    try:
        if action == "normal":
            r = await sb.tools.bash("echo ok")
            assert r.output.strip() == "ok"
            return action
        # A command with children of its own (background jobs, a pipeline) that would run for a while.
        call = asyncio.create_task(sb.tools.bash("(sleep 30 &) ; sleep 30 | cat & sleep 30"))
        await asyncio.sleep(rng.uniform(0, 0.05))
        if action == "kill_launcher":
            assert sb.pid is not None
            sbprocs.kill_quietly(sb.pid, signal.SIGKILL)
        elif action == "kill_server_inside":
            with contextlib.suppress(RaasError):
                await sb.tools.bash("kill -9 $PPID", session="killer")
        elif action == "kill_random_process":
            tagged = sbprocs.pids_with_env(sb.id)
            if tagged:
                sbprocs.kill_quietly(rng.choice(tagged), signal.SIGKILL)
        elif action == "cancel_call":
            call.cancel()
        return action
    finally:
        await sb.close()
        if call is not None:
            with contextlib.suppress(RaasError, asyncio.CancelledError):
                await call  # ends: killed sandboxes answer sandbox_dead, never hang
            assert call.done()


@pytest.mark.parametrize(("backend", "rounds"), [("local", 200), ("bwrap", 200), ("apptainer", 30)])
async def test_start_stop_with_random_kills(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str, rounds: int
) -> None:
    rng = random.Random(f"leak-{backend}")
    limit = asyncio.Semaphore(4)

    async def guarded(i: int) -> str:
        async with limit:
            return await _one_round(sandbox_manager, sandbox_config, rng, i)

    done = await asyncio.gather(*(guarded(i) for i in range(rounds)))
    counts = collections.Counter(done)
    assert sum(counts.values()) == rounds and len(counts) == len(ACTIONS), counts
    assert sandbox_manager.list() == []
    assert len(set(sandbox_manager.started_ids)) == rounds
    # Nothing tagged by any of them survives (the fixture re-checks scratch dirs, records, mounts, fds).
    alive = [
        pid for pid, v in sbprocs.pids_with_env_prefix("sb-").items() if v in set(sandbox_manager.started_ids)
    ]
    assert alive == []
    assert os.listdir(sandbox_manager.records_dir) == []
