"""The tool server's own event loop (raas.toolserver.loop), its C-level JSON, and what start-up imports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raas.toolserver import jsonc
from raas.toolserver import loop as aio

pytestmark = pytest.mark.unit


def run(coro: Any) -> Any:
    return aio.run(coro)


def test_timers_fire_in_order_and_cancelled_ones_never() -> None:
    fired: list[str] = []

    async def main() -> None:
        loop = aio.get_running_loop()
        loop.call_later(0.03, fired.append, "late")
        loop.call_later(0.01, fired.append, "early")
        loop.call_later(0.02, fired.append, "cancelled").cancel()
        loop.call_soon(fired.append, "soon")
        await aio.wait({loop.create_future()}, timeout=0.06)

    run(main())
    assert fired == ["soon", "early", "late"]


def test_cancel_raises_at_the_await_and_runs_finally() -> None:
    log: list[str] = []

    async def victim(fut: aio.Future) -> None:
        try:
            await fut
        except aio.CancelledError:
            log.append("cancelled")
            raise
        finally:
            log.append("finally")

    async def main() -> None:
        loop = aio.get_running_loop()
        fut = loop.create_future()
        task = loop.create_task(victim(fut))
        await aio.wait({task}, timeout=0.01)
        assert not task.done()
        assert task.cancel()
        await aio.wait({task})
        assert task.cancelled()
        with pytest.raises(aio.CancelledError):
            task.result()
        fut.set_result(1)  # the future it awaited is still usable and wakes nobody

    run(main())
    assert log == ["cancelled", "finally"]


def test_a_task_cancelled_before_it_ran_never_runs() -> None:
    ran: list[int] = []

    async def body() -> None:
        ran.append(1)

    async def main() -> None:
        task = aio.ensure_future(body())
        task.cancel()
        await aio.wait({task})
        assert task.cancelled()

    run(main())
    assert ran == []


def test_wait_all_first_and_timeout() -> None:
    async def main() -> None:
        loop = aio.get_running_loop()
        a, b = loop.create_future(), loop.create_future()
        loop.call_later(0.01, a.set_result, "a")
        done, pending = await aio.wait({a, b}, timeout=0.05)
        assert done == {a} and pending == {b}
        c = loop.create_future()
        loop.call_later(0.01, c.set_result, "c")
        done, pending = await aio.wait({b, c}, return_when=aio.FIRST_COMPLETED)
        assert done == {c} and pending == {b}
        b.set_exception(ValueError("x"))
        done, _ = await aio.wait({a, b, c})
        assert done == {a, b, c} and isinstance(b.exception(), ValueError)

    run(main())


def test_lock_serves_in_order_and_a_cancelled_waiter_passes_it_on() -> None:
    order: list[str] = []

    async def user(lock: aio.Lock, name: str, gate: aio.Future) -> None:
        async with lock:
            order.append(name)
            await gate

    async def main() -> None:
        loop = aio.get_running_loop()
        lock = aio.Lock()
        gate = loop.create_future()
        first = aio.ensure_future(user(lock, "first", gate))
        await aio.wait({first}, timeout=0.001)
        second = aio.ensure_future(user(lock, "second", gate))
        third = aio.ensure_future(user(lock, "third", gate))
        await aio.wait({second, third}, timeout=0.001)
        second.cancel()  # waiting for the lock: it must not hold up the third
        gate.set_result(None)
        await aio.wait({first, second, third}, timeout=1.0)
        assert first.done() and second.cancelled() and third.done()
        assert not lock.locked()

    run(main())
    assert order == ["first", "third"]


def test_readers_writers_and_removed_handlers() -> None:
    r, w = os.pipe()
    got: list[bytes] = []

    async def main() -> None:
        loop = aio.get_running_loop()
        done = loop.create_future()

        def on_read() -> None:
            got.append(os.read(r, 100))
            loop.remove_reader(r)
            done.set_result(None)

        loop.add_reader(r, on_read)
        writable = loop.create_future()
        loop.add_writer(w, lambda: writable.done() or writable.set_result(None))
        await aio.wait({writable})
        assert loop.remove_writer(w) and not loop.remove_writer(w)
        os.write(w, b"ping")
        await aio.wait({done}, timeout=5)
        os.write(w, b"unread")  # nobody listens any more
        await aio.wait({loop.create_future()}, timeout=0.02)

    try:
        run(main())
    finally:
        os.close(r)
        os.close(w)
    assert got == [b"ping"]


def test_threads_and_signals_wake_the_loop() -> None:
    async def main() -> None:
        loop = aio.get_running_loop()
        assert await loop.run_in_thread(lambda x: x * 2, 21) == 42
        with pytest.raises(KeyError):
            await loop.run_in_thread({}.__getitem__, "missing")
        hit = loop.create_future()
        threading.Timer(0.01, loop.call_soon_threadsafe, (hit.set_result, "thread")).start()
        assert (await aio.wait({hit}, timeout=5))[0] == {hit}
        got = loop.create_future()
        loop.add_signal_handler(signal.SIGUSR1, lambda: got.done() or got.set_result("signal"))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert (await aio.wait({got}, timeout=5))[0] == {got}

    before = signal.getsignal(signal.SIGUSR1)
    run(main())
    assert signal.getsignal(signal.SIGUSR1) == before  # closing the loop restores the handler


def test_a_crashing_task_keeps_its_exception() -> None:
    async def boom() -> None:
        raise RuntimeError("boom")

    async def main() -> None:
        task = aio.ensure_future(boom())
        await aio.wait({task})
        assert isinstance(task.exception(), RuntimeError)

    run(main())


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(VALUES, st.booleans())
def test_c_level_json_matches_the_json_module(value: Any, ascii_only: bool) -> None:
    text = jsonc.dumps(value, ascii_only)
    assert text == json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":"))
    assert json.dumps(jsonc.loads(" \n" + text + "\t")) == json.dumps(json.loads(text))


@pytest.mark.parametrize("bad", ["", "  ", "[1,", "1 2", "{'a': 1}", "nul", "[1]x", "\x00"])
def test_c_level_json_refuses_what_json_refuses(bad: str) -> None:
    with pytest.raises(ValueError):
        json.loads(bad)
    with pytest.raises(ValueError):
        jsonc.loads(bad)


def test_c_level_json_errors_like_json() -> None:
    with pytest.raises(TypeError):
        jsonc.dumps({"a": object()}, False)
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError):
        jsonc.dumps(loop, False)


def test_start_up_imports_none_of_the_heavy_modules(bundle_dir: Path) -> None:
    """What the first call (a ping) needs, and no more: these would cost most of a sandbox's start."""
    heavy = ("asyncio", "typing", "re", "enum", "json", "argparse", "tempfile", "shutil", "collections")
    code = (
        "import os, sys, raas_toolserver.boot, raas_toolserver.server as s\n"
        "server = s.ToolServer('/nonexistent/x.sock', '/tmp')\n"
        "server.info()\n"
        "os.rmdir(server.tmpdir)\n"
        f"print(' '.join(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": str(bundle_dir), "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == ""
