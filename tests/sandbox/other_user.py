"""Acting as another local user (uid 65534, "nobody") in the attack tests, the way that user would.

That user has its own PATH, not root's: a command is looked up only in the system's directories, never in
what root's PATH puts first (pyenv or conda shims, a venv, ``~/.cargo/bin`` in root's home), which another
user may not be allowed to execute. Each command is resolved once, and one the user cannot run fails the
test with a message saying so, not with an empty output further down.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

import pytest

NOBODY = 65534
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={"PATH": SYSTEM_PATH, "LC_ALL": "C"},
    )


@functools.cache
def system_command(name: str) -> str:
    """The absolute path of ``name`` in the system's directories that the other user can execute."""
    found = shutil.which(name, path=SYSTEM_PATH)
    if found is None:
        pytest.fail(f"no {name!r} in the system's directories ({SYSTEM_PATH}) for uid {NOBODY} to run")
    probe = [found, "-c", "print('ok')"] if name.startswith("python") else [found, "--version"]
    r = _run(probe)
    if r.returncode != 0:
        pytest.fail(
            f"uid {NOBODY} cannot execute {found} (exit {r.returncode}): {(r.stdout + r.stderr).strip()[:500]}"
        )
    return found


def as_nobody(command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (looked up as that user would) with ``args`` as uid/gid 65534, no groups."""
    return _run([system_command(command), *args])
