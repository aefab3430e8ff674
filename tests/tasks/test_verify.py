"""Verifiers run in killable worker processes: a hung one is killed within its limit and reaped, nothing is
left running, and the next verification works. Real subprocesses, checked through /proc."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from raas.errors import RaasError, is_infrastructure
from raas.tasks import verify
from raas.tasks.math import score_answer
from raas.tasks.verify import VerifierPool

pytestmark = pytest.mark.integration

T = "tests.tasks.verifiers"


def alive(pid: int) -> bool:
    """True while /proc has the process (a zombie counts: it was not reaped)."""
    return Path(f"/proc/{pid}").exists()


@pytest.fixture
async def pool() -> AsyncIterator[VerifierPool]:
    p = VerifierPool(size=2)
    try:
        yield p
    finally:
        pids = p.pids()
        await p.aclose()
        assert p.pids() == [] and not any(alive(pid) for pid in pids)


def _read_pid(path: Path) -> int | None:
    text = path.read_text() if path.exists() else ""
    return int(text) if text else None


async def _pid_from(path: Path) -> int:
    for _ in range(3000):
        pid = _read_pid(path)
        if pid is not None:
            return pid
        await asyncio.sleep(0.01)
    raise AssertionError("the verifier never started")


async def test_a_hung_verifier_is_killed_and_reaped_and_the_pool_goes_on(
    pool: VerifierPool, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pid"
    hung = asyncio.create_task(pool.call(f"{T}:sleep_forever", str(pid_file), timeout_s=2.0))
    hung_pid = await _pid_from(pid_file)
    # while one worker hangs, the other still verifies: nothing waits behind it
    assert await pool.call(f"{T}:echo", {"a": [1, 2]}, timeout_s=30) == {"a": [1, 2]}
    with pytest.raises(RaasError) as err:
        await hung
    assert err.value.kind == "verifier_timeout" and is_infrastructure(err.value.kind)
    assert "2s" in err.value.message
    assert not alive(hung_pid), "the hung worker is still running (or unreaped)"
    assert hung_pid not in pool.pids()
    # a normal verification right after works, in a live worker
    worker = await pool.call(f"{T}:pid", timeout_s=30)
    assert worker != hung_pid and alive(worker)


async def test_exceptions_crashes_and_prints(pool: VerifierPool) -> None:
    first = await pool.call(f"{T}:pid", timeout_s=30)
    with pytest.raises(RaasError) as err:
        await pool.call(f"{T}:boom", timeout_s=30)
    assert err.value.kind == "handler_error" and "ValueError: the verifier itself failed" in err.value.message
    assert await pool.call(f"{T}:pid", timeout_s=30) == first  # an exception does not cost the worker
    assert await pool.call(f"{T}:noisy", 21, timeout_s=30) == 42  # prints cannot forge an answer
    with pytest.raises(RaasError) as err:
        await pool.call(f"{T}:crash", timeout_s=30)
    assert err.value.kind == "handler_error" and "exit 3" in err.value.message
    assert not alive(first)
    with pytest.raises(RaasError) as err:
        await pool.call("no_such_module_anywhere:f", timeout_s=30)
    assert err.value.kind == "handler_error" and "ModuleNotFoundError" in err.value.message


async def test_memory_is_bounded_per_worker(tmp_path: Path) -> None:
    pool = VerifierPool(size=1, memory_mb=512)
    try:
        with pytest.raises(RaasError) as err:
            await pool.call(f"{T}:allocate", 2048, timeout_s=30)
        assert "MemoryError" in err.value.message
        assert await pool.call(f"{T}:allocate", 8, timeout_s=30) == 8 * 1024 * 1024
    finally:
        await pool.aclose()


async def test_a_cancelled_call_kills_its_worker(pool: VerifierPool, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    task = asyncio.create_task(pool.call(f"{T}:sleep_forever", str(pid_file), timeout_s=600))
    pid = await _pid_from(pid_file)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not alive(pid)


async def test_closed_pool_refuses(tmp_path: Path) -> None:
    pool = VerifierPool(size=1)
    pid = await pool.call(f"{T}:pid", timeout_s=30)
    await pool.aclose()
    assert not alive(pid)
    with pytest.raises(RaasError) as err:
        await pool.call(f"{T}:pid", timeout_s=30)
    assert err.value.kind == "unavailable"


async def test_pathological_math_answer_is_a_verifier_timeout_not_a_reward() -> None:
    """sympy evaluates (10^7)! for minutes: the job's verifier is killed and the failure is typed."""
    assert await score_answer("42", "42") == (
        1.0,
        {"parsed_answer": ["42", "42"], "parsed_truth": ["42", "42"]},
    )
    idle = set(verify.default_pool().pids())
    with pytest.raises(RaasError) as err:
        await score_answer("(10^{7})!", "42", timeout_s=2.0)
    assert (err.value.kind, err.value.stage) == ("verifier_timeout", "eval")
    gone = idle - set(verify.default_pool().pids())
    assert gone and not any(alive(pid) for pid in gone)
    assert (await score_answer("\\frac{3}{4}", "0.75"))[0] == 1.0
    await verify.shutdown()
    assert verify.default_pool().pids() == []


async def test_an_idle_worker_killed_from_outside_is_replaced(pool: VerifierPool) -> None:
    pid = await pool.call(f"{T}:pid", timeout_s=30)
    os.kill(pid, signal.SIGKILL)
    for _ in range(3000):  # asyncio's child watcher reaps it
        if pid not in pool.pids():
            break
        await asyncio.sleep(0.01)
    assert pid not in pool.pids()
    fresh = await pool.call(f"{T}:pid", timeout_s=30)
    assert fresh != pid and alive(fresh)
