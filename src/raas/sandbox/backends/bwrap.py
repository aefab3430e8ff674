"""The ``bwrap`` backend: bubblewrap, rootless, one set of namespaces per sandbox.

* Identity: the invoking user, or — when raas runs as root — a uid of the sandbox's own (see
  :mod:`raas.sandbox.identity`); bwrap always creates a user namespace (``--unshare-user``) in which that
  uid is root, and ``--disable-userns`` stops code inside from creating further ones.
* ``--unshare-all``: no network unless ``config.network`` (then ``--share-net``); a PID namespace in which
  the tool server is pid 1 (``--as-pid-1``): code inside can neither kill nor stop it.
* ``--die-with-parent``: the sandbox dies with the host process even when that is SIGKILLed.
* Filesystem: the image bound read-only at ``/``; ``/.raas`` is a read-only tmpfs holding the tool-server
  bundle (read-only), the run dir with the socket, and ``/.raas/rw``, where the boot step mounts the
  sandbox's writable area (a tmpfs capped at ``disk_mb``, or the host dir ``<scratch>/rw`` with
  ``root_writes="host"``) and binds it over the workdir, /tmp, /var/tmp, /root, /run and /dev/shm.
* Capabilities: bwrap hands the boot step the capabilities of the new user namespace (``--cap-add ALL``);
  it uses them for its mounts in a mount namespace of its own and drops them all before the tool server
  starts. The same command works with every bwrap from 0.8 on (no ``--overlay`` needed).
* Arguments go through ``--args FD``, so no host path shows up in any process's command line.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

from raas.errors import RaasError
from raas.sandbox import procs
from raas.sandbox.backends.namespace import NamespaceSandbox, ensure_mount_points
from raas.sandbox.base import INNER_AREA, INNER_LIB, INNER_RUN, SOCKET_NAME, LaunchSpec
from raas.sandbox.config import BwrapSandboxConfig, parse_bind
from raas.sandbox.images import ensure_sandbox_dir

INNER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@functools.cache
def bwrap_version(exe: str) -> tuple[int, ...]:
    """``bwrap --version`` as a tuple, e.g. (0, 8, 0); (0,) if it cannot be read."""
    try:
        out = subprocess.run(
            [exe, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return (0,)
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(x) for x in m.groups(default="0")) if m else (0,)


def bwrap_binary() -> str:
    exe = shutil.which("bwrap")
    if exe is None:
        raise RaasError("bubblewrap (bwrap) is not installed", kind="sandbox_start_failed")
    return exe


def inner_env(sandbox_id: str, extra: dict[str, str], home: str = "/root") -> dict[str, str]:
    """The environment inside a container sandbox (nothing leaks in from the host)."""
    env = {
        "PATH": INNER_PATH,
        "HOME": home,
        "LANG": "C.UTF-8",
        "PYTHONPATH": INNER_LIB,
        "PYTHONDONTWRITEBYTECODE": "1",
        procs.ENV_KEY: sandbox_id,
    }
    env.update(extra)
    env[procs.ENV_KEY] = sandbox_id
    return env


class BwrapSandbox(NamespaceSandbox):
    """A bubblewrap sandbox over an unpacked root directory."""

    config: BwrapSandboxConfig
    backend_name = "bwrap"
    config_class = BwrapSandboxConfig
    exe: str | None = None
    rootfs: Path | None = None

    def prepare(self) -> None:
        if not self.config.image:
            raise RaasError(
                "the bwrap backend needs config.image (a rootfs dir or image source)", kind="bad_request"
            )
        self.exe = bwrap_binary()
        if bwrap_version(self.exe) < (0, 8):
            raise RaasError("bubblewrap >= 0.8 is needed (--disable-userns)", kind="sandbox_start_failed")
        self.rootfs = ensure_sandbox_dir(self.config.image)
        dests = [parse_bind(b)[1] for b in self.config.binds]
        ensure_mount_points(self.rootfs, ["/.raas", self.config.workdir, *dests])
        self.check_visible(self.host_paths(self.rootfs))

    def build_launch(self) -> LaunchSpec:
        cfg = self.config
        argv = [self.exe or "bwrap", "--unshare-all"]
        if cfg.network:
            argv.append("--share-net")
        argv += ["--unshare-user", "--disable-userns", "--die-with-parent", "--new-session", "--as-pid-1"]
        argv += ["--uid", "0", "--gid", "0", "--hostname", "raas", "--cap-add", "ALL"]
        argv += ["--ro-bind", str(self.rootfs or cfg.image), "/", "--proc", "/proc", "--dev", "/dev"]
        for dest, host in cfg.seed.items():  # the boot step copies these instead of the image's dirs
            argv += ["--ro-bind", host, dest]
        argv += ["--tmpfs", "/.raas", "--dir", INNER_AREA, "--dir", INNER_LIB, "--dir", INNER_RUN]
        argv += ["--ro-bind", str(self.bundle_dir), INNER_LIB, "--bind", str(self.run_dir), INNER_RUN]
        if cfg.root_writes == "host":
            argv += ["--bind", str(self.area_dir), INNER_AREA]
        argv += ["--remount-ro", "/.raas"]
        for spec in cfg.binds:
            host, dest, ro = parse_bind(spec)
            argv += ["--ro-bind" if ro else "--bind", host, dest]
        argv += ["--clearenv"]
        for k, v in inner_env(self.id, cfg.env).items():
            argv += ["--setenv", k, v]
        argv += ["--chdir", "/", *cfg.extra_args, "--"]
        argv += self.boot_command(
            cfg.python, self.container_boot_args(), f"{INNER_RUN}/{SOCKET_NAME}", cfg.workdir
        )
        return LaunchSpec(argv=argv, env={}, args_via_fd=True)
