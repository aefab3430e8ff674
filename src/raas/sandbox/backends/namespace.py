"""What bwrap and apptainer share: raas builds the sandbox's filesystem itself, inside its own namespaces.

Both hand the boot step (``raas_toolserver.boot``) the same options: it mounts the writable area (a tmpfs
capped at ``disk_mb``, or the host dir ``<scratch>/rw`` with ``root_writes="host"``), binds it over the
workdir, the ``writable`` dirs and /tmp, /var/tmp, /root, /run, /dev/shm, copies the image's (or the
seed's) contents into them, gives the sandbox a devpts of ``max_ptys``, makes every other mount read-only
and drops every capability before the tool server starts. Docker and podman leave all of that to the
engine, so their config has none of these fields.
"""

from __future__ import annotations

from pathlib import Path

from raas.errors import RaasError
from raas.sandbox.base import INNER_AREA, INNER_RUN, SOCKET_NAME, Sandbox
from raas.sandbox.config import WRITABLE_DIRS, ApptainerSandboxConfig, BwrapSandboxConfig, parse_bind


class NamespaceSandbox(Sandbox):
    """A sandbox whose writable area, ptys and seeds raas's boot step sets up (bwrap, apptainer)."""

    config: BwrapSandboxConfig | ApptainerSandboxConfig
    dedicated_identity = True
    supports_seed = True

    @property
    def area_dir(self) -> Path:
        """Host dir that is the sandbox's writable area when ``root_writes="host"``."""
        return self.scratch / "rw"

    def area_path(self, inner: str) -> Path | None:
        cfg = self.config
        if cfg.root_writes != "host":
            return None
        if inner == cfg.workdir:
            return self.area_dir / "ws"
        if inner in cfg.writable:
            return self.area_dir / f"w{cfg.writable.index(inner)}"
        return None

    def sandbox_dirs(self) -> list[Path]:
        dirs = super().sandbox_dirs()
        if self.config.root_writes == "host":
            dirs.append(self.area_dir)
        return dirs

    def host_paths(self, rootfs: Path) -> list[Path]:
        """Host paths the runtime must reach as the sandbox's uid: image, bundle, bind and seed sources."""
        cfg = self.config
        return [
            rootfs,
            self.bundle_dir,
            *(Path(parse_bind(b)[0]) for b in cfg.binds),
            *(Path(h) for h in cfg.seed.values()),
        ]

    def check_visible(self, paths: list[Path]) -> None:
        """With a dedicated uid the runtime cannot enter root's private dirs: say so before it fails."""
        if not self.identity.dedicated:
            return
        from raas.sandbox.identity import traversable_by_others

        for p in paths:
            if not traversable_by_others(p):
                raise RaasError(
                    f"{p} is not reachable by the sandbox's uid {self.identity.uid} (a parent directory lacks "
                    "o+x); keep images, the state dir and bind sources in world-traversable directories "
                    "(e.g. RAAS_IMAGE_CACHE=/var/cache/raas/images)",
                    kind="sandbox_start_failed",
                )

    def container_boot_args(self, *, area_mount_point: str = INNER_AREA) -> list[str]:
        """Boot options: writable area, ptys, socket, read-only rest, no caps."""
        cfg = self.config
        args = ["--mount-ns", "--area", area_mount_point]
        if cfg.root_writes == "tmpfs" and cfg.disk_mb is not None:
            args += ["--disk-mb", str(cfg.disk_mb)]
        args += ["--bind", f"ws:{cfg.workdir}", "--populate", cfg.workdir]
        for i, path in enumerate(cfg.writable):
            args += ["--bind", f"w{i}:{path}", "--populate", path]
        if not self.identity.dedicated:  # seeds are the service user's files: root inside, overlay-able
            for dest in cfg.seed:
                args += ["--overlay", dest]
        for dest in WRITABLE_DIRS:
            args += ["--bind-if", f"{dest.strip('/').replace('/', '-')}:{dest}"]
        args += ["--ptys", str(cfg.max_ptys), "--listen", f"{INNER_RUN}/{SOCKET_NAME}", "--readonly-rest"]
        return [*args, *self.rlimit_args(), "--drop-caps"]


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
