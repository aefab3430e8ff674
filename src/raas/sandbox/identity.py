"""Who a sandbox runs as on the host, and private directories nobody else can tamper with.

Run as a normal user, a container sandbox maps uid 0 inside to that user outside. Run as root, raas never
lets uid 0 inside be uid 0 outside: a process that is host uid 0 may write host sysctls under /proc/sys
and files of root without holding any capability. Instead each sandbox gets a **uid of its own** from a
range reserved for raas (``RAAS_SANDBOX_UIDS=START:COUNT``; default: root's range in /etc/subuid, else
1610612736:65536), taken with an exclusive lock so concurrent services never share one. Because the uid
is the sandbox's alone, ``RLIMIT_NPROC`` caps that sandbox's processes exactly, and closing it can kill
every process of that uid, including ones that dropped the sandbox's environment tag.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import stat
from dataclasses import dataclass, field
from pathlib import Path

from raas.errors import RaasError
from raas.sandbox import procs

DEFAULT_UID_RANGE = (1_610_612_736, 65_536)
LOCK_DIR = Path("/run/raas-sandbox-uids")


@dataclass
class SandboxIdentity:
    """The host uid/gid a sandbox's runtime runs as; ``dedicated`` when raas allocated it (root)."""

    uid: int
    gid: int
    dedicated: bool = False
    _lock_fd: int | None = field(default=None, repr=False)

    def release(self) -> None:
        """Kill whatever still runs as the dedicated uid, then give the uid back. Idempotent."""
        if self._lock_fd is None:
            return
        kill_uid(self.uid)
        os.close(self._lock_fd)
        self._lock_fd = None


def uid_range() -> tuple[int, int]:
    """(start, count) of the uids raas may give sandboxes when it runs as root."""
    env = os.environ.get("RAAS_SANDBOX_UIDS")
    if env:
        try:
            start_s, count_s = env.split(":")
            start, count = int(start_s), int(count_s)
        except ValueError:
            raise RaasError(
                f"RAAS_SANDBOX_UIDS must be START:COUNT, got {env!r}", kind="bad_request"
            ) from None
        if start < 1000 or count < 1 or start + count > 2**32 - 2:
            raise RaasError(f"RAAS_SANDBOX_UIDS {env!r} is not a usable uid range", kind="bad_request")
        return start, count
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/etc/subuid").read_text().splitlines():
            name, start_s, count_s = line.strip().split(":")
            if name in ("root", "0"):
                return int(start_s), int(count_s)
    return DEFAULT_UID_RANGE


def current_identity() -> SandboxIdentity:
    return SandboxIdentity(os.getuid(), os.getgid())


def allocate_identity() -> SandboxIdentity:
    """As root, a dedicated uid (locked until released); otherwise the calling user."""
    if os.geteuid() != 0:
        return current_identity()
    start, count = uid_range()
    make_private_dir(LOCK_DIR, 0o700)
    offset = random.randrange(count)
    for i in range(count):
        uid = start + (offset + i) % count
        fd = os.open(LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return SandboxIdentity(uid, uid, dedicated=True, _lock_fd=fd)
    raise RaasError(
        f"all {count} sandbox uids from {start} are in use; raise RAAS_SANDBOX_UIDS",
        kind="sandbox_start_failed",
    )


def kill_uid(uid: int) -> int:
    """SIGKILL every process whose real uid is ``uid`` (only ever a dedicated sandbox uid)."""
    if uid == 0 or uid == os.getuid():
        return 0
    killed = []
    for pid in procs.all_pids():
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                procs.kill_quietly(pid, signal.SIGKILL)
                killed.append(pid)
        except OSError:
            continue
    if killed:
        procs.wait_gone(killed, 10.0)
    return len(killed)


def make_private_dir(path: Path, mode: int = 0o700) -> Path:
    """Create ``path`` with ``mode``, or accept it only if it is a real directory we own that nobody else
    can write to: another local user must not be able to plant or swap our directories."""
    try:
        os.mkdir(path, mode)
        os.chmod(path, mode)  # not subject to the umask
        return path
    except FileExistsError:
        pass
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "it is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "it is not a directory"
    elif st.st_uid != os.geteuid():
        problem = f"it is owned by uid {st.st_uid}, not by us (uid {os.geteuid()})"
    elif st.st_mode & 0o022:
        problem = f"others can write to it (mode {stat.S_IMODE(st.st_mode):o})"
    if problem:
        raise RaasError(
            f"refusing to use {path}: {problem}; remove it or point raas at another directory",
            kind="sandbox_start_failed",
        )
    return path


def make_fresh_dir(path: Path, mode: int) -> Path:
    """Create a directory that must not exist yet (a new sandbox's): an existing one is an attack or a bug."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        raise RaasError(f"refusing to use {path}: it already exists", kind="sandbox_start_failed") from None
    os.chmod(path, mode)
    return path


def traversable_by_others(path: Path) -> bool:
    """True when every directory from / down to ``path`` lets other users through (o+x)."""
    p = Path(os.path.abspath(path))
    for d in [p, *p.parents]:
        try:
            if not os.stat(d).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True
