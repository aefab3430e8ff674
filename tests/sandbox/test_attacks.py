"""The sandbox boundary, tested as an attacker would: model-written code inside tries to persist, escape,
exhaust the host, or wedge the service; another local user tries to get in from outside.

Every test runs on bwrap and apptainer, as root and (in CI's second pass) as an unprivileged user.
"""

from __future__ import annotations

import asyncio
import io
import os
import shutil
import signal
import tarfile
import time
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox import Sandbox, SandboxConfig, SandboxManager
from raas.sandbox import procs as sbprocs
from raas.toolserver.bundle import BUNDLE_PACKAGE
from tests.sandbox.other_user import as_nobody

pytestmark = pytest.mark.integration
ISOLATED = pytest.mark.parametrize("backend", ["bwrap", "apptainer"])
ROOT = os.geteuid() == 0


async def sh(sb: Sandbox, command: str, **kw: object) -> str:
    return (await sb.tools.bash(command, **kw)).output  # type: ignore[arg-type]


def server_host_pid(sb: Sandbox) -> int:
    """The host pid of the sandbox's tool server (pid 1 inside its namespace)."""
    for pid in sbprocs.pids_with_env(sb.id):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"raas_toolserver.boot" in cmdline and b"bwrap" not in cmdline and b"apptainer" not in cmdline:
            return pid
    raise AssertionError("no tool server process found")


# -- 1. planting code that runs in later sandboxes ---------------------------------------------------


@ISOLATED
async def test_bundle_cannot_be_changed_from_inside(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    init = f"/.raas/lib/{BUNDLE_PACKAGE}/__init__.py"
    attack = (
        f"mount -o remount,bind,rw /.raas/lib; mount -o remount,rw /.raas; "
        f"echo 'open(\"/workspace/PWNED\", \"w\")' >> {init}; echo 'syntax error(' >> {init}; "
        f"unshare -Urm sh -c 'mount -o remount,bind,rw /.raas/lib && echo x >> {init}'; "
        f"mount -t tmpfs none /.raas/lib; umount -l /.raas/lib; "
        f"chmod 777 /.raas/lib/{BUNDLE_PACKAGE}; cat /proc/self/status | grep CapEff"
    )
    bundle = await sandbox_manager.bundle_dir()
    before = (bundle / BUNDLE_PACKAGE / "__init__.py").read_bytes()
    async with sandbox_manager.sandbox(sandbox_config, owner="attacker") as sb:
        out = await sh(sb, attack)
        assert "CapEff:\t0000000000000000" in out
        assert "Read-only file system" in out or "Permission denied" in out
    assert (bundle / BUNDLE_PACKAGE / "__init__.py").read_bytes() == before
    async with sandbox_manager.sandbox(sandbox_config, owner="victim") as sb:
        assert (await sh(sb, f"ls /workspace; tail -c 200 {init}")).count("PWNED") == 0
        assert "syntax error" not in await sh(sb, f"cat {init}")


@ISOLATED
async def test_a_bundle_changed_on_the_host_is_rebuilt(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    """Defence in depth: whoever changes the bundle on disk, the next sandbox gets a fresh, intact one."""
    bundle = await sandbox_manager.bundle_dir()
    target = bundle / BUNDLE_PACKAGE / "__init__.py"
    original = target.read_bytes()
    target.chmod(0o644)
    target.write_bytes(original + b"\nimport os; os.system('touch /workspace/PWNED')\n")
    async with sandbox_manager.sandbox(sandbox_config, owner="victim") as sb:
        assert "PWNED" not in await sh(sb, "ls -A /workspace")
        assert (await sb.tools.read_file(f"/.raas/lib/{BUNDLE_PACKAGE}/__init__.py")) == original
    fresh = await sandbox_manager.bundle_dir()
    assert fresh != bundle and not bundle.exists()


# -- 2. writing into the shared image ----------------------------------------------------------------


@ISOLATED
async def test_image_cannot_be_written_from_inside(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    image = Path(str(sandbox_config.image))
    marker = "raas-attack-marker"
    attack = (
        f"mount -o remount,bind,rw /; mount -o remount,rw /; touch /usr/bin/{marker}; "
        f"echo pwned >> /etc/hostname; touch /{marker}; mkdir /{marker}dir; "
        f"grep -E 'Cap(Eff|Prm|Bnd|Amb|Inh)' /proc/self/status"
    )
    async with sandbox_manager.sandbox(sandbox_config, owner="attacker") as sb:
        out = await sh(sb, attack)
        for line in out.splitlines():
            if line.startswith("Cap"):
                assert line.split()[1] == "0000000000000000", line
    assert not (image / "usr" / "bin" / marker).exists() and not (image / marker).exists()
    assert b"pwned" not in (image / "etc" / "hostname").read_bytes()
    async with sandbox_manager.sandbox(sandbox_config, owner="victim") as sb:
        assert marker not in await sh(sb, "ls /usr/bin /")


@ISOLATED
async def test_uid_0_inside_is_never_uid_0_outside(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    """Host uid 0 may write host sysctls without any capability; a sandbox must never be host root."""
    async with sandbox_manager.sandbox(sandbox_config, owner="attacker") as sb:
        out = await sh(sb, "id -u; echo 4096 > /proc/sys/kernel/pty/max && echo WROTE; echo $?")
        assert out.splitlines()[0] == "0" and "WROTE" not in out
        pids = sbprocs.pids_with_env(sb.id)
        host_uids = {os.stat(f"/proc/{pid}").st_uid for pid in pids}
        # Real, effective, saved and file-system ids, and supplementary groups, of every host process.
        creds = {pid: host_credentials(pid) for pid in pids}
    assert 0 not in host_uids
    if ROOT:  # a uid of its own, which no other sandbox shares, and none of root's groups
        ident = sb.identity
        assert ident.dedicated and host_uids == {ident.uid}
        assert set(creds.values()) == {((ident.uid,) * 4, (ident.gid,) * 4, ())}, creds


def host_credentials(pid: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return (
        tuple(int(x) for x in fields["Uid"].split()),
        tuple(int(x) for x in fields["Gid"].split()),
        tuple(int(x) for x in fields["Groups"].split()),
    )


# -- 3. process limits that hold for root ------------------------------------------------------------

FORK_BOMB = r"""python3 - <<'EOF'
import os, time
n = 0
try:
    while n < 400:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    print("fork refused:", e.strerror)
print("forked", n)
EOF"""


@ISOLATED
async def test_max_procs_holds(sandbox_manager: SandboxManager, sandbox_config: SandboxConfig) -> None:
    cfg = sandbox_config.model_copy(update={"max_procs": 50})
    async with sandbox_manager.sandbox(cfg, owner="attacker") as sb:
        out = await sh(sb, FORK_BOMB, timeout=120)
        forked = int(out.split("forked")[-1])
        assert "fork refused" in out and forked < 50
        if ROOT:  # the sandbox's own uid: the cap is per sandbox, not shared with root's host processes
            # (the sandbox's own processes take some of the 50: the tool server, its shells, and under
            # apptainer its starter; a fresh clone's run saw 39 forks there)
            assert forked >= 35, out
    assert sbprocs.pids_with_env(sb.id) == []


# -- 4. host-wide resources: ptys, disk ---------------------------------------------------------------

PTY_HOG = r"""cat > /tmp/hog.py <<'EOF'
import pty, time
fds = []
try:
    while len(fds) < 5000:
        fds.append(pty.openpty())
except OSError as e:
    print("refused:", e.strerror)
print("opened", len(fds), flush=True)
time.sleep(600)  # keep holding them
EOF
python3 /tmp/hog.py > /tmp/hog.out 2>&1 &
for i in $(seq 300); do grep -q opened /tmp/hog.out && break; sleep 0.1; done; cat /tmp/hog.out"""


def pty_masters_held(sandbox_id: str) -> int:
    """Pseudo-terminals the sandbox's processes hold, counted on the host: their open ``ptmx`` fds (one
    per pty: each master is a separate open of ``ptmx``). Unlike the kernel's machine-wide count it is
    not moved by other work on the machine."""
    held = 0
    for pid in sbprocs.pids_with_env(sandbox_id):
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            fds = list(fd_dir.iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                held += os.readlink(fd).endswith("ptmx")
            except OSError:
                continue
    return held


@ISOLATED
async def test_pty_exhaustion_stays_inside(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    cfg = sandbox_config.model_copy(update={"max_ptys": 16})
    async with sandbox_manager.sandbox(cfg, owner="attacker") as hog:
        out = await sh(hog, PTY_HOG)
        opened = int(out.split("opened")[-1])
        assert "refused" in out and opened < 16
        # The hog holds its ptys (it sleeps); with the session's own terminal that is the sandbox's cap.
        assert opened < pty_masters_held(hog.id) <= 16
        # Another sandbox still starts and gets its terminal.
        async with sandbox_manager.sandbox(sandbox_config, owner="victim") as other:
            assert (await sh(other, "tty; echo ok")).strip().endswith("ok")


@ISOLATED
async def test_session_flood_stays_under_the_cap(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    """10,000 concurrent bash calls with distinct session names: sessions still starting count too."""
    cfg = sandbox_config.model_copy(update={"max_sessions": 8})
    async with sandbox_manager.sandbox(cfg, owner="attacker") as sb:
        calls = [sb.tools.bash("echo x", session=f"flood-{i}", timeout=120) for i in range(10_000)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        ok = [r for r in results if not isinstance(r, BaseException)]
        refused = [r for r in results if isinstance(r, RaasError)]
        assert len(ok) <= 8 and len(ok) + len(refused) == len(results)
        assert all(r.kind == "tool_error" and "too many bash sessions" in r.message for r in refused)
        assert len(await sb.tools.bash_list()) <= 8
        shells = await sh(sb, "grep -lx bash /proc/[0-9]*/comm | wc -l", session=ok[0].session)  # type: ignore[union-attr]
        assert int(shells) <= 8 + 1  # the sessions' shells, plus a subshell of this pipeline


@ISOLATED
async def test_disk_cap_covers_every_writable_dir(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    cfg = sandbox_config.model_copy(update={"disk_mb": 64})
    async with sandbox_manager.sandbox(cfg, owner="attacker") as sb:
        assert "64M" in await sh(sb, "df -h /workspace | tail -1")
        out = await sh(
            sb,
            "for d in /workspace /tmp /root /var/tmp /dev/shm; do "
            "dd if=/dev/zero of=$d/fill bs=1M count=40 2>&1; done",
            timeout=120,
        )
        assert "No space left on device" in out
        total_mb = int(
            (
                await sh(
                    sb,
                    "du -smc /workspace/fill /tmp/fill /root/fill /var/tmp/fill /dev/shm/fill 2>/dev/null | tail -1",
                )
            ).split()[0]
        )
        assert total_mb <= 64
        # Nothing else inside is writable: not the image, /dev, raas's own dirs or the socket's dir.
        out = await sh(
            sb,
            "for p in /fill /etc/fill /dev/fill /.raas/fill /.raas/run/fill /.raas/lib/fill /usr/fill; do "
            "echo x > $p && echo WROTE $p; done; true",
        )
        assert "WROTE" not in out


# -- 5. escaping an upload ----------------------------------------------------------------------------


def chained_symlink_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, target in (("a", "."), ("a/b", ".."), ("b", "a/b"), ("b/x", "..")):
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
        info = tarfile.TarInfo("b/x/tmp/ESCAPED")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"evil"))
    return buf.getvalue()


def tar_of(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@ISOLATED
async def test_uploads_never_write_outside_the_destination(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    async with sandbox_manager.sandbox(sandbox_config, owner="attacker") as sb:
        dest = "/workspace/up"
        try:
            await sb.tools.upload_bytes(chained_symlink_tar(), dest)
        except RaasError as e:
            assert e.kind == "bad_request"
        out = await sh(sb, "ls -A /tmp /; find / -xdev -name ESCAPED 2>/dev/null; true")
        assert "ESCAPED" not in out
        # A symlink planted inside the destination by code in the sandbox is replaced, never followed.
        await sh(
            sb, "mkdir -p /workspace/d && ln -s /tmp /workspace/d/link && ln -s /etc/hosts /workspace/d/f"
        )
        for name in ("link/ESCAPED", "f"):
            try:
                await sb.tools.upload_bytes(tar_of(name, b"evil"), "/workspace/d")
            except RaasError as e:
                assert e.kind in ("bad_request", "tool_error")
        assert "ESCAPED" not in await sh(sb, "ls -A /tmp")
        assert "evil" not in await sh(sb, "cat /etc/hosts")
    assert not list(sb.scratch.parent.glob("**/ESCAPED"))


# -- 6. other local users ------------------------------------------------------------------------------


@ISOLATED
async def test_other_users_cannot_reach_a_sandbox(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    async with sandbox_manager.sandbox(sandbox_config, owner="t") as sb:
        for d in (sb.scratch, sb.run_dir):
            mode = d.stat().st_mode & 0o777
            assert mode & 0o066 == 0, f"{d} is {mode:o}"  # nobody else may read or write
        assert sb.run_dir.stat().st_mode & 0o777 == 0o700
        if not ROOT:
            return  # only root can play the other user here; the modes above are what keeps them out
        probe = (
            "import socket,sys,os\n"
            "for p in sys.argv[1:]:\n"
            "  try:\n"
            "    s=socket.socket(socket.AF_UNIX); s.connect(p); print('CONNECTED', p)\n"
            "  except OSError as e: print('refused', p, e.strerror)\n"
        )
        r = as_nobody("python3", "-c", probe, str(sb.socket_path))
        assert "CONNECTED" not in r.stdout and "refused" in r.stdout, r.stdout + r.stderr
        r = as_nobody("ls", str(sb.scratch), str(sb.run_dir))
        assert r.returncode != 0 and "Permission denied" in r.stderr
        r = as_nobody("touch", str(sb.run_dir / "planted"))
        assert r.returncode != 0


@pytest.mark.skipif(not ROOT, reason="needs root to plant a directory as another user")
async def test_a_pre_created_scratch_root_is_refused(tmp_path: Path) -> None:
    """Another user creates the scratch root we are about to use (a predictable name in /var/tmp)."""
    state = tmp_path / ("s" * 80)  # long enough that the scratch root moves to /var/tmp
    probe = SandboxManager(state)
    planted = probe.scratch_root
    await probe.close_all()
    shutil.rmtree(planted, ignore_errors=True)
    assert planted.parent == Path("/var/tmp")
    r = as_nobody("mkdir", "-m", "0777", str(planted))
    assert r.returncode == 0, r.stderr
    try:
        with pytest.raises(RaasError) as e:
            SandboxManager(state)
        assert e.value.kind == "sandbox_start_failed" and "owned by uid 65534" in e.value.message
    finally:
        shutil.rmtree(planted, ignore_errors=True)


# -- 7. a wedged tool server -------------------------------------------------------------------------------


@ISOLATED
async def test_stopped_tool_server_is_dead_fast(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    async with sandbox_manager.sandbox(sandbox_config, owner="t") as sb:
        # From inside: the server is pid 1, SIGSTOP is dropped by the kernel.
        assert "still" in await sh(sb, "kill -STOP 1; echo still")
        assert "again" in await sh(sb, "echo again")
        # From outside (a wedge we cannot prevent): every call, with or without a timeout, ends as
        # sandbox_dead after the liveness timeout, long before the calls' own limits.
        os.kill(server_host_pid(sb), signal.SIGSTOP)
        t0 = time.monotonic()
        calls = [sb.tools.bash("echo hi", timeout=600), sb.tools.bash("echo hi", timeout=None)]
        async with asyncio.timeout(120):  # a hang guard, not a performance bound
            results = await asyncio.gather(*calls, return_exceptions=True)
        waited = time.monotonic() - t0
        for r in results:
            assert isinstance(r, RaasError) and r.kind == "sandbox_dead", r
        assert waited < 600 and "stopped answering" in str(results[0])
        with pytest.raises(RaasError) as e:
            await sb.tools.bash("echo later")
        assert e.value.kind == "sandbox_dead"


# -- 8. host details -----------------------------------------------------------------------------------


@ISOLATED
async def test_no_host_paths_or_environment_inside(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    async with sandbox_manager.sandbox(sandbox_config, owner="t") as sb:
        host_marks = [
            str(sb.scratch),
            str(sandbox_manager.state_dir),
            str(sandbox_config.image),
            os.environ["PATH"],
        ]
        if "HOME" in os.environ:
            host_marks.append(os.environ["HOME"] + "/")
        out = await sh(
            sb,
            "for p in /proc/1 /proc/self /proc/$$; do tr '\\0' '\\n' < $p/cmdline; tr '\\0' '\\n' < $p/environ; "
            "done 2>&1; env",
        )
        for mark in host_marks:
            assert mark not in out, f"{mark!r} visible inside"
        assert "APPTAINER" not in out and "SINGULARITY" not in out


# -- 9. modules planted for the tool server's own lazy imports -------------------------------------------

PLANTED = ("re", "termios", "enum", "signal", "collections", "functools")


@pytest.mark.parametrize("backend", ["local", "bwrap", "apptainer"])
async def test_modules_planted_in_the_workdir_never_run_in_the_tool_server(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    """The server imports the bash tool (``re``, ``termios``, ``signal``, ...) with the first bash
    call, after the sandbox could write to its working directory: modules planted there must not load."""
    async with sandbox_manager.sandbox(sandbox_config, owner="attacker") as sb:
        workdir = str(sb.workspace) if sandbox_config.backend == "local" else sandbox_config.workdir
        for name in PLANTED:
            payload = f"open(__file__ + '.ran', 'w').close()\nraise ImportError('planted {name}')\n"
            await sb.tools.write_file(f"{workdir}/{name}.py", payload)
        r = await sb.tools.bash("echo up; ls *.ran 2>/dev/null | wc -l")
        assert r.exit_code == 0 and r.output == "up\n0\n", r
