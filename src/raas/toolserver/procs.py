"""Process hygiene: become a subreaper, reap children, find and kill descendants via /proc.

Every process a sandbox starts must end with the server; orphaned grandchildren (``cmd &``, ``setsid``,
double forks) are re-parented to the server as a child subreaper, so walking the parent links from
our own pid finds all of them.
"""

from __future__ import annotations

import _signal as signal  # the C module: signal.py imports enum, which costs a large part of start-up
import os
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes  # absent from some minimal images: then we simply go without

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (ImportError, OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Best effort: orphans of our descendants get re-parented to us instead of to init."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Best effort: get ``sig`` when the process that started us goes away."""
    return _prctl(PR_SET_PDEATHSIG, int(sig))


def _read_stat(pid: int) -> Optional[List[str]]:
    """Fields of /proc/PID/stat after the command name (state is index 0, ppid 1, pgrp 2, sid 3)."""
    # Plain system calls, no file object: this runs for every process in sight when a session closes.
    try:
        fd = os.open("/proc/%d/stat" % pid, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)  # one read: the kernel formats the whole line at once
    except OSError:
        return None
    finally:
        os.close(fd)
    end = data.rfind(b")")
    if end < 0:
        return None
    return data[end + 2 :].decode("ascii", "replace").split()


def process_table() -> Dict[int, List[str]]:
    table: Dict[int, List[str]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if name.isdigit():
            stat = _read_stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


def descendants(root: int, table: Optional[Dict[int, List[str]]] = None) -> Set[int]:
    """All live processes whose parent chain reaches ``root`` (zombies excluded)."""
    if table is None:
        table = process_table()
    children: Dict[int, List[int]] = {}
    for pid, stat in table.items():
        children.setdefault(int(stat[1]), []).append(pid)
    found: Set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return {pid for pid in found if table[pid][0] != "Z"}


def session_members(sid: int, table: Optional[Dict[int, List[str]]] = None) -> Set[int]:
    """Live processes in terminal session ``sid`` (a bash on a pty and all of its jobs)."""
    if table is None:
        table = process_table()
    return {pid for pid, stat in table.items() if int(stat[3]) == sid and stat[0] != "Z"}


def kill_all(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        if pid > 1 and pid != os.getpid():
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def kill_tree(root: int, include_root: bool = True) -> None:
    """SIGKILL the session led by ``root`` and, while ``root`` is ours (not yet reaped), it and its descendants."""
    table = process_table()
    targets = session_members(root, table)
    if include_root:
        targets |= descendants(root, table) | {root}
    kill_all(targets)


class Reaper:
    """Reaps every exited child (we are a subreaper) and hands exit statuses to whoever waits on a pid."""

    def __init__(self) -> None:
        self._watchers: Dict[int, Callable[[int], None]] = {}

    def watch(self, pid: int, callback: Callable[[int], None]) -> None:
        """Call ``callback(returncode)`` once ``pid`` has exited.

        Register right after starting the child, in the same loop iteration: reaping runs as an event
        loop callback, so it cannot collect the child in between.
        """
        self._watchers[pid] = callback

    def unwatch(self, pid: int) -> None:
        self._watchers.pop(pid, None)

    def reap(self) -> None:
        for pid, status in _exited_children():
            callback = self._watchers.pop(pid, None)
            if callback is not None:
                callback(_returncode(status))


def find_bash() -> Optional[str]:
    if os.access("/bin/bash", os.X_OK):
        return "/bin/bash"
    import shutil

    return shutil.which("bash")


def _returncode(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return -1


def _children(pid: int) -> Optional[List[int]]:
    """Children of ``pid`` from ``/proc/PID/task/TID/children`` (every thread's); None where that is missing."""
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return []  # gone
    out: List[int] = []
    for tid in tids:
        try:
            fd = os.open("/proc/%d/task/%s/children" % (pid, tid), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if tid == str(pid) and os.path.isdir("/proc/%d/task/%s" % (pid, tid)):
                return None  # a kernel without CONFIG_PROC_CHILDREN
            continue
        except OSError:
            continue
        try:
            data = b""
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            data = b""
        finally:
            os.close(fd)
        out.extend(int(x) for x in data.split())
    return out


def descendants_walk(root: int) -> Optional[Set[int]]:
    """Live descendants of ``root`` found by walking down from it: reads a few files per descendant instead
    of one per process on the machine. It can miss a process forked while it reads; None where the kernel
    does not offer the ``children`` files."""
    found: Set[int] = set()
    stack = [root]
    while stack:
        children = _children(stack.pop())
        if children is None:
            return None
        for child in children:
            if child not in found:
                found.add(child)
                stack.append(child)
    live = set()
    for pid in found:
        stat = _read_stat(pid)
        if stat is not None and stat[0] != "Z":
            live.add(pid)
    return live


def kill_descendants_and_wait(deadline_s: float = 3.0) -> None:
    """Kill every descendant of this process and reap them, until none is left or the deadline passes.

    Done when a scan of all of /proc finds none; the cheap walk down our own tree finds them until then."""
    me = os.getpid()
    end = time.monotonic() + deadline_s
    while True:
        left = descendants_walk(me)
        if not left:
            left = descendants(me)
            if not left:
                break
        kill_all(left)
        _reap_nowait()
        if time.monotonic() > end:
            break
        # Shutdown path only: give SIGKILLed processes a moment to turn into reapable zombies.
        time.sleep(0.005)
    _reap_nowait()


def _exited_children() -> Iterator[Tuple[int, int]]:
    """``(pid, status)`` of every child that has exited, without blocking."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        except InterruptedError:
            continue
        if pid == 0:
            return
        yield pid, status


def _reap_nowait() -> None:
    for _ in _exited_children():
        pass
