"""Host side: build the read-only bundle dir a sandbox puts on ``PYTHONPATH`` to run the tool server.

The bundle holds this package copied as ``raas_toolserver`` plus the installed ``ptyprocess``; it is
keyed by a hash of their contents, so rebuilding is free and a changed server never reuses a stale copy.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

BUNDLE_PACKAGE = "raas_toolserver"


def _source_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _package_dirs() -> dict[str, Path]:
    import ptyprocess

    return {
        BUNDLE_PACKAGE: Path(__file__).resolve().parent,
        "ptyprocess": Path(ptyprocess.__file__).resolve().parent,
    }


def bundle_hash() -> str:
    """Content hash of everything that goes into the bundle."""
    h = hashlib.sha256()
    for name, root in sorted(_package_dirs().items()):
        for path in _source_files(root):
            h.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


def build_bundle(dest_dir: str | os.PathLike[str]) -> Path:
    """Create (once) and return ``dest_dir/toolserver-<hash>``, the directory to bind at ``/.raas/lib``.

    Safe to call concurrently: the copy is assembled in a temporary dir and renamed into place.
    """
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    final = dest / f"toolserver-{bundle_hash()}"
    if (final / BUNDLE_PACKAGE / "__main__.py").is_file():
        return final
    staging = Path(tempfile.mkdtemp(prefix=".toolserver-", dir=dest))
    try:
        for name, root in _package_dirs().items():
            for path in _source_files(root):
                target = staging / name / path.relative_to(root)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
        for p in staging.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        staging.chmod(0o755)
        try:
            staging.rename(final)
        except OSError:
            # Another process won the race; its bundle has the same content.
            if not (final / BUNDLE_PACKAGE / "__main__.py").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
