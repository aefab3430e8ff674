"""Lifecycle across process boundaries: a crashed run is reaped, interpreter exit and SIGTERM close
sandboxes, and reaping never touches what it did not start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from raas.sandbox import SandboxConfig, SandboxManager
from raas.sandbox import procs as sbprocs
from tests.conftest import SANDBOX_BACKENDS

pytestmark = pytest.mark.integration

# A separate raas process: start a sandbox whose bash leaves a daemon behind, report, then end
# as told: "kill" (SIGKILL itself: no cleanup code runs), "exit" (normal exit without closing anything),
# "wait" (block until stdin closes, then exit normally).
CHILD = r"""
import asyncio, json, os, signal, sys
from raas.sandbox import SandboxManager, config_from_dict
from raas.sandbox.manager import install_signal_handlers

async def main():
    state, config, mode = sys.argv[1], config_from_dict(json.loads(sys.argv[2])), sys.argv[3]
    m = SandboxManager(state)
    sb = await m.start(config, owner="child")
    # A daemon in its own session (no SIGHUP when the pty goes); the FIFO read returns once it is set up.
    await sb.tools.bash("mkfifo up && (setsid sh -c 'echo up > up; exec sleep 300' </dev/null >/dev/null 2>&1 &)"
                        " && cat up && rm up")
    print(json.dumps({"id": sb.id, "scratch": str(sb.scratch), "pid": sb.pid}), flush=True)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "wait":
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    sys.exit(0)

install_signal_handlers()  # a program without handlers of its own asks for the manager's
asyncio.run(main())
"""


def spawn_child(
    state: Path, config: SandboxConfig, mode: str
) -> tuple[subprocess.Popen[str], dict[str, object]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(state), config.model_dump_json(), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, "the child raas process did not start its sandbox"
    return proc, json.loads(line)


def exists(path: object) -> bool:
    return Path(str(path)).exists()


def run_child(state: Path, config: SandboxConfig, mode: str) -> dict[str, object]:
    proc, info = spawn_child(state, config, mode)
    proc.communicate(timeout=120)
    return info


@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
async def test_crashed_run_is_reaped(tmp_path: Path, sandbox_config: SandboxConfig, backend: str) -> None:
    state = tmp_path / "state"
    info = await asyncio.to_thread(run_child, state, sandbox_config, "kill")
    sid = str(info["id"])
    assert (state / "records" / f"{sid}.json").exists()
    assert exists(info["scratch"])
    # No namespace dies with a crashed local run: its daemon is usually still around to reap. Not always:
    # the server dies with its parent (pdeathsig), and the daemon's shell may take it along first (seen
    # under load); the records and the scratch dir must be reaped either way.
    manager = SandboxManager(state)
    reaped = await manager.reap_stale()
    assert sid in reaped
    assert sbprocs.pids_with_env(sid) == []
    assert not exists(info["scratch"])
    assert list((state / "records").iterdir()) == []
    assert await manager.reap_stale() == []
    await manager.close_all()
    assert not manager.scratch_root.exists() or manager.scratch_root.is_relative_to(state)


@pytest.mark.parametrize("backend", ["local", "bwrap"])
@pytest.mark.parametrize("mode", ["exit", "sigterm"])
async def test_interpreter_exit_closes_sandboxes(
    tmp_path: Path, sandbox_config: SandboxConfig, mode: str
) -> None:
    state = tmp_path / "state"
    proc, info = await asyncio.to_thread(spawn_child, state, sandbox_config, "wait")
    sid = str(info["id"])
    assert sbprocs.pids_with_env(sid) != []
    if mode == "sigterm":
        proc.send_signal(signal.SIGTERM)
    await asyncio.to_thread(proc.communicate, "", 120)
    assert proc.returncode == (-signal.SIGTERM if mode == "sigterm" else 0)
    assert sbprocs.pids_with_env(sid) == []
    assert not exists(info["scratch"])
    assert list((state / "records").iterdir()) == []


@pytest.mark.parametrize("backend", ["local"])
async def test_reaping_spares_live_runs_and_strangers(tmp_path: Path, sandbox_config: SandboxConfig) -> None:
    state = tmp_path / "state"
    # A live raas process using the same state dir: its sandbox must survive our reaping.
    live, info = await asyncio.to_thread(spawn_child, state, sandbox_config, "wait")
    # A stranger: tagged with an id no record names, and a record of a dead run whose pid now belongs
    # to that stranger (pid reuse) but with another start time.
    stranger = await asyncio.create_subprocess_exec(
        "sleep", "300", env={**os.environ, sbprocs.ENV_KEY: "sb-000000000000"}
    )
    dead_record = {
        "id": "sb-aaaaaaaaaaaa",
        "pid": stranger.pid,
        "pid_start": 1,
        "scratch": "/etc",
        "manager": {"pid": 2**22 + 1, "start": 1},
    }
    (state / "records" / "sb-aaaaaaaaaaaa.json").write_text(json.dumps(dead_record))
    try:
        manager = SandboxManager(state)
        reaped = await manager.reap_stale()
        assert reaped == ["sb-aaaaaaaaaaaa"]
        assert sbprocs.environ_value(stranger.pid) == "sb-000000000000" and exists("/etc/hostname")
        assert sbprocs.pids_with_env(str(info["id"])) != []
        assert (state / "records" / f"{info['id']}.json").exists()
        await manager.close_all()
    finally:
        stranger.kill()
        await stranger.wait()
        await asyncio.to_thread(live.communicate, "", 120)
    assert sbprocs.pids_with_env(str(info["id"])) == []


@pytest.mark.parametrize("backend", ["local"])
async def test_manager_scratch_stays_short(tmp_path: Path, sandbox_config: SandboxConfig) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    manager = SandboxManager(deep)
    try:
        async with manager.sandbox(sandbox_config, owner="t") as sb:
            assert len(str(sb.socket_path)) <= 107
            assert (await sb.tools.bash("echo ok")).output.strip() == "ok"
    finally:
        await manager.close_all()
    assert not manager.scratch_root.exists()  # the short /tmp root is released when empty
