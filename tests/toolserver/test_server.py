"""Protocol robustness, concurrency, typed client errors, and process hygiene of the server."""

from __future__ import annotations

import asyncio
import glob
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox.client import ToolClient
from raas.toolserver.protocol import encode_frame, encode_message, read_frame

from .conftest import RunningServer, path_exists, processes_tagged, start_server, wait_gone

pytestmark = pytest.mark.integration


class RawConn:
    """Speaks the wire protocol by hand, to send what a well-behaved client never would."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: str) -> RawConn:
        return cls(*await asyncio.open_unix_connection(path))

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self) -> dict | None:
        async with asyncio.timeout(30):
            body = await read_frame(self.reader, 1 << 27)
            if body is None:
                return None
            msg = json.loads(body)
            if "att" in msg:
                msg["attachment"] = await self.reader.readexactly(msg["att"])
        return msg

    async def call(self, msg: dict, attachment: bytes | None = None) -> dict:
        for part in encode_message(msg, attachment):
            await self.send_raw(part)
        got = await self.recv()
        assert got is not None
        return got

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def test_ping_handshake(client: ToolClient, shared_server: RunningServer) -> None:
    info = await client.ping()
    assert info.version == 1 and info.pid == shared_server.proc.pid
    assert info.sandbox_id == shared_server.sandbox_id
    assert info.tools["bash"] and info.tools["editor"] and info.tools["files"]
    assert info.python.count(".") == 2


async def test_bad_requests_get_typed_errors(shared_server: RunningServer) -> None:
    conn = await RawConn.open(shared_server.socket)
    try:
        bad = [
            ({"v": 1, "id": 1, "tool": "nope", "op": "run", "args": {}}, "unknown tool"),
            ({"v": 1, "id": 2, "tool": "bash", "op": "fly", "args": {}}, "unknown op"),
            ({"v": 1, "id": 3, "tool": "bash", "op": "run", "args": {"command": 5}}, "must be a string"),
            ({"v": 1, "id": 4, "tool": "bash", "op": "run", "args": {}}, "needs argument"),
            (
                {"v": 1, "id": 5, "tool": "bash", "op": "run", "args": {"command": "x", "timeout": -1}},
                "must be a number",
            ),
            (
                {"v": 1, "id": 6, "tool": "bash", "op": "run", "args": {"command": "x", "timeout": True}},
                "must be a number",
            ),
            (
                {"v": 1, "id": 7, "tool": "bash", "op": "run", "args": {"command": "x", "colour": 1}},
                "unknown arg",
            ),
            ({"v": 1, "id": 8, "tool": "bash", "op": "run", "args": []}, "args must be an object"),
            ({"v": 2, "id": 9, "tool": "server", "op": "ping"}, "version"),
            ({"v": 1, "id": 10, "op": "ping"}, "'tool' and 'op'"),
        ]
        for msg, text in bad:
            resp = await conn.call(msg)
            assert resp["id"] == msg["id"] and resp["ok"] is False
            assert resp["error"]["kind"] == "bad_request" and text in resp["error"]["message"], resp
        for body in (b"{not json", b"[1, 2]", b"\xff\xfe"):
            await conn.send_raw(struct.pack(">I", len(body)) + body)
            resp = await conn.recv()
            assert resp is not None and resp["ok"] is False and resp["error"]["kind"] == "bad_request"
        ok = await conn.call({"v": 1, "id": 99, "tool": "server", "op": "ping"})
        assert ok["ok"] is True
    finally:
        await conn.close()


async def test_oversize_frame_is_refused_and_server_stays_up(shared_server: RunningServer) -> None:
    conn = await RawConn.open(shared_server.socket)
    try:
        await conn.send_raw(struct.pack(">I", 2**31))
        resp = await conn.recv()
        assert resp is not None and resp["error"]["kind"] == "payload_too_large" and resp["id"] is None
        assert await conn.recv() is None  # the server hung up on this connection only
    finally:
        await conn.close()
    # An attachment over the server's limit is refused before a byte of it is read.
    conn = await RawConn.open(shared_server.socket)
    try:
        msg = {"v": 1, "id": 7, "tool": "files", "op": "write", "args": {"path": "/tmp/x"}, "att": 2**40}
        await conn.send_raw(encode_frame(msg))
        resp = await conn.recv()
        assert resp is not None and resp["error"]["kind"] == "payload_too_large" and resp["id"] is None
        assert await conn.recv() is None
    finally:
        await conn.close()
    async with ToolClient(shared_server.socket, max_attachment=16) as c:
        assert (await c.bash("echo up")).output == "up\n"
        with pytest.raises(RaasError) as exc:
            await c.write_file("/tmp/too-big", b"x" * 17)
        assert exc.value.kind == "payload_too_large"


async def test_truncated_frame_then_disconnect(shared_server: RunningServer) -> None:
    conn = await RawConn.open(shared_server.socket)
    await conn.send_raw(struct.pack(">I", 100) + b'{"v": 1')
    await conn.close()
    async with ToolClient(shared_server.socket) as c:
        assert (await c.ping()).version == 1


async def test_concurrent_requests_on_one_connection(
    client: ToolClient, session_name: str, shared_server: RunningServer
) -> None:
    gate = shared_server.workdir / f"{session_name}.fifo"
    os.mkfifo(gate)
    # Blocks until someone writes the fifo: answers to the calls below cannot be waiting behind it.
    slow = asyncio.create_task(client.bash(f"cat {gate}", session=session_name + "-slow", timeout=120))
    fast = [client.bash(f"echo {i}", session=f"{session_name}-{i}") for i in range(8)]
    results = await asyncio.gather(*fast, client.ping(), client.editor("view", "/"))
    assert not slow.done()
    assert [r.output for r in results[:8]] == [f"{i}\n" for i in range(8)]
    await client.bash(f"echo released > {gate}", session=f"{session_name}-0")
    assert (await slow).output == "released\n"
    for i in range(8):
        await client.bash_close(f"{session_name}-{i}")
    await client.bash_close(session_name + "-slow")


async def test_client_timeout_is_tool_timeout(client: ToolClient, session_name: str) -> None:
    with pytest.raises(RaasError) as exc:
        await client.request("bash", "run", {"command": "sleep 2", "session": session_name}, wait_s=0.2)
    assert exc.value.kind == "tool_timeout"
    # The connection is still good, and the late answer does not confuse later calls.
    r = await client.bash("echo next", session=session_name)
    assert r.output == "next\n"


async def test_dead_socket_is_sandbox_dead(tmp_path: Path) -> None:
    c = ToolClient(str(tmp_path / "absent.sock"), connect_timeout_s=2)
    with pytest.raises(RaasError) as exc:
        await c.ping()
    assert exc.value.kind == "sandbox_dead"
    await c.close()


async def test_server_killed_mid_request(fresh_server: RunningServer) -> None:
    async with ToolClient(fresh_server.socket) as c:
        pending = asyncio.create_task(c.bash("sleep 30", timeout=60))
        await c.ping()
        await asyncio.sleep(0)  # let the bash request leave before the kill
        fresh_server.proc.send_signal(signal.SIGKILL)
        with pytest.raises(RaasError) as exc:
            await pending
        assert exc.value.kind == "sandbox_dead"
        with pytest.raises(RaasError) as exc:
            await c.bash("echo again")
        assert exc.value.kind == "sandbox_dead"
    await fresh_server.proc.wait()
    # SIGKILL gives the server no chance to clean up: what it leaves is the sandbox manager's to
    # reap (here, the test's). Its shell and sleep lost their parent but still carry the sandbox id.
    for pid in processes_tagged(fresh_server.sandbox_id):
        os.kill(pid, signal.SIGKILL)
    assert await wait_gone(fresh_server.sandbox_id) == []


async def _busy_server(srv: RunningServer) -> ToolClient:
    """Start shells with foreground, background, detached and double-forked children, plus a kernel."""
    c = await ToolClient.open(srv.socket)
    await c.bash("sleep 1000 &", session="a")
    await c.bash("setsid sleep 1001 & nohup sleep 1002 >/dev/null 2>&1 &", session="b")
    await c.bash("(setsid sh -c 'sleep 1003 & exit' &) ; true", session="c")
    r = await c.ipython("import subprocess; p = subprocess.Popen(['sleep', '1004']); p.pid", timeout=120)
    assert r.error is None
    running = asyncio.create_task(c.bash("sleep 1005", session="d"))
    await asyncio.sleep(0.3)
    assert not running.done()
    assert len(processes_tagged(srv.sandbox_id)) >= 9  # server, 4 shells, kernel, >= 5 sleeps (plus helpers)
    return c


@pytest.mark.parametrize("how", ["sigterm", "sigint", "shutdown_op"])
async def test_stop_leaves_nothing(fresh_server: RunningServer, how: str) -> None:
    c = await _busy_server(fresh_server)
    try:
        if how == "shutdown_op":
            await c.shutdown()
        else:
            fresh_server.proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        async with asyncio.timeout(20):
            assert await fresh_server.proc.wait() == 0
    finally:
        await c.close()
    assert processes_tagged(fresh_server.sandbox_id) == []
    assert not path_exists(fresh_server.socket)
    assert list((fresh_server.base / "tmp").iterdir()) == []  # the server's temp dir is gone


async def test_stdin_eof_stops_server(bundle_dir: Path) -> None:
    srv = await start_server(bundle_dir, extra_args=("--watch-stdin",), stdin_pipe=True)
    try:
        async with ToolClient(srv.socket) as c:
            await c.bash("sleep 1000 &")
        assert srv.proc.stdin is not None
        srv.proc.stdin.close()
        async with asyncio.timeout(20):
            assert await srv.proc.wait() == 0
        assert processes_tagged(srv.sandbox_id) == []
        assert not path_exists(srv.socket)
    finally:
        if srv.proc.returncode is None:
            await srv.stop()
        srv.cleanup()


async def test_watch_stdin_on_devnull_is_harmless(bundle_dir: Path) -> None:
    srv = await start_server(bundle_dir, extra_args=("--watch-stdin",))  # stdin is /dev/null here
    try:
        async with ToolClient(srv.socket) as c:
            assert (await c.bash("echo up")).output == "up\n"
    finally:
        assert await srv.stop() == 0
        srv.cleanup()


async def test_parent_death_stops_server(bundle_dir: Path, tmp_path: Path) -> None:
    """The server's parent dies without any cleanup: the server notices and cleans up after itself."""
    sock = str(Path("/tmp") / f"raas-pd-{os.getpid()}-{tmp_path.name[-6:]}.sock")
    sandbox_id = f"test-pd-{tmp_path.name[-6:]}"
    parent_code = (
        "import subprocess, sys, os\n"
        f"p = subprocess.Popen([sys.executable, '-m', 'raas_toolserver', '--socket', {sock!r}],"
        " stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)\n"
        "sys.stdout.write(p.stdout.readline().decode()); sys.stdout.flush()\n"
        "sys.stdin.read()\n"
        "os._exit(0)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(bundle_dir), RAAS_SANDBOX_ID=sandbox_id)
    parent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        parent_code,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert parent.stdout is not None and parent.stdin is not None
    async with asyncio.timeout(30):
        assert (await parent.stdout.readline()).strip() == b"RAAS_TOOLSERVER_READY 1"
    async with ToolClient(sock) as c:
        await c.bash("sleep 1000 &")
    parent.stdin.close()
    await parent.wait()
    assert await wait_gone(sandbox_id, limit_s=20) == []
    assert not path_exists(sock)


WEIRD_VALUES = [None, True, -1, 1.5, 2**60, float("nan"), "", "\0", "\ud800", "x" * 10, [], {}, [1, "a"]]


def _valid_calls(workdir: Path) -> list[tuple[str, str, dict, bytes | None]]:
    return [
        ("bash", "run", {"command": "true", "session": "fz", "timeout": 10, "no_output_timeout": 10}, None),
        ("bash", "close", {"session": "fz"}, None),
        ("bash", "list", {}, None),
        ("ipython", "run", {"code": "1", "timeout": 60}, None),
        ("files", "write", {"path": f"{workdir}/f"}, b""),
        (
            "editor",
            "run",
            {
                "command": "view",
                "path": f"{workdir}/f",
                "view_range": [1, 1],
                "insert_line": 0,
                "old_str": "a",
                "new_str": "b",
                "file_text": "t",
            },
            None,
        ),
        ("files", "upload", {"path": f"{workdir}/up"}, tar_bytes({})),
        ("files", "download", {"path": str(workdir / "up")}, None),
        ("files", "read", {"path": f"{workdir}/f"}, None),
        ("server", "ping", {}, None),
    ]


def tar_bytes(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def test_no_input_crashes_the_server(fresh_server: RunningServer) -> None:
    """Every op with each argument replaced by odd values: always a typed answer, never ``internal``."""
    conn = await RawConn.open(fresh_server.socket)
    try:
        req_id = 0
        kinds: set[str] = set()
        for tool, op, valid, attachment in _valid_calls(fresh_server.workdir):
            req_id += 1
            resp = await conn.call({"v": 1, "id": req_id, "tool": tool, "op": op, "args": valid}, attachment)
            assert resp["ok"], (tool, op, resp)
            for name in [*valid, "unexpected"]:
                for value in WEIRD_VALUES:
                    req_id += 1
                    args = dict(valid)
                    args[name] = value
                    resp = await conn.call(
                        {"v": 1, "id": req_id, "tool": tool, "op": op, "args": args}, attachment
                    )
                    assert resp["id"] == req_id
                    if not resp["ok"]:
                        kinds.add(resp["error"]["kind"])
                        assert resp["error"]["kind"] != "internal", (tool, op, name, value, resp)
        assert kinds == {"bad_request", "tool_error"}
        assert (await conn.call({"v": 1, "id": 0, "tool": "server", "op": "ping"}))["ok"]
    finally:
        await conn.close()


def _old_python() -> str | None:
    """A Python 3.8 on this machine, if any (pyenv or the distribution)."""
    found = shutil.which("python3.8")
    candidates = [found] if found else []
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python3.8")))
    for c in candidates:
        if c and subprocess.run([c, "-c", "import ctypes, termios"], capture_output=True).returncode == 0:
            return c
    return None


OLD_PYTHON = _old_python()


@pytest.mark.skipif(OLD_PYTHON is None, reason="no Python 3.8 interpreter on this machine")
async def test_runs_on_python38(bundle_dir: Path) -> None:
    """Images may ship an old python3: the whole server runs on 3.8."""
    assert OLD_PYTHON is not None
    srv = await start_server(bundle_dir, python=OLD_PYTHON)
    try:
        async with ToolClient(srv.socket) as c:
            info = await c.ping()
            assert info.python.startswith("3.8.")
            r = await c.bash("echo hi; sleep 30", timeout=1)
            assert r.timed_out and r.output.startswith("hi")
            assert (await c.bash("exit 4")).exit_code == 4
            path = f"{srv.workdir}/a.txt"
            await c.editor("create", path, file_text="x\ny")
            await c.editor("str_replace", path, old_str="y", new_str="z")
            await c.upload_bytes(await c.download(str(srv.workdir)), f"{srv.workdir}/copy")
            assert (await c.bash("cat copy/a.txt")).output == "x\nz"
    finally:
        assert await srv.stop() == 0
        assert await wait_gone(srv.sandbox_id) == []
        srv.cleanup()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_no_fd_or_file_leaks_across_restarts(fresh_server: RunningServer) -> None:
    pid = fresh_server.proc.pid
    tmp = fresh_server.base / "tmp"
    async with ToolClient(fresh_server.socket) as c:
        await c.bash("true")
        await c.bash("true", session="other")
        await c.bash_close("other")
        fds, files = open_fds(pid), len(list(tmp.rglob("*")))
        for i in range(10):
            assert (await c.bash("exit 1")).restarted
            await c.bash("true", session=f"tmp-{i}")
            assert await c.bash_close(f"tmp-{i}")
            r = await c.bash("sleep 30", timeout=0.2)
            assert r.timed_out
        assert open_fds(pid) == fds
        assert len(list(tmp.rglob("*"))) == files  # one shell's command and rc file, one temp dir


async def test_unbindable_socket_fails_cleanly(bundle_dir: Path, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(bundle_dir), TMPDIR=str(tmp_path))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "raas_toolserver",
        "--socket",
        str(tmp_path / "missing" / "tool.sock"),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    async with asyncio.timeout(30):
        out, err = await proc.communicate()
    assert proc.returncode == 2 and out == b""
    assert b"cannot serve on" in err and b"Traceback" not in err
    assert os.listdir(tmp_path) == []
