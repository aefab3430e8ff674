"""Session fixtures shared by all tests: the test image and sandbox managers that must leave nothing behind.

The test image (Debian bookworm minbase + python3, ipykernel, jupyter_client, so every tool works in
bwrap and apptainer) is built once with debootstrap and then reused across runs through the image
cache (``RAAS_IMAGE_CACHE``). Building needs root; an unprivileged run reuses what root built.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import NoReturn

# A service's handler registry imports swebench (numpy, pandas, datasets) in a background thread; code
# that probes sys.modules["numpy"] meanwhile (hypothesis, under schemathesis) can find it half-imported.
import numpy  # noqa: F401
import pytest

from raas.sandbox import SandboxConfig, SandboxManager
from raas.sandbox import procs as sbprocs
from raas.sandbox.config import make_config
from raas.sandbox.images import ImageSpec, build_rootfs, rootfs_path

TEST_IMAGE_SPEC = ImageSpec(
    suite="bookworm", packages=("python3", "python3-ipykernel", "python3-jupyter-client")
)
SANDBOX_BACKENDS = ("local", "bwrap", "apptainer")


def unavailable(reason: str) -> NoReturn:
    """Skip a test whose requirement this machine lacks — except in CI (``RAAS_CI``), which installs every
    backend and builds every image first: there a missing requirement is a failure, never a quiet skip."""
    if os.environ.get("RAAS_CI"):
        pytest.fail(f"CI provides this, but: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def test_image() -> Path:
    """Path of the shared test rootfs; built on first use (root + debootstrap), cached across runs."""
    path = rootfs_path(TEST_IMAGE_SPEC)
    if (path / "usr").is_dir():
        return path
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        unavailable(
            f"test image {path} is not built and this user cannot build it (needs root + debootstrap)"
        )
    return build_rootfs(TEST_IMAGE_SPEC)


def _works(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def backend_available() -> dict[str, str | None]:
    """Backend name → None if it can run here, else the reason it cannot (tests skip with it)."""
    out: dict[str, str | None] = {"local": None}
    if shutil.which("bwrap") is None:
        out["bwrap"] = "bubblewrap is not installed"
    elif not _works(["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"]):
        out["bwrap"] = "bwrap cannot create namespaces on this machine"
    else:
        out["bwrap"] = None
    out["apptainer"] = None if shutil.which("apptainer") else "apptainer is not installed"
    return out


@pytest.fixture
def sandbox_config(
    request: pytest.FixtureRequest, backend: str, backend_available: dict[str, str | None]
) -> SandboxConfig:
    """A config for the test's ``backend`` parameter (skips, with the reason, where it cannot run)."""
    reason = backend_available.get(backend, f"unknown backend {backend}")
    if reason:
        unavailable(reason)
    image = None if backend == "local" else str(request.getfixturevalue("test_image"))
    return make_config(backend=backend, image=image, start_timeout_s=120)


def leftovers(manager: SandboxManager) -> dict[str, object]:
    """Everything a closed manager must not leave: processes, records, scratch dirs, sockets."""
    ids = set(manager.started_ids)
    tagged = {pid: v for pid, v in sbprocs.pids_with_env_prefix("sb-").items() if v in ids}
    records = sorted(p.name for p in manager.records_dir.glob("*.json"))
    scratch = (
        sorted(p.name for p in manager.scratch_root.glob("sb-*")) if manager.scratch_root.exists() else []
    )
    return {k: v for k, v in {"processes": tagged, "records": records, "scratch": scratch}.items() if v}


def open_fds(kind: str) -> int:
    """Fds of one kind (``socket:``, ``anon_inode:[pidfd]``) this test process holds open: a leaked
    client connection or exit watch shows up here."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(kind):
                n += 1
        except OSError:
            pass
    return n


PIDFD = "anon_inode:[pidfd]"


def socket_fds() -> int:
    return open_fds("socket:")


def mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f}


@pytest.fixture
def visible_tmp() -> Iterator[Path]:
    """A temp dir every user can traverse (not list): as root, sandboxes run under uids of their own,
    which cannot enter pytest's private tmp_path, so test images and bind sources go here."""
    base = Path(tempfile.mkdtemp(prefix="raas-test-", dir="/var/tmp"))
    base.chmod(0o711)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
async def sandbox_manager(tmp_path: Path) -> AsyncIterator[SandboxManager]:
    """A manager on a fresh state dir; at teardown it must have left no process, dir, record or mount."""
    mounts_before = mount_points()
    sockets_before = socket_fds()
    pidfds_before = open_fds(PIDFD)
    manager = SandboxManager(tmp_path / "state")
    try:
        yield manager
    finally:
        await manager.close_all()
    left = leftovers(manager)
    assert not left, f"sandbox leftovers: {left}"
    assert mount_points() - mounts_before == set()
    # A transport closed during teardown releases its socket in a callback the loop runs next: let it
    # run (bounded) before counting, so only a socket that stays open counts as a leak.
    for _ in range(100):  # up to ~5 s
        if socket_fds() <= sockets_before:
            break
        await asyncio.sleep(0.05)
    assert socket_fds() <= sockets_before
    assert open_fds(PIDFD) <= pidfds_before  # every sandbox's exit watch ended with it
    assert not manager.scratch_root.exists() or manager.scratch_root.is_relative_to(manager.state_dir)
