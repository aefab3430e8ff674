"""The interpreter's installed packages, found without running :mod:`site` at start-up.

Sandboxes start the tool server with ``python3 -S``: processing the site directories and their ``.pth``
files costs about as much CPU as the rest of the server's start-up, and only the IPython tool needs a
package from there (``jupyter_client``). :func:`load_site` does that work on its first use instead.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Optional

IPYTHON_PACKAGES = ("jupyter_client", "ipykernel", "zmq")

_available: Optional[bool] = None
_site_loaded = False


def site_dirs() -> List[str]:
    """Site-packages dirs the interpreter would use: the system ones and, in a venv, the venv's."""
    import site

    dirs = list(site.getsitepackages())
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    for venv in (exe_dir, os.path.dirname(exe_dir)):
        if os.path.isfile(os.path.join(venv, "pyvenv.cfg")):
            dirs = list(site.getsitepackages([venv])) + dirs
            break
    return dirs


def load_site() -> None:
    """What ``python3`` without ``-S`` does at start-up (venvs, ``.pth`` files), once.

    Never the user site dir: it lies in the sandbox's writable ``$HOME``, where code in the sandbox could
    plant a ``.pth`` file that this process would then execute."""
    global _site_loaded
    if _site_loaded:
        return
    _site_loaded = True
    if sys.flags.no_site:
        import site

        site.ENABLE_USER_SITE = False
        site.main()


def ipython_available() -> bool:
    """Whether this interpreter can drive and run a kernel (checked once, without importing anything)."""
    global _available
    if _available is None:
        paths = [p for p in sys.path if p] + (site_dirs() if sys.flags.no_site else [])
        _available = all(_findable(name, paths) for name in IPYTHON_PACKAGES)
    return _available


def _findable(name: str, paths: List[str]) -> bool:
    for base in paths:
        if os.path.isdir(os.path.join(base, name)) or os.path.isfile(os.path.join(base, name + ".py")):
            return True
    return False
