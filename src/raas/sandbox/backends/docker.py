"""The ``docker`` and ``podman`` backends: for users whose task images are Docker images.

Runs ``docker run --rm --init`` with the tool-server bundle and the run dir bound in; the container is
named after the sandbox id so close() can remove it even if the client process is gone
(``docker rm -f``). Limits map onto the engine's cgroups (``--memory``, ``--pids-limit``) and
``--ulimit fsize``; every capability is dropped and no_new_privs set (``--cap-drop ALL``,
``--security-opt no-new-privileges``). Disk and pty caps are the engine's business (``--storage-opt``
through ``extra_args`` where the storage driver supports it). The ready line arrives on the attached
stdout, as with every backend.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from raas.errors import RaasError
from raas.sandbox.backends.bwrap import INNER_PATH, inner_env
from raas.sandbox.base import INNER_LIB, INNER_RUN, SOCKET_NAME, LaunchSpec, Sandbox
from raas.sandbox.config import DockerSandboxConfig, parse_bind


class DockerSandbox(Sandbox):
    """A container run by the ``docker`` CLI (``podman`` speaks the same flags)."""

    config: DockerSandboxConfig
    backend_name = "docker"
    config_class = DockerSandboxConfig
    cli = "docker"

    @property
    def container_name(self) -> str:
        return f"raas-{self.id}"

    def image_ref(self) -> str:
        image = self.config.image or ""
        return image.removeprefix("docker://")

    def sandbox_dirs(self) -> list[Path]:
        return [self.run_dir, self.workspace]

    def prepare(self) -> None:
        if not self.config.image:
            raise RaasError(f"the {self.backend_name} backend needs config.image", kind="bad_request")
        if shutil.which(self.cli) is None:
            raise RaasError(f"{self.cli} is not installed", kind="sandbox_start_failed")

    def build_launch(self) -> LaunchSpec:
        cfg = self.config
        argv = [
            self.cli,
            "run",
            "--rm",
            "-i",
            "--init",
            "--name",
            self.container_name,
            "--label",
            f"raas.sandbox={self.id}",
            "--hostname",
            "raas",
            "--cap-drop",
            "ALL",
            "--security-opt",
            "no-new-privileges",
        ]
        argv += ["--network", "bridge" if cfg.network else "none"]
        argv += [
            "-v",
            f"{self.workspace}:{cfg.workdir}",
            "-v",
            f"{self.run_dir}:{INNER_RUN}",
            "-v",
            f"{self.bundle_dir}:{INNER_LIB}:ro",
            "-w",
            cfg.workdir,
        ]
        for spec in cfg.binds:
            host, dest, ro = parse_bind(spec)
            argv += ["-v", f"{host}:{dest}" + (":ro" if ro else "")]
        if cfg.memory_mb:
            argv += ["--memory", f"{cfg.memory_mb}m"]
        if cfg.max_procs:
            argv += ["--pids-limit", str(cfg.max_procs)]
        if cfg.file_size_mb:
            size = cfg.file_size_mb << 20
            argv += ["--ulimit", f"fsize={size}:{size}"]
        if os.geteuid() != 0 and self.cli == "podman":
            argv += ["--userns", "keep-id:uid=0,gid=0"]
        for k, v in inner_env(self.id, cfg.env).items():
            argv += ["-e", f"{k}={v}"]
        argv += [*cfg.extra_args, self.image_ref()]
        argv += self.boot_command(cfg.python, [], f"{INNER_RUN}/{SOCKET_NAME}", cfg.workdir)
        return LaunchSpec(
            argv=argv, env={"PATH": os.environ.get("PATH", INNER_PATH), "HOME": os.environ.get("HOME", "/")}
        )

    def _cleanup_sync(self) -> None:
        # The CLI process dying does not stop the container: remove it by name.
        if shutil.which(self.cli):
            subprocess.run(
                [self.cli, "rm", "-f", self.container_name], capture_output=True, check=False, timeout=60
            )
        super()._cleanup_sync()


class PodmanSandbox(DockerSandbox):
    backend_name = "podman"
    cli = "podman"
