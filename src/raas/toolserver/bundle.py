"""Host side: build the read-only bundle dir a sandbox puts on ``PYTHONPATH`` to run the tool server.

The bundle holds this package copied as ``raas_toolserver``, compiled
to bytecode once (it is read-only inside, so the server could never cache it). Each build goes into a
fresh directory owned by the building process, and the caller keeps its digest (every file's SHA-256)
in memory: :func:`verify_bundle` re-checks it before each use, so a bundle that changed on disk is never
handed to another sandbox, whoever changed it.
"""

from __future__ import annotations

import compileall
import hashlib
import os
import secrets
import shutil
import stat
import tempfile
from pathlib import Path

BUNDLE_PACKAGE = "raas_toolserver"
_PREFIX = "toolserver-"


def _source_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _package_dirs() -> dict[str, Path]:
    return {BUNDLE_PACKAGE: Path(__file__).resolve().parent}


def bundle_hash() -> str:
    """Content hash of the sources that go into the bundle."""
    h = hashlib.sha256()
    for name, root in sorted(_package_dirs().items()):
        for path in _source_files(root):
            h.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()[:16]


def bundle_digest(bundle: Path) -> dict[str, str]:
    """Every entry below ``bundle``: files by SHA-256, directories as ``dir``; anything else is suspect.

    Run before every sandbox start, so it keeps to few system calls: ``scandir`` and one ``lstat`` per
    entry, then ``open``/``read``/``close`` per file (a file object would add several more each)."""
    out: dict[str, str] = {}
    stack = [(str(bundle), "")]
    while stack:
        path, rel = stack.pop()
        with os.scandir(path) as entries:
            for entry in entries:
                name = f"{rel}{entry.name}"
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    out[name] = "dir"
                    stack.append((entry.path, name + "/"))
                elif stat.S_ISREG(st.st_mode):
                    out[name] = _file_sha256(entry.path, st.st_size)
                else:
                    out[name] = f"unexpected:{stat.S_IFMT(st.st_mode):o}"
    return out


def _file_sha256(path: str, size: int) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        h = hashlib.sha256()
        while True:  # one read when the file still has the size lstat saw, plus the one that sees EOF
            chunk = os.read(fd, size + 1 if size < 1 << 24 else 1 << 24)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)
    finally:
        os.close(fd)


def verify_bundle(bundle: Path, digest: dict[str, str]) -> bool:
    """True when ``bundle`` still holds exactly what :func:`build_bundle` put there."""
    try:
        return bundle_digest(bundle) == digest
    except OSError:
        return False


def build_bundle(dest_dir: str | os.PathLike[str]) -> tuple[Path, dict[str, str]]:
    """Build a fresh ``dest_dir/toolserver-<hash>-<pid>-<random>`` and return it with its digest.

    Sources are copied with their timestamps, compiled, made read-only for everyone (0644/0755), then
    renamed into place, so no sandbox ever sees a half-built bundle.
    """
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    final = dest / f"{_PREFIX}{bundle_hash()}-{os.getpid()}-{secrets.token_hex(4)}"
    staging = Path(tempfile.mkdtemp(prefix=".toolserver-", dir=dest))
    try:
        for name, root in _package_dirs().items():
            for path in _source_files(root):
                target = staging / name / path.relative_to(root)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
        # Used when the image's python3 has the host's minor version; ignored (and harmless) otherwise.
        compileall.compile_dir(str(staging), quiet=2, workers=1)
        for p in staging.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
        staging.chmod(0o755)
        digest = bundle_digest(staging)
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final, digest


BUNDLE_GLOB = f"{_PREFIX}*-*-*"
"""The bundles :func:`build_bundle` makes (``toolserver-<hash>-<builder pid>-<random>``)."""


def bundle_owner_pid(path: Path) -> str:
    """The pid (as text) of the process that built the bundle at ``path``."""
    return path.name.split("-")[-2]
