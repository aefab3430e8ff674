"""Sandbox images for SWE-style tasks: one environment image per package, one image per instance.

* The base is a Debian rootfs with ``python3``, ``git`` and ``patch``, built once by
  :func:`raas.sandbox.images.build_rootfs` (debootstrap, cached by spec hash).
* An **environment image** (``swe-env-<key>``) is the base plus the test runner from PyPI (pinned, whole
  closure, ``pip install --target`` into ``/usr/local/lib/python3.X/dist-packages``), a ``.pth`` file
  that puts the repository at ``/testbed`` on ``sys.path`` (SWE-bench's images ``pip install -e`` it),
  and an empty ``/testbed``. The builder runs every candidate bug in sandboxes from it.
* An **instance image** (``swe-inst-<key>``) is an environment image plus ``/testbed``: the buggy
  repository, one commit, nothing else. Each instance has its own, so no sandbox can read another
  instance's code.

Derived images share unchanged files with their parent through hard links (``cp -al``: ~0.7 s and no
extra space for a 300 MB rootfs); raas only ever adds new files to an image, never rewrites one in place.
Everything is readable by other users (dirs 0755, files 0644/0755): as root, sandboxes run under uids of
their own. Building needs root, like every image; an unprivileged user reuses what root built.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from raas.errors import RaasError
from raas.sandbox.images import ImageSpec, build_rootfs, image_cache_dir, rootfs_path

from .packages import PackageSpec

SWE_BASE_SPEC = ImageSpec(suite="bookworm", packages=("git", "patch", "python3"))
# Bump when what goes into a derived image changes, so cached ones are rebuilt.
SWE_LAYOUT = 1
PTH_NAME = "raas-testbed.pth"


def image_python(root: Path) -> str:
    """The image's python3 version as ``X.Y`` (from the ``/usr/bin/python3`` link)."""
    target = os.readlink(root / "usr/bin/python3") if (root / "usr/bin/python3").is_symlink() else ""
    name = Path(target).name
    if not name.startswith("python3."):
        raise RaasError(f"cannot tell the python version of the image {root}", kind="sandbox_start_failed")
    return name.removeprefix("python")


def _key(*parts: object) -> str:
    blob = json.dumps([SWE_LAYOUT, *parts], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def make_readable(root: Path) -> None:
    """Dirs 0755, files 0644 (0755 when executable by the owner); symlinks untouched."""
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if not os.path.islink(p):
                os.chmod(p, 0o755 if st.st_mode & 0o100 else 0o644)


@contextlib.contextmanager
def _build_lock(cache: Path, name: str) -> Iterator[None]:
    """One builder per image across processes; a second one waits, then finds it built."""
    cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache / f".lock-{name}", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _require_root(what: str) -> None:
    if os.geteuid() != 0:
        raise RaasError(
            f"{what} is not built and building images needs root; build the set once as root "
            "(`raas swe build ...`) into a shared RAAS_IMAGE_CACHE",
            kind="sandbox_start_failed",
        )


def _hardlink_copy(src: Path, dest: Path) -> None:
    out = subprocess.run(["cp", "-al", str(src), str(dest)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RaasError(f"copying image {src} failed: {out.stderr[-1000:]}", kind="sandbox_start_failed")


def env_image_path(spec: PackageSpec, cache: Path | None = None) -> Path:
    """Where :func:`build_env_image` puts the package's environment (it may not exist yet)."""
    cache = cache or image_cache_dir()
    base = rootfs_path(SWE_BASE_SPEC, cache)
    return cache / f"swe-env-{_key(base.name, list(spec.test_deps), spec.pythonpath)}"


def build_env_image(spec: PackageSpec, *, cache: Path | None = None) -> Path:
    """The package's environment image, built once (base rootfs + pinned test deps + ``.pth``)."""
    cache = cache or image_cache_dir()
    final = env_image_path(spec, cache)
    if (final / "testbed").is_dir():
        return final
    _require_root(f"the environment image {final}")
    base = build_rootfs(SWE_BASE_SPEC, cache=cache)
    pyver = image_python(base)
    with _build_lock(cache, final.name):
        if (final / "testbed").is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{final.name}-", dir=cache))
        try:
            root = tmp / "root"
            _hardlink_copy(base, root)
            site = tmp / "site"
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--python-version",
                pyver,
                "--implementation",
                "cp",
                "--target",
                str(site),
                *spec.test_deps,
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
            if out.returncode != 0:
                raise RaasError(
                    f"installing the test dependencies {list(spec.test_deps)} failed: "
                    f"{(out.stdout + out.stderr)[-1500:]}",
                    kind="sandbox_start_failed",
                )
            shutil.rmtree(site / "bin", ignore_errors=True)  # scripts with the host's interpreter path
            clash = [m for m in spec.modules if (site / m).exists() or (site / f"{m}.py").exists()]
            if clash:
                raise RaasError(
                    f"the test dependencies bring {clash} themselves: the original code would be in the image",
                    kind="bad_request",
                )
            dist = root / f"usr/local/lib/python{pyver}/dist-packages"
            dist.mkdir(parents=True, exist_ok=True)
            make_readable(site)  # before the move: files of the hard-linked base are never touched
            for item in site.iterdir():
                os.rename(item, dist / item.name)
            testbed = "/testbed" + (f"/{spec.pythonpath.strip('/')}" if spec.pythonpath else "")
            (dist / PTH_NAME).write_text(testbed + "\n")
            (root / "testbed").mkdir()
            os.chmod(dist / PTH_NAME, 0o644)
            os.chmod(root / "testbed", 0o755)
            meta = {
                "base": base.name,
                "test_deps": list(spec.test_deps),
                "pth": testbed,
                "built_at": time.time(),
            }
            (cache / f"{final.name}.json").write_text(json.dumps(meta, indent=1))
            os.rename(root, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def instance_image_path(env_image: Path, instance_id: str, base_commit: str) -> Path:
    return env_image.parent / f"swe-inst-{_key(env_image.name, instance_id, base_commit)}"


def build_instance_image(env_image: Path, testbed: Path, instance_id: str, base_commit: str) -> Path:
    """The instance's image: ``env_image`` plus ``testbed`` (a prepared repository) at ``/testbed``."""
    final = instance_image_path(env_image, instance_id, base_commit)
    if (final / "testbed/.git").is_dir():
        return final
    _require_root(f"the instance image {final}")
    cache = env_image.parent
    with _build_lock(cache, final.name):
        if (final / "testbed/.git").is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{final.name}-", dir=cache))
        try:
            root = tmp / "root"
            _hardlink_copy(env_image, root)
            (root / "testbed").rmdir()
            shutil.copytree(testbed, root / "testbed", symlinks=True)
            make_readable(root / "testbed")
            (cache / f"{final.name}.json").write_text(
                json.dumps({"env": env_image.name, "instance_id": instance_id, "base_commit": base_commit})
            )
            os.rename(root, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def remove_image(path: Path) -> None:
    """Delete a derived image (an instance that failed its checks) and its metadata."""
    if path.name.startswith(("swe-inst-", "swe-env-")):
        shutil.rmtree(path, ignore_errors=True)
        path.with_name(path.name + ".json").unlink(missing_ok=True)
