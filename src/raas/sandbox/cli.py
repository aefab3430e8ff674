"""``raas image ...`` commands."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from raas.errors import RaasError

image_app = typer.Typer(no_args_is_help=True)


@image_app.command("build")
def build(
    debian: Annotated[str, typer.Option(help="Debian suite, e.g. bookworm")] = "bookworm",
    packages: Annotated[str, typer.Option(help="comma-separated Debian packages")] = "python3",
    pip: Annotated[
        str,
        typer.Option(
            help="comma-separated pinned PyPI packages (name==version) for a venv at /opt/raas/venv"
        ),
    ] = "",
    output: Annotated[Path | None, typer.Option("-o", "--output", help="also place the rootfs here")] = None,
    sif: Annotated[Path | None, typer.Option(help="also pack a SIF file (apptainer build)")] = None,
    mirror: Annotated[
        str | None, typer.Option(help="Debian mirror (default: the system's apt sources)")
    ] = None,
) -> None:
    """Build (or reuse from the cache) a Debian rootfs usable by the bwrap and apptainer backends."""
    from raas.sandbox.images import ImageSpec, build_rootfs, build_sif

    try:
        spec = ImageSpec(
            suite=debian,
            packages=tuple(p.strip() for p in packages.split(",") if p.strip()),
            pip=tuple(p.strip() for p in pip.split(",") if p.strip()),
        )
        root = build_rootfs(spec, mirror=mirror)
        typer.echo(f"rootfs: {root}")
        if output is not None:
            place(root, output)
            typer.echo(f"output: {output}")
        if sif is not None:
            build_sif(root, sif)
            typer.echo(f"sif: {sif}")
    except RaasError as e:
        typer.echo(f"error ({e.kind}): {e.message}", err=True)
        raise typer.Exit(1) from e


def place(root: Path, output: Path) -> None:
    """Put a copy of the cached rootfs at ``output``: hard links when on the same filesystem (instant)."""
    if output.exists():
        if output.is_dir() and (output / "usr").is_dir() and output.resolve() == root.resolve():
            return
        raise RaasError(f"{output} already exists", kind="bad_request")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    same_fs = os.stat(root).st_dev == os.stat(output.parent).st_dev
    cmd = ["cp", "-a", "--link" if same_fs else "--reflink=auto", str(root), str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RaasError(f"copying the rootfs failed: {r.stderr[-2000:]}", kind="internal")
    os.rename(tmp, output)
