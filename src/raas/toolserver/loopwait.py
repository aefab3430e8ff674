"""Waiting on the event loop without polling: one timer for a deadline, writer callbacks for a full pty.

The bash sessions wait for a command's report against several deadlines and write input into a terminal
whose buffer may be full; both must cost nothing while nothing happens (no sleeps, no wrapper tasks).
"""

from __future__ import annotations

import os

from . import loop as aio

TYPE_CHECKING = False  # typing is not imported at run time: it costs a sandbox's first call
if TYPE_CHECKING:
    from typing import Any


def _resolve(fut: aio.Future, *_: Any) -> None:
    if not fut.done():
        fut.set_result(None)


async def until(done: aio.Future, when: float) -> None:
    """Wait for ``done`` or the loop time ``when``, whichever comes first (one timer, no wrapper tasks)."""
    if done.done():
        return
    loop = aio.get_running_loop()
    wake = loop.create_future()
    timer = loop.call_at(when, _resolve, wake) if when != float("inf") else None

    def callback(_: aio.Future) -> None:
        _resolve(wake)

    done.add_done_callback(callback)
    try:
        await wake
    finally:
        done.remove_done_callback(callback)
        if timer is not None:
            timer.cancel()


async def write_until(fd: int, data: bytes, done: aio.Future, deadline: float) -> None:
    """Write ``data`` to the non-blocking ``fd`` until it is all written, ``done`` is, or the loop time
    ``deadline`` passes; a full buffer waits for writability, a closed descriptor ends the write."""
    loop = aio.get_running_loop()
    while data and not done.done():
        try:
            n = os.write(fd, data)
            data = data[n:]
            continue
        except BlockingIOError:
            pass
        except OSError:
            return
        writable = loop.create_future()
        loop.add_writer(fd, _resolve, writable)
        try:
            await aio.wait({writable, done}, timeout=max(0.0, deadline - loop.time()))
        finally:
            loop.remove_writer(fd)
        if loop.time() >= deadline:
            return
