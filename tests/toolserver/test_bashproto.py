"""The bash protocol's pure parts, checked against a real bash where it matters: quoting, lines, keys."""

from __future__ import annotations

import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raas.toolserver import bashproto

pytestmark = pytest.mark.unit


def bash_prints(expr: str) -> bytes:
    return subprocess.run(
        ["bash", "--norc", "-c", "printf %s " + expr], capture_output=True, check=True
    ).stdout


@settings(max_examples=60, deadline=None, database=None)
@given(st.binary(max_size=300))
def test_ansi_c_quote_round_trips_through_bash(data: bytes) -> None:
    quoted = bashproto.ansi_c_quote(data)
    assert quoted.isascii() and "!" not in quoted and all(0x20 <= ord(c) < 0x7F for c in quoted)
    assert bash_prints(quoted) == data.split(b"\0")[0]  # bash strings end at NUL: commands have none


PATHS = bashproto.Paths("/proc/1/fd/5", "/proc/1/fd/7", "/proc/1/fd/8")


def test_command_line_shape() -> None:
    data = bashproto.command_bytes("echo hi\0there")
    assert data == b"echo hithere\n"
    inline = bashproto.inline_argument(data)
    assert inline == "$'echo hithere\\x0a'"
    assert bashproto.inline_argument(b"x" * (bashproto.INLINE_MAX + 1)) is None
    # The common case: one assignment restores PS1 and sets $? to 0, then eval, then the report.
    line = bashproto.command_line(3, "1234", bashproto.ShellState(), inline, PATHS)
    assert line == (
        b"__raas_in=1 PS1=$__raas_p1 __raas_c=$'echo hithere\\x0a'; "
        b'\\builtin eval "$__raas_c"; { __raas_z 3 1234 $?; } >&0\n'
    )
    state = bashproto.ShellState(130, "xhy", "0c")
    line = bashproto.command_line(4, "1234", state, None, PATHS, runner=True)
    for part in (
        b"PS0=$__raas_p0",
        b"\\builtin unset PS1;",
        b"read -r -d '' __raas_c </proc/1/fd/5;",
        b"__raas_pc;",
        b"\\builtin set -o history;",
        b"\\builtin set -o vi;",
        b"\\builtin set -x; }' DEBUG;",
        b"__raas_rc 130 || \\builtin source /proc/1/fd/8;",
    ):
        assert part in line, part
    assert len(line) < 4096 and b"!" not in line and line.count(b"\n") == 1


def test_needs_runner() -> None:
    assert bashproto.needs_runner("set -o vi")
    assert bashproto.needs_runner("set +o emacs; ls")
    assert not bashproto.needs_runner("vim x; git log --no-emacs-thing; echo visual")


def test_input_bytes() -> None:
    assert bashproto.input_bytes("C-c") == b"\x03"
    assert bashproto.input_bytes("C-d") == b"\x04"
    assert bashproto.input_bytes("y\n") == b"y\n"
    assert bashproto.input_bytes("é") == "é".encode()
