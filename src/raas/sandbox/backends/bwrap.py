"""The ``bwrap`` backend: bubblewrap, rootless, one set of namespaces per sandbox.

* ``--unshare-all`` (user, pid, net, ipc, uts, cgroup namespaces): no network unless
  ``config.network`` (then ``--share-net``); a PID namespace, so killing bwrap kills the whole tree.
* ``--die-with-parent``: the sandbox dies with the host process even when that is SIGKILLed.
* ``--uid 0 --gid 0``: fake root inside, the invoking user outside.
* Filesystem: with bwrap >= 0.10 the image is the lower layer of a tmpfs-backed overlay
  (``--overlay-src IMAGE --tmp-overlay /``), so everything is writable and changes vanish at close.
  Older bwrap (0.8 on Debian 12) has no overlay; the fallback is the image bound read-only plus
  writable places: the workspace (a host dir), and tmpfs on /tmp, /root, /run, /var/tmp. Installing
  packages inside then fails with a read-only error; use an image that has them. With overlay support,
  ``root_writes="host"`` backs the upper layer by ``<scratch>/overlay`` on disk instead of RAM.
* The tool-server bundle is bound read-only at ``/.raas/lib``, the run dir (socket) at ``/.raas/run``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

from raas.errors import RaasError
from raas.sandbox import procs
from raas.sandbox.base import INNER_LIB, INNER_RUN, SOCKET_NAME, LaunchSpec, Sandbox, parse_bind
from raas.sandbox.images import ensure_sandbox_dir
from raas.sandbox.limits import python_command, rlimit_args

INNER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Writable tmpfs dirs in the read-only fallback (only those the image has).
TMPFS_DIRS = ("/tmp", "/root", "/run", "/var/tmp")


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


class BwrapSandbox(Sandbox):
    """A bubblewrap sandbox over an unpacked root directory."""

    backend_name = "bwrap"
    exe: str | None = None
    overlay: bool | None = None
    rootfs: Path | None = None

    def prepare(self) -> None:
        if not self.config.image:
            raise RaasError(
                "the bwrap backend needs config.image (a rootfs dir or image source)", kind="bad_request"
            )
        self.exe = bwrap_binary()
        if self.overlay is None:
            self.overlay = bwrap_version(self.exe) >= (0, 10)
        self.rootfs = ensure_sandbox_dir(self.config.image)
        if not self.overlay:
            ensure_mount_points(self.rootfs, [INNER_LIB, INNER_RUN, self.config.workdir])
        elif self.config.root_writes == "host":
            for d in ("upper", "work"):
                (self.overlay_dir / d).mkdir(parents=True, exist_ok=True)

    def build_launch(self) -> LaunchSpec:
        cfg = self.config
        exe = self.exe or "bwrap"
        rootfs = str(self.rootfs or cfg.image)
        argv = [exe, "--unshare-all"]
        if cfg.network:
            argv.append("--share-net")
        argv += ["--die-with-parent", "--new-session", "--uid", "0", "--gid", "0", "--hostname", "raas"]
        if self.overlay and cfg.root_writes == "host":
            upper, work = self.overlay_dir / "upper", self.overlay_dir / "work"
            argv += ["--overlay-src", rootfs, "--overlay", str(upper), str(work), "/"]
        elif self.overlay:
            argv += ["--overlay-src", rootfs, "--tmp-overlay", "/"]
        else:
            argv += ["--ro-bind", rootfs, "/"]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        for d in TMPFS_DIRS:
            if d == "/tmp" or os.path.isdir(rootfs + d):
                argv += ["--tmpfs", d]
        if self.overlay:
            argv += ["--dir", INNER_LIB, "--dir", INNER_RUN]
        argv += ["--bind", str(self.workspace), cfg.workdir]
        argv += ["--ro-bind", str(self.bundle_dir), INNER_LIB, "--bind", str(self.run_dir), INNER_RUN]
        for spec in cfg.binds:
            host, dest, ro = parse_bind(spec)
            argv += ["--ro-bind" if ro else "--bind", host, dest]
        argv += ["--clearenv"]
        for k, v in inner_env(self.id, cfg.env).items():
            argv += ["--setenv", k, v]
        argv += ["--chdir", cfg.workdir, *cfg.extra_args, "--"]
        limits = rlimit_args(cfg.memory_mb, cfg.file_size_mb, cfg.max_procs)
        argv += python_command(
            cfg.python, "raas_toolserver", self.server_args(f"{INNER_RUN}/{SOCKET_NAME}", cfg.workdir), limits
        )
        return LaunchSpec(argv=argv, env={"PATH": os.environ.get("PATH", INNER_PATH)})


def ensure_mount_points(rootfs: Path, inner: list[str]) -> None:
    """A read-only root cannot grow bind targets at start: create them in the image once, or explain."""
    for p in inner:
        target = rootfs / p.lstrip("/")
        if target.is_dir():
            continue
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RaasError(
                f"image {rootfs} lacks the directory {p} and it cannot be created ({e}); "
                "build images with `raas image build` or create it in the image",
                kind="sandbox_start_failed",
            ) from e
