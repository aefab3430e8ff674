"""In-process pieces of the tool server: framing, output capping, report parsing, argument checks."""

from __future__ import annotations

import ast
import asyncio
import errno
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

import raas.toolserver as toolserver_pkg
from raas.toolserver import ptyctl
from raas.toolserver.bashproto import Report, ReportScanner, parse_report
from raas.toolserver.bundle import BUNDLE_PACKAGE, build_bundle, verify_bundle
from raas.toolserver.output import OutputBuffer, cap_text, clean_text
from raas.toolserver.protocol import (
    ProtocolError,
    decode_body,
    encode_frame,
    read_frame,
    truncation_marker,
)
from raas.toolserver.server import validate_args

pytestmark = pytest.mark.unit

PACKAGE_DIR = Path(toolserver_pkg.__file__).parent
IN_SANDBOX_MODULES = sorted(p for p in PACKAGE_DIR.glob("*.py") if p.name != "bundle.py")


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


async def test_frame_round_trip_and_limits() -> None:
    frame = encode_frame({"id": 1, "text": "ünïcode"})
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    body = await read_frame(reader_with(frame + frame), 1 << 20)
    assert body is not None and decode_body(body) == {"id": 1, "text": "ünïcode"}
    assert await read_frame(reader_with(b""), 10) is None
    with pytest.raises(ProtocolError) as exc:
        await read_frame(reader_with(frame), 5)
    assert exc.value.kind == "payload_too_large"
    for partial in (frame[:2], frame[:-1]):
        with pytest.raises(ProtocolError) as exc:
            await read_frame(reader_with(partial), 1 << 20)
        assert exc.value.kind == "bad_request"
    for bad in (b"nope", b"[]", b"\xff"):
        with pytest.raises(ProtocolError):
            decode_body(bad)


def test_output_buffer_keeps_head_and_tail() -> None:
    buf = OutputBuffer(10)
    buf.feed(b"0123")
    assert buf.text() == ("0123", False)
    data = bytes(range(65, 91)) * 3  # 78 bytes
    buf = OutputBuffer(10)
    for i in range(0, len(data), 7):
        buf.feed(data[i : i + 7])
    head, tail, dropped = buf.raw()
    assert (head, tail, dropped) == (data[:5], data[-5:], len(data) - 10)
    text, truncated = buf.text()
    assert truncated and text == data[:5].decode() + truncation_marker(68) + data[-5:].decode()


def test_output_buffer_memory_is_bounded() -> None:
    buf = OutputBuffer(1000)
    for _ in range(10_000):
        buf.feed(b"y" * 333)
        assert len(buf._head) + len(buf._tail) <= 500 + 2 * 500
    assert buf.total == 3_330_000


def test_clean_text() -> None:
    assert clean_text(b"\x1b[1;31mred\x1b[0m \x1b]0;title\x07ok\r\n") == "red ok\n"
    assert clean_text(b"10%\r50%\r100%\ndone\r\r\n") == "100%\ndone\n"
    assert clean_text(b"bell\x07 nul\x00 tab\tend") == "bell nul tab\tend"
    assert clean_text(b"bad \xff\xfe utf8") == "bad \ufffd\ufffd utf8"
    assert cap_text("x" * 50, 10) == ("xxxxx" + truncation_marker(40) + "xxxxx", True)
    assert cap_text("short", 10) == ("short", False)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 64])
def test_report_scanner_across_chunk_boundaries(chunk: int) -> None:
    older = b"RAAS1 111 5 0  himBH 1 /old\0\0\0"  # two commands ago: output now
    fake = b"RAAS1 999 7 0  himBH 1 /fake\0\0\0"  # a look-alike with a wrong nonce
    previous = b"RAAS1 222 6 0  himBH 1 /prev\0\0\0"  # a late duplicate of the previous command's report
    real = b"RAAS1 123 7 130 xy ahimBH 01c /tmp/a b\0(v) root$ \0zero> \0"
    stream = b"out R RA " + older + fake + previous + b"RAAS1 123 6 0 " + real + b"after"
    scanner = ReportScanner()
    scanner.expect("111", 5)
    scanner.expect("222", 6)
    scanner.expect("123", 7)
    out, reports = b"", []
    for i in range(0, len(stream), chunk):
        piece, found = scanner.feed(stream[i : i + chunk])
        out += piece
        reports += found
    assert reports == [
        Report("222", 6, 0, "", "1", "/prev", "", ""),
        Report("123", 7, 130, "xya", "01c", "/tmp/a b", "(v) root$ ", "zero> "),
    ]
    assert out == b"out R RA " + older + fake + b"RAAS1 123 6 0 after"


def test_report_scanner_holds_back_only_a_possible_header() -> None:
    scanner = ReportScanner()
    assert scanner.feed(b"RAAS1 42 1 0  him 1 /\0\0\0") == (b"RAAS1 42 1 0  him 1 /\0\0\0", [])
    scanner.expect("42", 1)
    assert scanner.feed(b"ERROR\nRAAS1 4") == (b"ERROR\n", [])
    assert scanner.release() == b"RAAS1 4"
    assert scanner.feed(b"RAAS1 42 1 0 " + b"x" * 20_000) == (b"RAAS1 42 1 0 " + b"x" * 20_000, [])
    # An upper-cased report (a terminal in olcuc mode) still counts.
    assert parse_report(b"RAAS1 42 1 0 XY AHIMBH 1C /TMP\0\0\0") == Report(
        "42", 1, 0, "xya", "1c", "/TMP", "", ""
    )
    assert parse_report(b"RAAS1 42 1 0  him 1 /x\0\0") is None


def test_validate_args() -> None:
    assert validate_args("bash", "run", {"command": "ls", "timeout": 1.5}) == {
        "command": "ls",
        "timeout": 1.5,
    }
    assert validate_args("server", "ping", None) == {}
    assert validate_args("bash", "send", {"input": "y\n", "interrupt": True}) == {
        "input": "y\n",
        "interrupt": True,
    }
    for tool, op, args in [
        ("bash", "run", {"command": None}),
        ("bash", "run", {"command": "x", "timeout": float("nan")}),
        ("bash", "run", {"command": "x", "output_cap": 1.5}),
        ("bash", "send", {"interrupt": 1}),
        ("bash", "send", {"input": ["y"]}),
        ("editor", "run", {"command": "view", "path": "/", "view_range": "1,2"}),
        ("files", "read", {"path": "/x", "extra": 1}),
        ("nope", "x", {}),
    ]:
        with pytest.raises(ProtocolError) as exc:
            validate_args(tool, op, args)
        assert exc.value.kind == "bad_request"


@pytest.mark.parametrize("module", IN_SANDBOX_MODULES, ids=lambda p: p.name)
def test_in_sandbox_code_parses_as_python38(module: Path) -> None:
    """The server runs on the image's python3 (>= 3.8) and may import nothing else from raas."""
    tree = ast.parse(module.read_text(), feature_version=(3, 8))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            assert not (node.module or "").startswith("raas"), f"{module.name} imports {node.module}"
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("raas") for a in node.names), module.name


def test_bundle_is_fresh_compiled_and_verifiable(tmp_path: Path) -> None:
    first, digest = build_bundle(tmp_path)
    assert (first / BUNDLE_PACKAGE / "__main__.py").is_file()
    assert sorted(p.name for p in first.iterdir()) == [BUNDLE_PACKAGE]  # the standard library suffices
    assert any((first / BUNDLE_PACKAGE / "__pycache__").glob("*.pyc"))
    assert sorted(p.name for p in (first / BUNDLE_PACKAGE).glob("*.py")) == sorted(
        p.name for p in PACKAGE_DIR.glob("*.py")
    )
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging dirs left
    assert verify_bundle(first, digest)
    second, _ = build_bundle(tmp_path)
    assert second != first  # every build is a fresh dir: nothing is reused unchecked


@pytest.mark.parametrize("tamper", ["append", "pyc", "new_file", "symlink"])
def test_tampered_bundle_fails_verification(tmp_path: Path, tamper: str) -> None:
    bundle, digest = build_bundle(tmp_path)
    init = bundle / BUNDLE_PACKAGE / "__init__.py"
    if tamper == "append":
        init.chmod(0o644)
        with open(init, "a") as f:
            f.write("import os; os.system('touch /tmp/pwned')\n")
        os.utime(init, (0, 0))
    elif tamper == "pyc":
        pyc = next((bundle / BUNDLE_PACKAGE / "__pycache__").glob("server*.pyc"))
        data = pyc.read_bytes()
        pyc.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    elif tamper == "new_file":
        (bundle / BUNDLE_PACKAGE / "sitecustomize.py").write_text("x = 1\n")
    else:
        (bundle / "evil").symlink_to("/etc")
    assert not verify_bundle(bundle, digest)


def test_in_sandbox_code_needs_at_most_python38() -> None:
    """vermin finds the minimum Python each module needs (stdlib APIs included, not just syntax)."""
    vermin = Path(sys.executable).with_name("vermin")
    proc = subprocess.run(
        [
            str(vermin),
            "-t=3.8-",
            "--no-tips",
            "--eval-annotations",
            "--violations",
            *map(str, IN_SANDBOX_MODULES),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _read_pty(master: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child side closed
            return out
        if not chunk:
            return out
        out += chunk


def test_pty_spawn_gives_a_session_leader_its_terminal_and_nothing_else(tmp_path: Path) -> None:
    script = 'stty size; tty; echo "$FOO"; pwd; ps -o sid= -p $$; echo $$; exec ls -1 /proc/self/fd'
    pid, master = ptyctl.spawn(
        ["/bin/sh", "-c", script], str(tmp_path), {"FOO": "bar", "PATH": "/usr/bin:/bin"}, 30, 90
    )
    try:
        lines = _read_pty(master).decode().split("\n")
    finally:
        os.close(master)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, lines
    assert lines[0] == "30 90"
    assert lines[1].startswith("/dev/pts/")
    assert lines[2:4] == ["bar", str(tmp_path)]
    assert lines[4].strip() == lines[5] == str(pid)  # its own session
    assert lines[6:10] == ["0", "1", "2", "3"]  # stdio on the terminal, ls's own directory: no leaked fd
    assert "\r" not in "".join(lines)  # the tool's modes: no CR added to NL


def test_pty_spawn_reports_an_exec_failure_and_leaves_nothing_open() -> None:
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError) as info:
        ptyctl.spawn(["/nonexistent/bash"], "/", {}, 24, 80)
    assert info.value.errno == errno.ENOENT
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_descendant_walk_finds_what_the_full_scan_finds() -> None:
    """The shutdown sweep's walk down our own tree sees the same live descendants as a scan of all of /proc."""
    from raas.toolserver import procs as ts_procs

    shells = [subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"]) for _ in range(3)]
    try:
        deadline = time.monotonic() + 10
        while len(ts_procs.descendants(os.getpid()) & _tree_of(shells)) < 9 and time.monotonic() < deadline:
            time.sleep(0.02)
        full = ts_procs.descendants(os.getpid()) & _tree_of(shells)
        walked = ts_procs.descendants_walk(os.getpid())
        assert walked is not None and len(full) == 9
        assert full <= walked
    finally:
        ts_procs.kill_all(ts_procs.descendants(os.getpid()) & _tree_of(shells))
        for p in shells:
            p.wait()


def _tree_of(shells: list[subprocess.Popen[bytes]]) -> set[int]:
    from raas.toolserver import procs as ts_procs

    roots = {p.pid for p in shells}
    return roots | {pid for r in roots for pid in ts_procs.descendants(r)}
