"""Sandbox images: Debian root filesystems built with debootstrap, and conversions of other image
sources into unpacked directories.

Every image is cached by a hash of what defines it, under ``RAAS_IMAGE_CACHE`` (default
``~/.cache/raas/images``), so a test run or a job fleet builds it once. An unpacked directory is the
fast path for both bwrap and apptainer (a SIF needs a squashfuse mount per start), so SIF files and
``docker://`` / ``docker-archive:`` / ``oci-archive:`` sources are converted once into a directory.

Every image gets the empty directories the backends bind onto (``/.raas/lib``, ``/.raas/run``,
``/workspace``), because a read-only root cannot grow mount points at start time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from raas.errors import RaasError

# Bump when the post-processing of an image changes, so cached images are rebuilt.
LAYOUT_VERSION = 1
PIP_VENV = "/opt/raas/venv"
"""Where an image's ``pip`` packages are installed (a virtual environment on the image's python3)."""
MOUNT_POINTS = (".raas/lib", ".raas/run", ".raas/rw", "workspace", "tmp")
SOURCE_PREFIXES = ("docker://", "docker-archive:", "oci-archive:", "oras://", "library://")


def image_cache_dir() -> Path:
    """The image cache root; ``RAAS_IMAGE_CACHE`` overrides it (CI shares one between users).

    Root's default is /var/cache/raas/images, not its private home: as root, sandboxes run under uids of
    their own, which must be able to read the image."""
    env = os.environ.get("RAAS_IMAGE_CACHE")
    if env:
        return Path(env).expanduser()
    if os.geteuid() == 0:
        return Path("/var/cache/raas/images")
    return Path.home() / ".cache" / "raas" / "images"


@dataclass(frozen=True)
class ImageSpec:
    """What defines a Debian rootfs image; its hash names the cache entry."""

    suite: str = "bookworm"
    packages: tuple[str, ...] = ("python3",)
    variant: str = "minbase"
    extra: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    pip: tuple[str, ...] = ()
    """Pinned PyPI requirements (``name==version``) installed into a venv at :data:`PIP_VENV` on the
    image's python3 (e.g. an agent harness); needs ``python3-venv`` among ``packages``."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z][a-z0-9-]*", self.suite):
            raise RaasError(f"invalid Debian suite {self.suite!r}", kind="bad_request")
        for p in self.packages:
            if not re.fullmatch(r"[a-z0-9][a-z0-9+.\-]*", p):
                raise RaasError(f"invalid Debian package name {p!r}", kind="bad_request")
        for r in self.pip:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._\-]*(\[[A-Za-z0-9,._\-]+\])?==[A-Za-z0-9.+!\-]+", r):
                raise RaasError(f"pip requirement {r!r} is not a pinned name==version", kind="bad_request")
        if self.pip and "python3-venv" not in self.packages:
            raise RaasError(
                "an image with pip packages needs python3-venv among its packages", kind="bad_request"
            )
        object.__setattr__(self, "packages", tuple(sorted(set(self.packages))))
        object.__setattr__(self, "pip", tuple(sorted(set(self.pip))))

    def key(self) -> str:
        """A short stable hash of the spec (the mirror is where bits come from, not what they are)."""
        spec: dict[str, object] = {
            "suite": self.suite,
            "packages": list(self.packages),
            "variant": self.variant,
            "layout": LAYOUT_VERSION,
        }
        if self.pip:  # absent otherwise, so images built before pip existed keep their keys
            spec["pip"] = list(self.pip)
        blob = json.dumps(spec, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def system_debian_mirror() -> str:
    """The Debian mirror the host's apt already uses (deb822 ``.sources`` or ``sources.list``)."""
    candidates: list[str] = []
    sources_d = Path("/etc/apt/sources.list.d")
    for f in sorted(sources_d.glob("*.sources")) if sources_d.is_dir() else []:
        with contextlib.suppress(OSError):
            for line in f.read_text().splitlines():
                if line.startswith("URIs:"):
                    candidates.extend(line.split()[1:])
    with contextlib.suppress(OSError):
        for line in Path("/etc/apt/sources.list").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb":
                url = parts[2] if parts[1].startswith("[") else parts[1]
                candidates.append(url)
    for url in candidates:
        if "security" not in url and url.startswith(("http://", "https://", "file:")):
            return url
    raise RaasError("no Debian mirror found in the apt sources; pass one explicitly", kind="bad_request")


def _ensure_mount_points(root: Path) -> None:
    for rel in MOUNT_POINTS:
        (root / rel).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "workspace").chmod(0o777)
    os.chmod(root, 0o755)


@contextlib.contextmanager
def _build_lock(cache: Path, key: str) -> Iterator[None]:
    """Serialise builds of one key across processes (a second builder waits, then reuses)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd = os.open(cache / f".lock-{key}", os.O_RDWR | os.O_CREAT, 0o644)
        if not os.access(cache, os.W_OK):
            os.close(fd)
            raise PermissionError(f"{cache} is not writable")
    except OSError as e:
        raise RaasError(
            f"cannot build into the image cache {cache} ({e}); point RAAS_IMAGE_CACHE at a "
            "writable directory",
            kind="sandbox_start_failed",
        ) from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _run(cmd: list[str], what: str, log: Path | None = None) -> None:
    out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if log is not None:
        log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr)[-3000:]
        raise RaasError(f"{what} failed (exit {out.returncode}): {tail}", kind="sandbox_start_failed")


def _unmount_below(root: Path) -> None:
    """A failed debootstrap can leave /proc or /sys mounted in the target: unmount before rm -rf."""
    from raas.sandbox.procs import mounts_under

    for mnt in sorted(mounts_under(root), key=len, reverse=True):
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)


def rootfs_path(spec: ImageSpec, cache: Path | None = None) -> Path:
    """Where the image for ``spec`` lives in the cache (it may not exist yet)."""
    return (cache or image_cache_dir()) / f"rootfs-{spec.key()}"


def build_rootfs(spec: ImageSpec, *, cache: Path | None = None, mirror: str | None = None) -> Path:
    """Return the cached rootfs for ``spec``, building it with debootstrap if missing (needs root)."""
    cache = cache or image_cache_dir()
    final = rootfs_path(spec, cache)
    if (final / "usr").is_dir():
        return final
    if os.geteuid() != 0:
        raise RaasError(
            f"image {final} is not built and debootstrap needs root; build it once as root with "
            f"`raas image build --debian {spec.suite} --packages {','.join(spec.packages)}`",
            kind="sandbox_start_failed",
        )
    if shutil.which("debootstrap") is None:
        raise RaasError(
            "debootstrap is not installed (apt-get install debootstrap)", kind="sandbox_start_failed"
        )
    with _build_lock(cache, spec.key()):
        if (final / "usr").is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{spec.key()}-", dir=cache))
        try:
            root = tmp / "root"
            # debootstrap's own dependency resolution is minimal (--include can fail to configure
            # packages with deeper dependency trees), so extra packages go in with apt in a chroot.
            cmd = [
                "debootstrap",
                f"--variant={spec.variant}",
                spec.suite,
                str(root),
                mirror or system_debian_mirror(),
            ]
            try:
                _run(cmd, "debootstrap", log=tmp / "debootstrap.log")
                if spec.packages:
                    env = "DEBIAN_FRONTEND=noninteractive"
                    _run(["chroot", str(root), "env", env, "apt-get", "-qq", "update"], "apt-get update")
                    _run(
                        [
                            "chroot",
                            str(root),
                            "env",
                            env,
                            "apt-get",
                            "install",
                            "-y",
                            "-qq",
                            "--no-install-recommends",
                            *spec.packages,
                        ],
                        "apt-get install",
                    )
                    _run(["chroot", str(root), "apt-get", "clean"], "apt-get clean")
                if spec.pip:
                    install_pip_packages(root, spec.pip, tmp / "wheels")
            finally:
                _unmount_below(root)
            shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
            (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
            for lists in (root / "var/lib/apt/lists").glob("*_Packages"):
                lists.unlink()
            (tmp / "debootstrap.log").unlink(missing_ok=True)
            _ensure_mount_points(root)
            meta = {
                "spec": {
                    "suite": spec.suite,
                    "packages": list(spec.packages),
                    "variant": spec.variant,
                    "pip": list(spec.pip),
                },
                "layout": LAYOUT_VERSION,
                "built_at": time.time(),
            }
            (cache / f"rootfs-{spec.key()}.json").write_text(json.dumps(meta, indent=1))
            os.rename(root, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):  # readable by other users (a shared cache)
            os.chmod(cache, 0o755)
    return final


def install_pip_packages(root: Path, requirements: tuple[str, ...], wheelhouse: Path) -> None:
    """Install pinned PyPI packages into a venv at :data:`PIP_VENV` inside the rootfs ``root``.

    The wheels are fetched (or built) on the host with the host's pip and its index settings, which the
    image does not have (proxies, certificates, mirrors), then installed offline in a chroot. The host's
    Python should have the image's minor version (both 3.11 on Debian 12) so binary wheels fit."""
    import sys

    wheelhouse.mkdir(parents=True, exist_ok=True)
    _run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheelhouse), *requirements],
        "pip wheel (on the host)",
    )
    inside = root / "tmp" / "raas-wheels"
    shutil.copytree(wheelhouse, inside)
    clean_env = ["env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8"]
    try:
        _run(["chroot", str(root), *clean_env, "python3", "-m", "venv", PIP_VENV], "python3 -m venv")
        _run(
            [
                "chroot",
                str(root),
                *clean_env,
                "PIP_DISABLE_PIP_VERSION_CHECK=1",
                f"{PIP_VENV}/bin/pip",
                "install",
                "--quiet",
                "--no-index",
                "--find-links",
                "/tmp/raas-wheels",
                *requirements,
            ],
            "pip install (in the image)",
        )
        _run(["chroot", str(root), "chmod", "-R", "a+rX", PIP_VENV], "chmod")
    finally:
        shutil.rmtree(inside, ignore_errors=True)


def build_sif(rootfs: Path, sif: Path) -> Path:
    """Pack a rootfs dir into a SIF with ``apptainer build`` (for clusters that want one file)."""
    exe = apptainer_binary()
    sif.parent.mkdir(parents=True, exist_ok=True)
    tmp = sif.with_name(sif.name + ".part")
    cmd = [exe, "-s", "build", "--force"]
    if os.geteuid() != 0:
        cmd.append("--fakeroot")
    _run([*cmd, str(tmp), str(rootfs)], "apptainer build")
    os.replace(tmp, sif)
    return sif


def apptainer_binary() -> str:
    """The apptainer (or singularity) executable, or a typed error naming what to install."""
    for name in ("apptainer", "singularity"):
        path = shutil.which(name)
        if path:
            return path
    raise RaasError("apptainer is not installed", kind="sandbox_start_failed")


def is_convertible_source(image: str) -> bool:
    """True for image sources that must be unpacked into a directory before use."""
    return image.startswith(SOURCE_PREFIXES) or (image.endswith(".sif") and Path(image).is_file())


def source_key(image: str) -> str:
    """Cache key of a convertible source: the reference, plus size and mtime for local files."""
    ident: dict[str, object] = {"source": image, "layout": LAYOUT_VERSION}
    local = image.split(":", 1)[1] if image.startswith(("docker-archive:", "oci-archive:")) else image
    if not image.startswith(("docker://", "oras://", "library://")):
        try:
            st = Path(local).stat()
        except OSError as e:
            raise RaasError(f"image source {image!r} not found: {e}", kind="bad_request") from e
        ident.update(path=str(Path(local).resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def conversion_command(
    exe: str, source: str, dest: Path, *, as_root: bool, root_has_subuid: bool = False
) -> list[str]:
    """The ``apptainer build --sandbox`` command that unpacks ``source`` into ``dest``.

    Unprivileged: ``--fakeroot``. As root: ``--fakeroot`` only works with a root entry in
    /etc/subuid; without one apptainer's own extraction asks for capabilities many VMs withhold, so
    the conversion is attempted plainly and fails with a clear hint.
    """
    cmd = [exe, "-s", "build", "--sandbox", "--force"]
    if not as_root or root_has_subuid:
        cmd.append("--fakeroot")
    return [*cmd, str(dest), source]


def _has_subuid(user: str = "root") -> bool:
    try:
        return any(line.split(":")[0] == user for line in Path("/etc/subuid").read_text().splitlines())
    except OSError:
        return False


def sif_squashfs_offset(listing: str) -> int:
    """Byte offset of the root filesystem partition in ``apptainer sif list`` output."""
    for line in listing.splitlines():
        cols = [c.strip() for c in line.split("|")]
        if len(cols) >= 5 and cols[4].startswith("FS") and "Squashfs" in cols[4]:
            return int(cols[3].split("-")[0])
    raise RaasError("no squashfs root filesystem partition in the SIF file", kind="bad_request")


def unpack_sif(sif: Path, dest: Path) -> None:
    """Unpack a SIF's squashfs partition with ``unsquashfs`` (no namespaces or capabilities needed)."""
    exe = apptainer_binary()
    listing = subprocess.run([exe, "sif", "list", str(sif)], capture_output=True, text=True, check=False)
    if listing.returncode != 0:
        raise RaasError(
            f"{sif} is not a readable SIF file: {listing.stderr.strip()[-500:]}", kind="bad_request"
        )
    offset = sif_squashfs_offset(listing.stdout)
    if shutil.which("unsquashfs") is None:
        raise RaasError("unsquashfs (squashfs-tools) is not installed", kind="sandbox_start_failed")
    out = subprocess.run(
        [
            "unsquashfs",
            "-no-xattrs",
            "-quiet",
            "-no-progress",
            "-f",
            "-d",
            str(dest),
            "-o",
            str(offset),
            str(sif),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    # Exit 2 means non-fatal problems (device nodes an unprivileged user cannot create).
    if out.returncode not in (0, 2) or not dest.is_dir():
        raise RaasError(
            f"unpacking {sif} failed: {(out.stdout + out.stderr)[-2000:]}", kind="sandbox_start_failed"
        )


def ensure_sandbox_dir(image: str, *, cache: Path | None = None) -> Path:
    """Resolve ``image`` to an unpacked root directory, converting (once, cached) when it is not one."""
    if not is_convertible_source(image):
        path = Path(image)
        if not path.is_dir():
            raise RaasError(f"image {image!r} is neither a directory nor a known source", kind="bad_request")
        return path
    cache = cache or image_cache_dir()
    key = source_key(image)
    final = cache / f"unpacked-{key}"
    if (final / ".raas").is_dir():
        return final
    with _build_lock(cache, key):
        if (final / ".raas").is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".conv-{key}-", dir=cache))
        try:
            dest = tmp / "root"
            if image.endswith(".sif") and Path(image).is_file():
                unpack_sif(Path(image), dest)
            else:
                as_root = os.geteuid() == 0
                cmd = conversion_command(
                    apptainer_binary(),
                    image,
                    dest,
                    as_root=as_root,
                    root_has_subuid=as_root and _has_subuid(),
                )
                try:
                    _run(cmd, f"converting {image}")
                except RaasError as e:
                    if as_root and "--fakeroot" not in cmd:
                        e.message += " (as root, add a root entry to /etc/subuid and /etc/subgid)"
                    raise
            _ensure_mount_points(dest)
            (cache / f"unpacked-{key}.json").write_text(
                json.dumps({"source": image, "built_at": time.time()})
            )
            os.rename(dest, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):  # readable by other users (a shared cache)
            os.chmod(cache, 0o755)
    return final
