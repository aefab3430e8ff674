"""Every tool against every backend that runs here, plus isolation, limits, death and cancellation."""

from __future__ import annotations

import asyncio
import io
import os
import resource
import shutil
import signal
import tarfile
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox import SandboxConfig, SandboxManager
from raas.sandbox import procs as sbprocs
from raas.sandbox.config import make_config
from tests.conftest import SANDBOX_BACKENDS

pytestmark = pytest.mark.integration
ALL = pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
ISOLATED = pytest.mark.parametrize("backend", [b for b in SANDBOX_BACKENDS if b != "local"])


@ALL
async def test_bash_session_state_and_workspace(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    async with sandbox_manager.sandbox(sandbox_config, owner="t") as sb:
        assert sb.alive and sb.server_info.sandbox_id == sb.id
        r = await sb.tools.bash("echo hello")
        assert (r.output.strip(), r.exit_code) == ("hello", 0)
        await sb.tools.bash("mkdir -p sub && cd sub && export RAAS_T=42 && f() { echo fn-$1; }")
        r = await sb.tools.bash("pwd; echo $RAAS_T; f x; false")
        lines = r.output.split()
        assert lines[0].endswith("/sub") and lines[1:] == ["42", "fn-x"] and r.exit_code == 1
        await sb.tools.bash("echo data > ../from_inside.txt")
        wd = sandbox_config.workdir if sandbox_config.backend != "local" else str(sb.workspace)
        assert await sb.tools.read_file(f"{wd}/from_inside.txt") == b"data\n"
        if sandbox_config.backend == "local":  # the local workspace is a host dir, private to us
            assert (sb.workspace / "from_inside.txt").read_text() == "data\n"
            assert sb.workspace.stat().st_mode & 0o077 == 0
        other = await sb.tools.bash("pwd", session="second")
        assert not other.output.strip().endswith("/sub")


@ALL
async def test_ipython_editor_files(sandbox_manager: SandboxManager, sandbox_config: SandboxConfig) -> None:
    async with sandbox_manager.sandbox(sandbox_config, owner="t") as sb:
        wd = (await sb.tools.bash("pwd")).output.strip()
        r = await sb.tools.ipython("x = 20\nprint('out', x)\nx + 22")
        assert r.stdout.strip() == "out 20" and r.result == "42" and r.error is None
        r = await sb.tools.ipython("1/0")
        assert r.error is not None and r.error.ename == "ZeroDivisionError"
        await sb.tools.editor("create", f"{wd}/a.py", file_text="a = 1\nb = 2\n")
        await sb.tools.editor("str_replace", f"{wd}/a.py", old_str="b = 2", new_str="b = 3")
        view = await sb.tools.editor("view", f"{wd}/a.py")
        assert "b = 3" in view.output
        with pytest.raises(RaasError) as e:
            await sb.tools.editor("str_replace", f"{wd}/a.py", old_str="not there", new_str="x")
        assert e.value.kind == "tool_error"
        await sb.tools.write_file(f"{wd}/bin.dat", bytes(range(256)))
        assert await sb.tools.read_file(f"{wd}/bin.dat") == bytes(range(256))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("tree/leaf.txt")
            info.size = 4
            tar.addfile(info, io.BytesIO(b"leaf"))
        await sb.tools.upload_bytes(buf.getvalue(), wd)
        assert (await sb.tools.bash("cat tree/leaf.txt")).output.strip() == "leaf"
        with tarfile.open(fileobj=io.BytesIO(await sb.tools.download(f"{wd}/tree")), mode="r") as tar:
            names = tar.getnames()
        assert any(n.endswith("leaf.txt") for n in names)


@ISOLATED
async def test_network_off_and_on(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str
) -> None:
    hits = 0

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal hits
        hits += 1
        writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    probe = (
        f'python3 -c "import socket; s=socket.socket(); s.settimeout(5); '
        f"s.connect(('127.0.0.1', {port})); print('CONNECTED')\""
    )
    try:
        async with sandbox_manager.sandbox(sandbox_config, owner="t") as sb:
            r = await sb.tools.bash(probe)
            assert "CONNECTED" not in r.output and r.exit_code != 0
            r = await sb.tools.bash(
                "python3 -c \"import socket; s=socket.socket(); s.settimeout(5); s.connect(('1.1.1.1', 53))\""
            )
            assert r.exit_code != 0 and ("unreachable" in r.output.lower() or "refused" in r.output.lower())
        on = sandbox_config.model_copy(update={"network": True})
        async with sandbox_manager.sandbox(on, owner="t") as sb:
            r = await sb.tools.bash(probe)
            assert "CONNECTED" in r.output, r.output
        assert hits == 1
    finally:
        server.close()
        await server.wait_closed()


@ISOLATED
async def test_root_writes_on_host(sandbox_manager: SandboxManager, sandbox_config: SandboxConfig) -> None:
    """``root_writes="host"``: the writable area is a host dir (disk, not RAM), private to the sandbox."""
    cfg = sandbox_config.model_copy(update={"root_writes": "host"})
    async with sandbox_manager.sandbox(cfg, owner="t") as sb:
        r = await sb.tools.bash("head -c 3000000 /dev/zero > big && echo $?")
        assert r.output.strip() == "0"
        assert (sb.area_dir / "ws" / "big").stat().st_size == 3000000  # on disk, not RAM
        assert sb.area_dir.stat().st_mode & 0o077 == 0


@ALL
async def test_command_timeout_from_config(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    cfg = sandbox_config.model_copy(update={"command_timeout_s": 1.0})
    async with sandbox_manager.sandbox(cfg, owner="t") as sb:
        r = await sb.tools.bash("echo start; sleep 60")
        assert r.timed_out and "start" in r.output
        r = await sb.tools.bash("echo still-usable")
        assert r.output.strip() == "still-usable" and not r.timed_out


@ALL
async def test_rlimits(sandbox_manager: SandboxManager, sandbox_config: SandboxConfig) -> None:
    # RLIMIT_NPROC counts every process of the host uid (see limits.py): for a normal user that is all of
    # its processes, so only a generous value is safe to set here; that it arrives is what is checked.
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = 50000 if hard == resource.RLIM_INFINITY or hard > 50000 else hard
    cfg = sandbox_config.model_copy(update={"memory_mb": 1024, "file_size_mb": 1, "max_procs": nproc})
    async with sandbox_manager.sandbox(cfg, owner="t") as sb:
        r = await sb.tools.bash("ulimit -f; ulimit -v; ulimit -u")
        assert r.output.split() == [str(1024), str(1024 * 1024), str(nproc)]  # bash reports KiB blocks
        r = await sb.tools.bash("head -c 2000000 /dev/zero > big; echo rc=$?; stat -c %s big")
        assert "rc=0" not in r.output and r.output.strip().endswith(str(1 << 20))
        r = await sb.tools.bash("python3 -c 'x = bytearray(2000 << 20)' 2>&1 | tail -1")
        assert "MemoryError" in r.output


@ALL
async def test_output_cap_from_config(sandbox_manager: SandboxManager, sandbox_config: SandboxConfig) -> None:
    cfg = sandbox_config.model_copy(update={"output_cap_bytes": 2000})
    async with sandbox_manager.sandbox(cfg, owner="t") as sb:
        r = await sb.tools.bash("seq 1 100000")
        assert r.truncated and "bytes truncated" in r.output and len(r.output) < 2200
        assert r.output.startswith("1\n2\n") and r.output.rstrip().endswith("100000")


@ALL
async def test_sandbox_death_is_typed(sandbox_manager: SandboxManager, sandbox_config: SandboxConfig) -> None:
    sb = await sandbox_manager.start(sandbox_config, owner="t")
    try:
        assert sb.pid is not None
        os.kill(sb.pid, signal.SIGKILL)  # the launcher (bwrap / apptainer / the local server)
        with pytest.raises(RaasError) as e:
            for _ in range(100):  # the first call may already be on its way when the death is noticed
                await sb.tools.bash("echo hi")
        assert e.value.kind == "sandbox_dead"
        await asyncio.wait_for(sb.wait_exited(), 60)
        assert not sb.alive
    finally:
        await sb.close()
    with pytest.raises(RaasError) as e:
        await sb.tools.bash("echo hi")
    assert e.value.kind == "sandbox_dead"


@pytest.mark.parametrize("backend", ["local"])
async def test_server_killed_from_inside(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    async with sandbox_manager.sandbox(sandbox_config, owner="t") as sb:
        with pytest.raises(RaasError) as e:
            await sb.tools.bash("kill -9 $PPID; sleep 30")
        assert e.value.kind == "sandbox_dead"
        await asyncio.wait_for(sb.wait_exited(), 60)
        assert sbprocs.pids_with_env(sb.id) == []


@ISOLATED
async def test_server_cannot_be_killed_or_stopped_from_inside(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    """In a container the tool server is pid 1 of the sandbox: the kernel drops SIGKILL and SIGSTOP
    sent to it from inside, so model-written code cannot take the sandbox down or wedge it."""
    async with sandbox_manager.sandbox(sandbox_config, owner="t") as sb:
        r = await sb.tools.bash("echo ppid=$PPID; kill -9 1; kill -STOP 1; kill -9 $PPID; echo alive")
        assert "ppid=1" in r.output and "alive" in r.output
        assert (await sb.tools.bash("echo still")).output.strip() == "still"
        assert sb.alive


@ALL
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.1])
async def test_cancel_during_start_leaves_nothing(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, delay: float
) -> None:
    task = asyncio.create_task(sandbox_manager.start(sandbox_config, owner="t"))
    await asyncio.sleep(delay)
    task.cancel()
    try:
        sb = await task
    except asyncio.CancelledError:
        pass
    else:  # it won the race: closing must still work
        await sb.close()
    assert sandbox_manager.list() == []


@ALL
async def test_cancel_during_command_closes(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> None:
    started = asyncio.Event()

    async def job() -> None:
        async with sandbox_manager.sandbox(sandbox_config, owner="job") as sb:
            await sb.tools.bash("nohup sleep 300 >/dev/null 2>&1 &")
            started.set()
            await sb.tools.bash("sleep 300")

    task = asyncio.create_task(job())
    await asyncio.wait_for(started.wait(), 120)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sandbox_manager.list() == []


@ALL
async def test_many_sandboxes_at_once(sandbox_manager: SandboxManager, sandbox_config: SandboxConfig) -> None:
    n = 8

    async def one(i: int) -> str:
        async with sandbox_manager.sandbox(sandbox_config, owner=f"o{i % 2}") as sb:
            r = await asyncio.gather(*(sb.tools.bash(f"echo {i}-{k}", session=f"s{k}") for k in range(3)))
            return " ".join(x.output.strip() for x in r)

    out = await asyncio.gather(*(one(i) for i in range(n)))
    assert out == [f"{i}-0 {i}-1 {i}-2" for i in range(n)]


@ALL
async def test_close_owner_and_lease(sandbox_manager: SandboxManager, sandbox_config: SandboxConfig) -> None:
    a = await sandbox_manager.start(sandbox_config, owner="a")
    b = await sandbox_manager.start(sandbox_config, owner="b")
    assert await sandbox_manager.close_owner("a") == 1
    assert a.closed and not b.closed and a.id not in {p.name for p in sandbox_manager.scratch_root.iterdir()}
    sandbox_manager.renew(b, 0.2)
    await asyncio.wait_for(b.wait_closed(), 60)
    assert b.closed and sandbox_manager.list() == []


@ISOLATED
async def test_bad_images_are_typed_errors(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, visible_tmp: Path
) -> None:
    missing = sandbox_config.model_copy(update={"image": "/nonexistent/rootfs"})
    with pytest.raises(RaasError) as e:
        await sandbox_manager.start(missing, owner="t")
    assert e.value.kind == "bad_request"
    empty = visible_tmp / "empty-rootfs"
    for d in ("tmp", "root", ".raas/lib", ".raas/run", "workspace"):
        (empty / d).mkdir(parents=True)
    no_python = sandbox_config.model_copy(update={"image": str(empty)})
    with pytest.raises(RaasError) as e:
        await sandbox_manager.start(no_python, owner="t")
    assert e.value.kind == "sandbox_start_failed" and "before ready" in e.value.message
    assert sandbox_manager.list() == []


@ALL
async def test_start_timeout_is_typed(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str, visible_tmp: Path
) -> None:
    # Test double of a tool server that hangs before it is ready: a package of the same name whose boot
    # step sleeps.
    hung = visible_tmp / "hung-server"
    (hung / "raas_toolserver").mkdir(parents=True)
    (hung / "raas_toolserver" / "__init__.py").write_text("")
    (hung / "raas_toolserver" / "boot.py").write_text("import time\ntime.sleep(600)\n")
    for p in (hung, hung / "raas_toolserver"):
        p.chmod(0o755)
    inner = str(hung) if backend == "local" else "/srv/hung"
    cfg = sandbox_config.model_copy(
        update={
            "start_timeout_s": 1.0,
            "env": {"PYTHONPATH": inner},
            "binds": [] if backend == "local" else [f"{hung}:{inner}:ro"],
        }
    )
    with pytest.raises(RaasError) as e:
        await sandbox_manager.start(cfg, owner="t")
    assert e.value.kind == "sandbox_start_failed" and "not ready after" in e.value.message
    assert sandbox_manager.list() == []  # and the fixture checks the hung process is gone


async def test_docker_when_an_engine_answers(sandbox_manager: SandboxManager) -> None:
    """Runs only where a Docker engine answers (CI has none); RAAS_TEST_DOCKER_IMAGE needs python3."""
    probe = (
        await asyncio.create_subprocess_exec(
            "docker", "info", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        if shutil.which("docker")
        else None
    )
    if probe is None or await probe.wait() != 0:
        pytest.skip("no Docker engine answers here")
    image = os.environ.get("RAAS_TEST_DOCKER_IMAGE", "python:3.12-slim")
    async with sandbox_manager.sandbox(make_config(backend="docker", image=image), owner="t") as sb:
        assert (await sb.tools.bash("echo hi")).output.strip() == "hi"


CHATTY = """import os, runpy, sys
# Test double: floods stdout (one line far over the reader's limit, then normal lines), then runs the
# real boot step and tool server, which must still be found through its ready line.
sys.stdout.write("x" * 300000 + "\\n" + "hello\\n" * 1000)
sys.stdout.flush()
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
for name in [m for m in sys.modules if m == "raas_toolserver" or m.startswith("raas_toolserver.")]:
    del sys.modules[name]
runpy.run_module("raas_toolserver.boot", run_name="__main__", alter_sys=True)
"""


async def test_chatty_server_is_still_found(
    sandbox_manager: SandboxManager, tmp_path_factory: pytest.TempPathFactory
) -> None:
    chatty = tmp_path_factory.mktemp("chatty-server")
    (chatty / "raas_toolserver").mkdir()
    (chatty / "raas_toolserver" / "__init__.py").write_text("")
    (chatty / "raas_toolserver" / "boot.py").write_text(CHATTY)
    bundle = await sandbox_manager.bundle_dir()
    cfg = make_config(backend="local", env={"PYTHONPATH": f"{chatty}:{bundle}"})
    async with sandbox_manager.sandbox(cfg, owner="t") as sb:
        assert (await sb.tools.bash("echo fine")).output.strip() == "fine"


SILENT = """import os, socket, sys, time
# Test double: a tool server that announces itself ready, accepts a connection, then never answers.
path = sys.argv[sys.argv.index("--socket") + 1]
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
srv.listen()
print("RAAS_TOOLSERVER_READY 1", flush=True)
conn, _ = srv.accept()
with open(os.environ["RAAS_TEST_FIFO"], "w") as f:
    f.write("accepted")
time.sleep(600)
"""


async def test_cancel_during_handshake_closes_the_connection(
    sandbox_manager: SandboxManager, tmp_path_factory: pytest.TempPathFactory
) -> None:
    silent = tmp_path_factory.mktemp("silent-server")
    (silent / "raas_toolserver.py").write_text(SILENT)
    fifo = silent / "accepted.fifo"
    os.mkfifo(fifo)
    cfg = make_config(backend="local", env={"PYTHONPATH": str(silent), "RAAS_TEST_FIFO": str(fifo)})
    task = asyncio.create_task(sandbox_manager.start(cfg, owner="t"))
    # Blocks until the double has accepted our connection (a FIFO read: no polling).
    assert await asyncio.wait_for(asyncio.to_thread(lambda: open(fifo).read()), 60) == "accepted"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sandbox_manager.list() == []  # the fixture checks no socket, process or dir is left
