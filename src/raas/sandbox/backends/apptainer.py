"""The ``apptainer`` backend (alias ``singularity``): rootless containers as HPC clusters run them.

``apptainer exec --containall --no-home --writable-tmpfs`` (PID/IPC namespaces, clean env, a
throw-away writable layer in RAM; ``root_writes="host"`` puts it in ``--overlay <scratch>/overlay`` on disk
instead, for tasks that install a lot), ``--net --network none`` unless ``config.network``. The user namespace:
as an unprivileged user ``--fakeroot`` (uid 0 inside; needs /etc/subuid) when ``config.fakeroot``;
as root ``--userns`` (root inside anyway; without it apptainer asks for capabilities that many VMs
withhold). The image is an unpacked directory: SIF files and docker/OCI sources are converted once
into the image cache, since mounting a SIF with squashfuse costs ~0.6 s per start.
"""

from __future__ import annotations

import os
from pathlib import Path

from raas.errors import RaasError
from raas.sandbox.backends.bwrap import INNER_PATH, ensure_mount_points, inner_env
from raas.sandbox.base import INNER_LIB, INNER_RUN, SOCKET_NAME, LaunchSpec, Sandbox, parse_bind
from raas.sandbox.images import apptainer_binary, ensure_sandbox_dir
from raas.sandbox.limits import python_command, rlimit_args


class ApptainerSandbox(Sandbox):
    """An apptainer container over an unpacked sandbox directory."""

    backend_name = "apptainer"
    exe: str | None = None
    rootfs: Path | None = None
    as_root: bool | None = None

    def prepare(self) -> None:
        if not self.config.image:
            raise RaasError("the apptainer backend needs config.image", kind="bad_request")
        self.exe = apptainer_binary()
        self.rootfs = ensure_sandbox_dir(self.config.image)
        ensure_mount_points(self.rootfs, [INNER_LIB, INNER_RUN, self.config.workdir])
        if self.config.root_writes == "host":
            self.overlay_dir.mkdir(parents=True, exist_ok=True)

    def build_launch(self) -> LaunchSpec:
        cfg = self.config
        as_root = os.geteuid() == 0 if self.as_root is None else self.as_root
        argv = [self.exe or "apptainer", "-s", "exec", "--containall", "--no-home"]
        if cfg.root_writes == "host":
            argv += ["--overlay", str(self.overlay_dir)]  # writes land on disk, not in RAM
        else:
            argv.append("--writable-tmpfs")
        if not cfg.network:
            argv += ["--net", "--network", "none"]
        if as_root:
            argv.append("--userns")
        elif cfg.fakeroot:
            argv.append("--fakeroot")
        argv += [
            "--pwd",
            cfg.workdir,
            "--bind",
            f"{self.workspace}:{cfg.workdir}",
            "--bind",
            f"{self.run_dir}:{INNER_RUN}",
            "--bind",
            f"{self.bundle_dir}:{INNER_LIB}:ro",
        ]
        for spec in cfg.binds:
            host, dest, ro = parse_bind(spec)
            argv += ["--bind", f"{host}:{dest}" + (":ro" if ro else "")]
        argv += [*cfg.extra_args, str(self.rootfs or cfg.image)]
        limits = rlimit_args(cfg.memory_mb, cfg.file_size_mb, cfg.max_procs)
        argv += python_command(
            cfg.python, "raas_toolserver", self.server_args(f"{INNER_RUN}/{SOCKET_NAME}", cfg.workdir), limits
        )
        # --containall cleans the environment; APPTAINERENV_* is the way in that survives it and
        # keeps values with commas intact (unlike --env).
        env = {"PATH": os.environ.get("PATH", INNER_PATH), "HOME": os.environ.get("HOME", "/")}
        for k, v in inner_env(self.id, cfg.env).items():
            env[f"APPTAINERENV_{k}"] = v
        return LaunchSpec(argv=argv, env=env)
