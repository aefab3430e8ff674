"""A small event loop for the tool server: futures, tasks, timers, fd readiness, signals, threads.

``import asyncio`` costs 50-80 ms of CPU on small VMs (it pulls in logging, concurrent.futures, inspect,
ssl, ...), several times what a bare interpreter costs and most of a sandbox's start-up. The tool server
needs only a sliver of it, so this module implements that sliver on ``epoll`` with the same
semantics (a coroutine awaits a :class:`Future`; :func:`wait` takes a set and a timeout; a cancelled task
gets :class:`CancelledError` at its current ``await``). Tools that need the real asyncio (the IPython
kernel client) run it in a thread of their own, imported only when first used.

Single-threaded: only :meth:`Loop.call_soon_threadsafe` may be called from other threads.
"""

from __future__ import annotations

import _signal as signal  # the C module: signal.py imports enum
import heapq
import os
import select
import time
from _collections import deque  # collections/__init__.py is not needed for this

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Callable, Coroutine, Deque, Dict, Iterable, List, Optional, Set, Tuple

_PENDING, _DONE, _CANCELLED = 0, 1, 2
FIRST_COMPLETED = "FIRST_COMPLETED"
ALL_COMPLETED = "ALL_COMPLETED"

_running: Optional["Loop"] = None
_current_task: Optional["Task"] = None


class CancelledError(BaseException):
    """The awaiting task was cancelled (a BaseException, so ``except Exception`` does not swallow it)."""


class InvalidStateError(Exception):
    pass


def get_running_loop() -> "Loop":
    if _running is None:
        raise RuntimeError("no running event loop")
    return _running


def current_task() -> Optional["Task"]:
    return _current_task


class Handle:
    """A scheduled callback; ``cancel()`` stops it from running."""

    __slots__ = ("args", "cancelled", "fn", "when")

    def __init__(self, fn: Callable[..., Any], args: Tuple[Any, ...], when: float = 0.0) -> None:
        self.fn = fn
        self.args = args
        self.cancelled = False
        self.when = when

    def cancel(self) -> None:
        self.cancelled = True

    def __lt__(self, other: "Handle") -> bool:
        return self.when < other.when

    def run(self) -> None:
        if not self.cancelled:
            self.fn(*self.args)


class Future:
    """A result that arrives later; ``await fut`` suspends the calling task until it does."""

    def __init__(self, loop: Optional["Loop"] = None) -> None:
        self._loop = loop or get_running_loop()
        self._state = _PENDING
        self._result: Any = None
        self._exception: Optional[BaseException] = None
        self._callbacks: List[Callable[["Future"], Any]] = []

    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def result(self) -> Any:
        if self._state == _CANCELLED:
            raise CancelledError()
        if self._state == _PENDING:
            raise InvalidStateError("result is not ready")
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self) -> Optional[BaseException]:
        if self._state == _CANCELLED:
            raise CancelledError()
        if self._state == _PENDING:
            raise InvalidStateError("exception is not set")
        return self._exception

    def set_result(self, result: Any) -> None:
        if self._state != _PENDING:
            raise InvalidStateError("future already done")
        self._result = result
        self._finish(_DONE)

    def set_exception(self, exc: BaseException) -> None:
        if self._state != _PENDING:
            raise InvalidStateError("future already done")
        self._exception = exc
        self._finish(_DONE)

    def cancel(self) -> bool:
        if self._state != _PENDING:
            return False
        self._finish(_CANCELLED)
        return True

    def _finish(self, state: int) -> None:
        self._state = state
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            self._loop.call_soon(cb, self)

    def add_done_callback(self, fn: Callable[["Future"], Any]) -> None:
        if self._state != _PENDING:
            self._loop.call_soon(fn, self)
        else:
            self._callbacks.append(fn)

    def remove_done_callback(self, fn: Callable[["Future"], Any]) -> int:
        kept = [cb for cb in self._callbacks if cb != fn]
        removed = len(self._callbacks) - len(kept)
        self._callbacks = kept
        return removed

    def __await__(self) -> Any:
        if self._state == _PENDING:
            yield self
        return self.result()

    __iter__ = __await__


class Task(Future):
    """Drives a coroutine: each Future it awaits resumes it when done."""

    def __init__(self, coro: Coroutine[Any, Any, Any], loop: Optional["Loop"] = None) -> None:
        super().__init__(loop)
        self._coro = coro
        self._waiting: Optional[Future] = None
        self._cancel_requested = False
        self._loop.call_soon(self._step, None)

    def cancel(self) -> bool:
        if self.done():
            return False
        self._cancel_requested = True
        waiting = self._waiting
        if waiting is not None:
            self._waiting = None
            waiting.remove_done_callback(self._wakeup)
            self._loop.call_soon(self._step, None)
        return True

    def _wakeup(self, fut: Future) -> None:
        if self._waiting is fut:
            self._waiting = None
            self._step(None)

    def _step(self, _: Any) -> None:
        global _current_task
        if self.done():
            return
        exc: Optional[BaseException] = None
        if self._cancel_requested:
            self._cancel_requested = False
            exc = CancelledError()
        previous, _current_task = _current_task, self
        try:
            yielded = self._coro.throw(exc) if exc is not None else self._coro.send(None)
        except StopIteration as stop:
            self.set_result(stop.value)
        except CancelledError:
            Future.cancel(self)
        except BaseException as e:
            self.set_exception(e)
            if not isinstance(e, Exception):
                raise
        else:
            if isinstance(yielded, Future):
                self._waiting = yielded
                yielded.add_done_callback(self._wakeup)
            else:
                self._loop.call_soon(self._step, None)  # a bare yield: run again on the next turn
        finally:
            _current_task = previous


class Lock:
    """``async with lock``: one holder at a time, waiters served in order."""

    def __init__(self) -> None:
        self._locked = False
        self._waiters: Deque[Future] = deque()

    def locked(self) -> bool:
        return self._locked

    async def acquire(self) -> bool:
        if not self._locked and not self._waiters:
            self._locked = True
            return True
        fut = get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut in self._waiters:
                self._waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self._wake_next()  # the lock was handed to us as we were cancelled: pass it on
            raise
        return True

    def release(self) -> None:
        if not self._locked:
            raise RuntimeError("lock is not acquired")
        self._wake_next()

    def _wake_next(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(True)  # ownership passes directly: ``_locked`` stays True
                return
        self._locked = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *_: Any) -> None:
        self.release()


class Event:
    def __init__(self) -> None:
        self._set = False
        self._waiters: List[Future] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if not self._set:
            self._set = True
            for fut in self._waiters:
                if not fut.done():
                    fut.set_result(True)
            self._waiters = []

    async def wait(self) -> bool:
        if self._set:
            return True
        fut = get_running_loop().create_future()
        self._waiters.append(fut)
        return await fut


async def wait(
    futures: Iterable[Future],
    timeout: Optional[float] = None,  # noqa: ASYNC109 - the asyncio.wait signature
    return_when: str = ALL_COMPLETED,
) -> Tuple[Set[Future], Set[Future]]:
    """Wait for the futures (all, or the first with ``FIRST_COMPLETED``) or ``timeout``: (done, pending)."""
    fs = set(futures)
    loop = get_running_loop()

    def ready() -> bool:
        n = sum(1 for f in fs if f.done())
        return n == len(fs) or (return_when == FIRST_COMPLETED and n > 0)

    if not ready() and (timeout is None or timeout > 0):
        waiter = loop.create_future()

        def check(_: Any = None) -> None:
            if not waiter.done() and ready():
                waiter.set_result(None)

        def expire() -> None:
            if not waiter.done():
                waiter.set_result(None)

        timer = loop.call_later(timeout, expire) if timeout is not None else None
        for f in fs:
            f.add_done_callback(check)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            for f in fs:
                f.remove_done_callback(check)
    done = {f for f in fs if f.done()}
    return done, fs - done


def ensure_future(coro: Coroutine[Any, Any, Any]) -> Task:
    return get_running_loop().create_task(coro)


class Loop:
    """Ready queue, timer heap and a selector; signals and other threads wake it through a pipe."""

    def __init__(self) -> None:
        self._ready: Deque[Handle] = deque()
        self._timers: List[Handle] = []
        self._epoll = select.epoll()
        self._fds: Dict[int, List[Optional[Handle]]] = {}  # fd -> [reader, writer]
        self._signals: Dict[int, Handle] = {}
        self._old_handlers: Dict[int, Any] = {}
        self._threadsafe: Deque[Handle] = deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._old_wakeup_fd: Optional[int] = None

    # -- scheduling -------------------------------------------------------------------------------

    @staticmethod
    def time() -> float:
        return time.monotonic()

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> Handle:
        h = Handle(fn, args)
        self._ready.append(h)
        return h

    def call_at(self, when: float, fn: Callable[..., Any], *args: Any) -> Handle:
        h = Handle(fn, args, when)
        heapq.heappush(self._timers, h)
        return h

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> Handle:
        return self.call_at(self.time() + delay, fn, *args)

    def call_soon_threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        self._threadsafe.append(Handle(fn, args))
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass  # the pipe is full: the loop wakes up anyway

    def create_future(self) -> Future:
        return Future(self)

    def create_task(self, coro: Coroutine[Any, Any, Any]) -> Task:
        return Task(coro, self)

    def run_in_thread(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run blocking ``fn(*args)`` in a thread of its own; the future resolves on this loop."""
        fut = self.create_future()

        def settle(ok: bool, value: Any) -> None:
            if fut.done():
                return
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)

        def work() -> None:
            try:
                value, ok = fn(*args), True
            except BaseException as exc:  # handed to the awaiting task
                value, ok = exc, False
            self.call_soon_threadsafe(settle, ok, value)

        import threading  # not needed before the first blocking call

        threading.Thread(target=work, name="raas-ts-worker", daemon=True).start()
        return fut

    # -- file descriptors ---------------------------------------------------------------------------

    def _update(self, fd: int, slot: int, handle: Optional[Handle]) -> bool:
        entry = self._fds.get(fd)
        if entry is None:
            if handle is None:
                return False
            entry = [None, None]
            entry[slot] = handle
            self._epoll.register(fd, _events(entry))  # refused for regular files: raises
            self._fds[fd] = entry
            return False
        old = entry[slot]
        if old is not None:
            old.cancel()  # already picked up by this turn's select: it must not run after removal
        entry[slot] = handle
        if entry[0] is None and entry[1] is None:
            del self._fds[fd]
            self._epoll.unregister(fd)
        else:
            self._epoll.modify(fd, _events(entry))
        return old is not None

    def add_reader(self, fd: int, fn: Callable[..., Any], *args: Any) -> None:
        self._update(fd, 0, Handle(fn, args))

    def remove_reader(self, fd: int) -> bool:
        return self._update(fd, 0, None)

    def add_writer(self, fd: int, fn: Callable[..., Any], *args: Any) -> None:
        self._update(fd, 1, Handle(fn, args))

    def remove_writer(self, fd: int) -> bool:
        return self._update(fd, 1, None)

    # -- signals --------------------------------------------------------------------------------

    def add_signal_handler(self, sig: int, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn`` on the loop after ``sig`` arrives (the C handler only writes to the wake pipe)."""
        if self._old_wakeup_fd is None:
            self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w)
        self._signals[sig] = Handle(fn, args)
        old = signal.signal(sig, _ignore_signal)
        self._old_handlers.setdefault(sig, old)
        signal.siginterrupt(sig, False)

    def _read_wake_pipe(self) -> None:
        try:
            data = os.read(self._wake_r, 4096)
        except OSError:
            data = b""
        for sig in data:
            h = self._signals.get(sig)
            if h is not None:
                self._ready.append(Handle(h.fn, h.args))
        while self._threadsafe:
            self._ready.append(self._threadsafe.popleft())

    # -- running --------------------------------------------------------------------------------

    def _run_once(self) -> None:
        timeout: Optional[float] = None
        if self._ready or self._threadsafe:
            timeout = 0
        elif self._timers:
            timeout = max(0.0, self._timers[0].when - self.time())
        try:
            polled = self._epoll.poll(-1 if timeout is None else timeout, max(8, len(self._fds) + 1))
        except InterruptedError:
            polled = []
        for fd, events in polled:
            if fd == self._wake_r:
                self._read_wake_pipe()
                continue
            entry = self._fds.get(fd)
            if entry is None:
                continue
            # Errors and hang-ups wake both sides, as with selectors: the callback's read or write sees them.
            if events & ~select.EPOLLOUT and entry[0] is not None:
                self._ready.append(entry[0])
            if events & ~select.EPOLLIN and entry[1] is not None:
                self._ready.append(entry[1])
        if self._threadsafe:
            self._read_wake_pipe()
        now = self.time()
        while self._timers and self._timers[0].when <= now:
            h = heapq.heappop(self._timers)
            if not h.cancelled:
                self._ready.append(h)
        for _ in range(len(self._ready)):
            handle = self._ready.popleft()
            try:
                handle.run()
            except Exception:  # a bug in one callback must not take the server down (asyncio logs too)
                _report_callback_error(handle)

    def run_until_complete(self, coro: Coroutine[Any, Any, Any]) -> Any:
        global _running
        if _running is not None:
            raise RuntimeError("a loop is already running")
        _running = self
        try:
            task = self.create_task(coro)
            while not task.done():
                self._run_once()
            return task.result()
        finally:
            _running = None

    def close(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        if self._old_wakeup_fd is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
        self._epoll.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


def _events(entry: List[Optional[Handle]]) -> int:
    return (select.EPOLLIN if entry[0] is not None else 0) | (select.EPOLLOUT if entry[1] is not None else 0)


def _report_callback_error(handle: Handle) -> None:
    import sys
    import traceback

    sys.stderr.write("raas_toolserver: exception in callback %r:\n" % (handle.fn,))
    traceback.print_exc()
    sys.stderr.flush()


def _ignore_signal(*_: Any) -> None:
    """Installed as the Python-level handler: the loop dispatches the signal from the wake pipe."""


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    loop = Loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
