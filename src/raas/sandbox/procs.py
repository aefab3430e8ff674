"""Finding and killing the processes of one sandbox through /proc.

Every process raas starts for a sandbox carries ``RAAS_SANDBOX_ID=<id>`` in its environment (inherited
by everything it spawns), so a sandbox's processes can be found even after they left its process group
or session (bash on a pty runs in its own session), and a crashed run's leftovers can be told apart
from everyone else's. A pid alone is never trusted: it is checked together with its start time.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Iterator
from pathlib import Path

ENV_KEY = "RAAS_SANDBOX_ID"


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _read_proc(path: str) -> bytes | None:
    """The whole of a /proc file, read with plain system calls (no buffered file object: these are read
    for every process on the machine when a sandbox closes)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        chunks: list[bytes] = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)


def _environ_lookup(data: bytes, prefix: bytes) -> bytes | None:
    """The value of the first ``prefix`` (``KEY=``) entry of a NUL-separated environment block."""
    if data.startswith(prefix):
        start = len(prefix)
    else:
        at = data.find(b"\0" + prefix)
        if at < 0:
            return None
        start = at + 1 + len(prefix)
    end = data.find(b"\0", start)
    return data[start:] if end < 0 else data[start:end]


# A process in the middle of execve shows an empty /proc/PID/environ for a moment (its new memory map has
# no environment yet): a process that execs in a loop reads as empty about a fifth of the time. A scan that
# took that for "no environment" would miss a sandbox's process that happens to be exec-ing, and a sandbox
# could use that to outlive its close. An empty read is therefore read again a few times, shortly after,
# unless the process cannot be exec-ing (gone, a zombie, a kernel thread). /proc/PID/stat's env_start and
# env_end cannot tell an exec-ing process from one started with an empty environment: execve sets them
# equal while it copies the environment in. A process whose environment really is empty costs a scan
# those ~15 ms of waiting (once per scan, however many there are).
_EMPTY_RETRY_S = (0.0, 0.0005, 0.001, 0.001, 0.002, 0.002, 0.004, 0.004)


def _cannot_be_exec_ing(pid: int) -> bool:
    data = _read_proc(f"/proc/{pid}/stat")
    if not data:
        return True  # gone
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 2 or fields[0] in (b"Z", b"X"):
        return True
    return pid == 2 or fields[1] == b"2"  # kthreadd and its kernel threads


def _environ_blocks(pids: list[int]) -> Iterator[tuple[int, bytes]]:
    """``(pid, environment block)`` for each readable process; empty blocks are read again (see above)."""
    pending = pids
    for delay in (0.0, *_EMPTY_RETRY_S):  # the first read, then the re-reads of what came back empty
        if not pending:
            return
        if delay:
            time.sleep(delay)
        empty = []
        for pid in pending:
            data = _read_proc(f"/proc/{pid}/environ")
            if data:
                yield pid, data
            elif data is not None and not _cannot_be_exec_ing(pid):
                empty.append(pid)
        pending = empty


def environ_value(pid: int, key: str = ENV_KEY) -> str | None:
    """The value of ``key`` in the environment ``pid`` was started with, None if absent/unreadable."""
    for _, data in _environ_blocks([pid]):
        value = _environ_lookup(data, key.encode() + b"=")
        return None if value is None else value.decode(errors="replace")
    return None


def all_pids() -> Iterator[int]:
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                yield int(name)


def pids_with_env(value: str, key: str = ENV_KEY) -> list[int]:
    """Pids (other than ours) whose environment has ``key=value``; only our uid's unless we are root."""
    me = os.getpid()
    uid = os.geteuid()
    prefix = key.encode() + b"="
    wanted = value.encode()
    candidates = []
    for pid in all_pids():
        if pid == me:
            continue
        if uid != 0:
            try:
                if os.stat(f"/proc/{pid}").st_uid != uid:
                    continue
            except OSError:
                continue
        candidates.append(pid)
    # Cheap test first: almost no process on the machine has the value anywhere in its environment.
    return [
        pid
        for pid, data in _environ_blocks(candidates)
        if wanted in data and _environ_lookup(data, prefix) == wanted
    ]


def pids_with_env_prefix(prefix: str, key: str = ENV_KEY) -> dict[int, str]:
    """Pids whose ``key`` value starts with ``prefix`` (leak checks), mapped to that value."""
    out: dict[int, str] = {}
    me = os.getpid()
    lookup = key.encode() + b"="
    for pid, data in _environ_blocks([p for p in all_pids() if p != me]):
        raw = _environ_lookup(data, lookup)
        value = None if raw is None else raw.decode(errors="replace")
        if value is not None and value.startswith(prefix):
            out[pid] = value
    return out


def is_same_process(pid: int, started: int | None, sandbox_id: str | None = None) -> bool:
    """True when ``pid`` is still the process recorded as (pid, start time[, sandbox id])."""
    if started is None or start_time(pid) != started:
        return False
    return sandbox_id is None or environ_value(pid) == sandbox_id


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def killpg_quietly(pgid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Block until the processes have exited (pidfds turn readable; no polling loop); returns stragglers.

    A SIGKILLed process can take a while to finish exiting (unmounting a container's filesystems), and
    until then it still shows up in /proc with its environment.
    """
    fds: dict[int, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            fds[os.pidfd_open(pid)] = pid
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        pending = set(fds)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(left * 1000):
                pending.discard(fd)
                poller.unregister(fd)
        return sorted(fds[fd] for fd in pending)
    finally:
        for fd in fds:
            os.close(fd)


def kill_by_env(value: str, rounds: int = 5, wait_s: float = 10.0) -> int:
    """SIGKILL every process tagged with sandbox id ``value`` and wait until they are gone; repeat so
    late forks are caught too.

    Stopping first means a process cannot fork between being found and being killed.
    Returns how many distinct processes were signalled.
    """
    seen: set[int] = set()
    for _ in range(rounds):
        pids = pids_with_env(value)
        if not pids:
            break
        for pid in pids:
            kill_quietly(pid, signal.SIGSTOP)
        for pid in pids:
            kill_quietly(pid, signal.SIGKILL)
        wait_gone(pids, wait_s)
        seen.update(pids)
    return len(seen)


def mounts_under(path: str | Path) -> list[str]:
    """Mount points in our mount namespace at or below ``path`` (leak checks, stale build dirs)."""
    root = os.path.realpath(path)
    out = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            mnt = line.split()[4].replace("\\040", " ")
            if mnt == root or mnt.startswith(root.rstrip("/") + "/"):
                out.append(mnt)
    return out
