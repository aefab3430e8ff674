"""A real asyncio loop in a thread of its own, for the code that needs one (``jupyter_client``).

The tool server runs on :mod:`.loop` so that it never pays for importing asyncio at start-up; a tool built
on asyncio runs its coroutines here instead, started with that tool's first call. Results come back to the
server's loop; the server's reaper hands exit statuses over through :meth:`AsyncioThread.reaper`.
"""

from __future__ import annotations

import asyncio
import threading

from . import loop as aio
from .procs import Reaper

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Awaitable, Callable


class ThreadReaper:
    """The server's reaper as code on the thread sees it: exit callbacks run on the thread's loop."""

    def __init__(self, reaper: Reaper, loop: asyncio.AbstractEventLoop) -> None:
        self._reaper = reaper
        self._loop = loop

    def watch(self, pid: int, callback: Callable[[int], None]) -> None:
        def on_exit(code: int) -> None:
            self._loop.call_soon_threadsafe(callback, code)

        self._reaper.watch(pid, on_exit)

    def unwatch(self, pid: int) -> None:
        self._reaper.unwatch(pid)


class AsyncioThread:
    """Owns the thread and its loop; :meth:`run` awaits a coroutine there from the server's loop."""

    def __init__(self, name: str, reaper: Reaper) -> None:
        self.loop = asyncio.new_event_loop()
        self.reaper = ThreadReaper(reaper, self.loop)
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``await fn(*args)`` on the thread's loop (``fn`` is called there too); cancelling cancels it."""
        ours = aio.get_running_loop()
        done = ours.create_future()

        async def call() -> Any:
            return await fn(*args)

        cf = asyncio.run_coroutine_threadsafe(call(), self.loop)

        def settle(_: Any) -> None:
            if done.done():
                return
            if cf.cancelled():
                done.set_exception(RuntimeError("the call was cancelled on the asyncio thread"))
            elif cf.exception() is not None:
                done.set_exception(cf.exception())  # type: ignore[arg-type]
            else:
                done.set_result(cf.result())

        cf.add_done_callback(lambda _: ours.call_soon_threadsafe(settle, None))
        try:
            return await done
        except aio.CancelledError:
            cf.cancel()
            raise

    async def close(self) -> None:
        """Stop the loop (the thread ends with it) and release it."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        await aio.get_running_loop().run_in_thread(self._thread.join, 5.0)
        if not self._thread.is_alive():
            self.loop.close()
