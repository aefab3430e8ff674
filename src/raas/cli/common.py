"""What the ``raas`` commands share: the console, error reporting, and the sandbox choice."""

from __future__ import annotations

import os
import shutil
from typing import Any

import typer
from rich.console import Console

from raas.errors import RaasError

console = Console(stderr=True)

DEFAULT_SERVER = "http://127.0.0.1:8008"
MATH_IMAGE_PACKAGES = ("python3", "python3-ipykernel", "python3-jupyter-client")
"""What the math task needs inside a Debian sandbox image (IPython kernel for the ``ipython`` tool)."""


def fail(exc: RaasError) -> typer.Exit:
    """Print a typed error and the exit status for it (2 for bad input, 1 otherwise)."""
    console.print(f"[red]error[/red] ({exc.kind}): {exc.message}")
    return typer.Exit(2 if exc.kind == "bad_request" else 1)


def choose_sandbox(backend: str, image: str | None) -> dict[str, Any]:
    """The default sandbox fields for the service: bwrap with the math image when this machine can run it
    (building the image once if needed), else ``local``."""
    if backend == "local":
        return {"backend": "local"}
    if backend not in ("auto", "bwrap", "apptainer"):
        return {"backend": backend, **({"image": image} if image else {})}
    if image:
        return {"backend": "bwrap" if backend == "auto" else backend, "image": image}
    from raas.sandbox.images import ImageSpec, build_rootfs, rootfs_path

    spec = ImageSpec(packages=MATH_IMAGE_PACKAGES)
    built = (rootfs_path(spec) / "usr").is_dir()
    can_build = os.geteuid() == 0 and shutil.which("debootstrap") is not None
    if backend == "auto" and (shutil.which("bwrap") is None or not (built or can_build)):
        console.print(
            "[yellow]bwrap or a sandbox image is unavailable: using the 'local' sandbox "
            "(no isolation)[/yellow]"
        )
        return {"backend": "local"}
    if not built:
        with console.status("building the sandbox image once (debootstrap, about two minutes)..."):
            build_rootfs(spec)
    return {"backend": "bwrap" if backend == "auto" else backend, "image": str(rootfs_path(spec))}
