"""The ``local`` backend: the tool server as a plain host process in its own workspace dir.

No isolation at all (trusted tasks and development); it is the fastest backend and the baseline the
others are measured against. The server runs on the host's own Python with the tool-server bundle on
``PYTHONPATH``; the workspace is a private host dir (mode 0700), so ``config.workdir`` is ignored, and only
the resource limits (RLIMITs) of the config apply: no disk, pty or capability confinement.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from raas.sandbox.base import LaunchSpec, Sandbox, setpriv_path
from raas.sandbox.config import LocalSandboxConfig

# Host variables worth keeping (locale, temp dir); everything else is dropped for reproducibility.
PASS_ENV = ("LANG", "LC_ALL", "LC_CTYPE", "TZ")


class LocalSandbox(Sandbox):
    """Host process, own session and workspace; dies with its parent where ``setpriv`` exists."""

    config: LocalSandboxConfig
    backend_name = "local"
    config_class = LocalSandboxConfig

    def sandbox_dirs(self) -> list[Path]:
        return [self.run_dir, self.workspace, self.home]

    def run_dir_inside(self) -> str:
        return str(self.run_dir)  # no root of its own: the host path is the path

    def workdir_inside(self) -> str:
        return str(self.workspace)

    def build_launch(self) -> LaunchSpec:
        cfg = self.config
        env = {k: os.environ[k] for k in PASS_ENV if k in os.environ}
        env.update(
            PATH=os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            HOME=str(self.home),
            TMPDIR=str(self.home),
            PYTHONPATH=str(self.bundle_dir),
            PYTHONDONTWRITEBYTECODE="1",
        )
        env.update(cfg.env)
        argv = self.boot_command(
            sys.executable, self.rlimit_args(), str(self.socket_path), str(self.workspace)
        )
        setpriv = setpriv_path()
        if setpriv:
            # If the host process dies without running any cleanup, the server dies with it.
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        return LaunchSpec(argv=argv, env=env, cwd=str(self.workspace))
