"""Removing host dirs whose owning process died without cleaning up (it was SIGKILLed).

Several parts of raas name a temp dir after the pid of the process that owns it (tool-server bundles,
embedded model servers, vLLM launcher logs) and remove it on a clean exit; a process killed outright
leaves it behind, and the next run sweeps it with :func:`reap_dead_owner_dirs`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path


def reap_dead_owner_dirs(
    paths: Iterable[Path],
    owner_pid: Callable[[Path], str],
    remove: Callable[[Path], object] = lambda p: shutil.rmtree(p, ignore_errors=True),
) -> list[Path]:
    """Remove (with ``remove``) each dir of ``paths`` whose owner (``owner_pid(path)``, a pid as text) no
    longer exists.

    Dirs of this process, of live processes, of processes this user may not signal (another user's
    still-running owner), and with an unreadable owner are kept; returns what was removed."""
    removed = []
    for path in paths:
        owner = owner_pid(path)
        if not owner.isdigit() or int(owner) == os.getpid():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            remove(path)
            removed.append(path)
        except PermissionError:
            continue
    return removed
