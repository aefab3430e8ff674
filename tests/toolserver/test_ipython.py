"""ipython through a real Jupyter kernel (ipykernel is installed in the host venv)."""

from __future__ import annotations

import base64
import os
import struct
import zlib
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox.client import ToolClient

from .conftest import RunningServer, start_server

pytestmark = pytest.mark.integration


def tiny_png() -> bytes:
    """A valid 1x1 RGB PNG, built here so the test depends on nothing else."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00\xff\x00\x00")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


async def test_result_stdout_and_state(client: ToolClient) -> None:
    info = await client.ping()
    assert info.tools["ipython"] is True
    r = await client.ipython("x = 20\nprint('side', flush=True)\nx + 22", timeout=120)
    assert (r.result, r.stdout, r.error, r.timed_out, r.restarted) == ("42", "side\n", None, False, False)
    r = await client.ipython("import sys; print('to err', file=sys.stderr); x * 2", timeout=60)
    assert r.result == "40" and "to err" in r.stderr


async def test_error_traceback(client: ToolClient) -> None:
    r = await client.ipython("def f():\n    return 1 / 0\nf()", timeout=60)
    assert r.error is not None
    assert r.error.ename == "ZeroDivisionError"
    tb = "\n".join(r.error.traceback)
    assert "return 1 / 0" in tb and "\x1b" not in tb
    r = await client.ipython("'still' + ' alive'", timeout=60)
    assert r.result == "'still alive'"


async def test_png_display(client: ToolClient) -> None:
    png_b64 = base64.b64encode(tiny_png()).decode()
    code = (
        "import base64\nfrom IPython.display import Image, display\n"
        f"display(Image(data=base64.b64decode('{png_b64}')))"
    )
    r = await client.ipython(code, timeout=60)
    assert r.error is None
    assert len(r.images) == 1
    assert base64.b64decode(r.images[0]) == tiny_png()


async def test_hang_is_interrupted_and_state_kept(client: ToolClient) -> None:
    await client.ipython("kept = 'yes'", timeout=60)
    r = await client.ipython("import time\nprint('begin', flush=True)\ntime.sleep(60)", timeout=3)
    assert r.timed_out and not r.restarted
    assert r.error is not None and r.error.ename == "KeyboardInterrupt"
    assert "begin" in r.stdout
    r = await client.ipython("kept", timeout=60)
    assert r.result == "'yes'"


async def test_uninterruptible_hang_restarts_kernel(client: ToolClient) -> None:
    await client.ipython("import signal, time\nlost = 1", timeout=60)
    # The kernel installs its SIGINT handler per execution: ignore it inside the hanging cell.
    code = "signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.1)"
    r = await client.ipython(code, timeout=3)
    assert r.timed_out and r.restarted
    r = await client.ipython("'lost' in dir()", timeout=120)
    assert r.result == "False"


async def test_kernel_death_restarts(client: ToolClient) -> None:
    r = await client.ipython("import os; os._exit(1)", timeout=60)
    assert r.restarted and r.error is not None and r.error.ename == "KernelRestarted"
    r = await client.ipython("1 + 1", timeout=120)
    assert r.result == "2"


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="needs the distribution's python3")
async def test_unavailable_without_ipykernel(bundle_dir: Path) -> None:
    # Debian's own python3 has neither jupyter_client nor ipykernel: the real "image without ipython".
    srv = await start_server(bundle_dir, python="/usr/bin/python3")
    try:
        async with ToolClient(srv.socket) as c:
            info = await c.ping()
            assert info.tools == {"bash": True, "ipython": False, "editor": True, "files": True}
            with pytest.raises(RaasError) as exc:
                await c.ipython("1+1", timeout=10)
            assert exc.value.kind == "tool_unavailable"
            r = await c.bash("echo works")
            assert r.output == "works\n"
    finally:
        assert await srv.stop() == 0
        srv.cleanup()


async def test_restart_op_clears_state(client: ToolClient) -> None:
    await client.ipython("gone_after_restart = 1", timeout=60)
    await client.ipython_restart()
    r = await client.ipython("'gone_after_restart' in dir()", timeout=120)
    assert r.result == "False" and not r.restarted


async def test_output_is_capped(client: ToolClient) -> None:
    r = await client.ipython("print('z' * 100000)\n'q' * 100000", timeout=60, output_cap=1000)
    assert "bytes truncated" in r.stdout and len(r.stdout) < 1100
    assert r.result is not None and "bytes truncated" in r.result and len(r.result) < 1100


@pytest.mark.parametrize("when", ["before the kernel starts", "while the kernel runs"])
async def test_an_agent_that_empties_its_tmpdir_keeps_a_working_python(
    fresh_server: RunningServer, when: str
) -> None:
    """Agents clean up with ``rm -rf $TMPDIR/*``; the tool server's own temp dir (the kernel's connection
    file and sockets) lives there. Python must keep working, a restart included."""
    wipe = 'rm -rf "${TMPDIR:-/tmp}"/* "${TMPDIR:-/tmp}"/.[!.]* 2>/dev/null; ls -A "${TMPDIR:-/tmp}" | wc -l'
    async with ToolClient(fresh_server.socket, request_timeout_s=120) as c:
        if when == "while the kernel runs":
            assert (await c.ipython("kept = 41", timeout=120)).error is None
        assert (await c.bash(wipe)).output.strip() == "0"
        r = await c.ipython("kept + 1" if when == "while the kernel runs" else "6 * 7", timeout=120)
        assert (r.result, r.error) == ("42", None)
        await c.ipython_restart()
        r = await c.ipython("'kept' in dir(), 2 + 2", timeout=120)
        assert (r.result, r.error) == ("(False, 4)", None)
        assert (await c.bash(wipe)).output.strip() == "0"
        r = await c.ipython("import os; os._exit(1)", timeout=60)  # a kernel death after another wipe
        assert r.restarted
        assert (await c.ipython("3 + 3", timeout=120)).result == "6"
