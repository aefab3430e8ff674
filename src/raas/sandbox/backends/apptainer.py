"""The ``apptainer`` backend (alias ``singularity``): rootless containers as HPC clusters run them.

``apptainer exec --containall --cleanenv --no-init`` over an unpacked image directory, read-only (no
``--writable-tmpfs``: all writes go to the sandbox's own capped area, set up by the boot step exactly as
for bwrap), with no network unless ``config.network`` (``--net --network none``). ``--no-init`` makes the
tool server pid 1 of the sandbox's PID namespace: code inside can neither kill nor stop it, and pid 1's
environment holds nothing of the host's.

The user namespace: as a normal user ``--fakeroot`` (uid 0 inside with the namespace's capabilities,
which the boot step uses and then drops; needs the user's /etc/subuid entry). As root, apptainer would map
uid 0 inside to the host's uid 0; instead raas runs it under the sandbox's own uid (see
:mod:`raas.sandbox.identity`) inside a user namespace of its own (``unshare --user --map-root-user``),
where apptainer runs with ``--userns``. SIF files and docker/OCI sources are converted once into the image
cache, since mounting a SIF with squashfuse costs ~0.6 s per start.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from raas.errors import RaasError
from raas.sandbox.backends.bwrap import INNER_PATH, inner_env
from raas.sandbox.backends.namespace import NamespaceSandbox, ensure_mount_points
from raas.sandbox.base import INNER_AREA, INNER_LIB, INNER_RUN, SOCKET_NAME, LaunchSpec
from raas.sandbox.config import ApptainerSandboxConfig, parse_bind
from raas.sandbox.images import apptainer_binary, ensure_sandbox_dir


class ApptainerSandbox(NamespaceSandbox):
    """An apptainer container over an unpacked sandbox directory."""

    config: ApptainerSandboxConfig
    backend_name = "apptainer"
    config_class = ApptainerSandboxConfig
    exe: str | None = None
    unshare: str | None = None
    rootfs: Path | None = None

    @property
    def home_dir(self) -> Path:
        """apptainer's own HOME (its config and cache dirs), private to the sandbox's uid."""
        return self.scratch / "home"

    def sandbox_dirs(self) -> list[Path]:
        return [*super().sandbox_dirs(), self.home_dir]

    def prepare(self) -> None:
        if not self.config.image:
            raise RaasError("the apptainer backend needs config.image", kind="bad_request")
        self.exe = apptainer_binary()
        if self.identity.dedicated:
            self.unshare = shutil.which("unshare")
            if self.unshare is None:
                raise RaasError("unshare (util-linux) is not installed", kind="sandbox_start_failed")
        self.rootfs = ensure_sandbox_dir(self.config.image)
        ensure_mount_points(self.rootfs, [INNER_LIB, INNER_RUN, INNER_AREA, self.config.workdir])
        self.check_visible(self.host_paths(self.rootfs))

    def build_launch(self) -> LaunchSpec:
        cfg = self.config
        argv: list[str] = []
        if self.identity.dedicated:
            argv += [self.unshare or "unshare", "--user", "--map-root-user", "--"]
        argv += [
            self.exe or "apptainer",
            "-s",
            "exec",
            "--containall",
            "--cleanenv",
            "--no-init",
            "--no-home",
        ]
        if not cfg.network:
            argv += ["--net", "--network", "none"]
        if self.identity.dedicated or not cfg.fakeroot:
            argv.append("--userns")
        else:
            argv.append("--fakeroot")
        argv += ["--pwd", "/"]
        argv += ["--bind", f"{self.run_dir}:{INNER_RUN}", "--bind", f"{self.bundle_dir}:{INNER_LIB}:ro"]
        if cfg.root_writes == "host":
            argv += ["--bind", f"{self.area_dir}:{INNER_AREA}"]
        for spec in cfg.binds:
            host, dest, ro = parse_bind(spec)
            argv += ["--bind", f"{host}:{dest}" + (":ro" if ro else "")]
        for dest, host in cfg.seed.items():  # the boot step copies these instead of the image's dirs
            argv += ["--bind", f"{host}:{dest}:ro"]
        argv += [*cfg.extra_args, str(self.rootfs or cfg.image)]
        argv += self.boot_command(
            cfg.python, self.container_boot_args(), f"{INNER_RUN}/{SOCKET_NAME}", cfg.workdir
        )
        # --cleanenv drops everything else; APPTAINERENV_* is the way in that keeps values intact.
        env = {"PATH": INNER_PATH, "HOME": str(self.home_dir), "LANG": "C.UTF-8"}
        for k, v in inner_env(self.id, cfg.env).items():
            env[f"APPTAINERENV_{k}"] = v
        return LaunchSpec(argv=argv, env=env)
