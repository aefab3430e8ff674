"""bash over the real server: a pty, a real bash, the real socket and client."""

from __future__ import annotations

import asyncio

import pytest

from raas.sandbox.client import ToolClient
from raas.toolserver.protocol import truncation_marker

from .conftest import RunningServer

pytestmark = pytest.mark.integration


async def test_echo_and_exit_code(client: ToolClient, session_name: str) -> None:
    r = await client.bash("echo hello", session=session_name)
    assert (r.output, r.exit_code, r.timed_out, r.restarted) == ("hello\n", 0, False, False)
    r = await client.bash("false", session=session_name)
    assert r.exit_code == 1 and r.output == ""
    r = await client.bash("(exit 42)", session=session_name)
    assert r.exit_code == 42


async def test_state_persists(client: ToolClient, session_name: str, shared_server: RunningServer) -> None:
    d = shared_server.workdir / session_name
    d.mkdir()
    await client.bash(f'cd {d} && export GREETING=hi && shout() {{ echo "$1!"; }}', session=session_name)
    r = await client.bash('pwd; echo "$GREETING"; shout hey', session=session_name)
    assert r.output == f"{d}\nhi\nhey!\n"
    assert r.cwd == str(d)


async def test_sessions_are_independent(client: ToolClient, session_name: str) -> None:
    await client.bash("X=one", session=session_name + "-a")
    await client.bash("X=two", session=session_name + "-b")
    a = await client.bash("echo $X", session=session_name + "-a")
    b = await client.bash("echo $X", session=session_name + "-b")
    assert (a.output, b.output) == ("one\n", "two\n")
    assert await client.bash_close(session_name + "-a")
    assert await client.bash_close(session_name + "-b")
    assert not await client.bash_close(session_name + "-a")
    names = {s.session for s in await client.bash_list()}
    assert session_name + "-a" not in names


async def test_multiline_heredoc_and_syntax_error(client: ToolClient, session_name: str) -> None:
    cmd = "for i in 1 2 3; do\n  echo line $i\ndone\ncat <<'EOF'\n$NOT_EXPANDED\n  indented\nEOF\n"
    r = await client.bash(cmd, session=session_name)
    assert r.output == "line 1\nline 2\nline 3\n$NOT_EXPANDED\n  indented\n"
    r = await client.bash("echo 'unterminated", session=session_name)
    assert r.exit_code != 0 and "unexpected EOF" in r.output
    r = await client.bash("if then fi", session=session_name)
    assert r.exit_code != 0 and "syntax error" in r.output
    r = await client.bash("echo still-alive", session=session_name)
    assert (r.output, r.restarted) == ("still-alive\n", False)


async def test_long_single_line_command(client: ToolClient, session_name: str) -> None:
    # Longer than a tty's canonical line buffer (4096): only works because the command goes via a file.
    payload = "x" * 20000
    r = await client.bash(f"echo {payload} | wc -c", session=session_name)
    assert r.output.strip() == "20001"


async def test_stdin_reader_times_out_and_session_survives(client: ToolClient, session_name: str) -> None:
    await client.bash("MARK=kept", session=session_name)
    r = await client.bash("read line; echo got $line", session=session_name, timeout=1)
    assert r.timed_out and r.interrupted and not r.restarted
    r = await client.bash("cat", session=session_name, timeout=1)
    assert r.timed_out and not r.restarted
    r = await client.bash("echo $MARK", session=session_name)
    assert r.output == "kept\n" and r.exit_code == 0


async def test_timeout_returns_partial_output(client: ToolClient, session_name: str) -> None:
    r = await client.bash("echo before; sleep 30; echo after", session=session_name, timeout=1)
    assert r.timed_out and r.interrupted and not r.restarted
    assert "before" in r.output and "after" not in r.output
    assert r.exit_code == 130
    r = await client.bash("echo ok", session=session_name)
    assert r.output == "ok\n"


async def test_sigint_ignoring_command_is_killed(client: ToolClient, session_name: str) -> None:
    r = await client.bash(
        "python3 -c 'import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)'",
        session=session_name,
        timeout=1,
    )
    assert r.timed_out and not r.restarted
    assert r.exit_code == 137
    assert (await client.bash("echo alive", session=session_name)).output == "alive\n"


async def test_unrecoverable_shell_is_restarted(client: ToolClient, session_name: str) -> None:
    await client.bash("VAR=lost", session=session_name)
    r = await client.bash("trap '' INT; while :; do :; done", session=session_name, timeout=1)
    assert r.timed_out and r.restarted and r.exit_code is None
    r = await client.bash("echo ${VAR:-fresh}", session=session_name)
    assert r.output == "fresh\n" and not r.restarted


async def test_no_output_timeout(client: ToolClient, session_name: str) -> None:
    r = await client.bash("echo start; sleep 60", session=session_name, no_output_timeout=1)
    assert r.timed_out and r.output.strip() == "start"
    # A command that keeps printing is not cut by the no-output limit.
    r = await client.bash(
        "for i in 1 2 3 4 5 6; do echo $i; sleep 0.3; done", session=session_name, no_output_timeout=1.5
    )
    assert not r.timed_out and r.output.split() == ["1", "2", "3", "4", "5", "6"]


async def test_exit_restarts_session(
    client: ToolClient, session_name: str, shared_server: RunningServer
) -> None:
    await client.bash("cd / && Y=gone", session=session_name)
    r = await client.bash("exit 3", session=session_name)
    assert r.restarted and r.exit_code == 3
    assert r.cwd == str(shared_server.workdir)
    r = await client.bash("echo ${Y:-fresh}; pwd", session=session_name)
    assert r.output == f"fresh\n{shared_server.workdir}\n"


async def test_background_job(client: ToolClient, session_name: str, shared_server: RunningServer) -> None:
    marker = shared_server.workdir / f"{session_name}.bg"
    r = await client.bash(f"(sleep 0.5; echo done > {marker}) &", session=session_name, timeout=10)
    assert r.exit_code == 0 and not r.timed_out
    r = await client.bash(f"wait; cat {marker}", session=session_name, timeout=10)
    assert r.output.strip().endswith("done")
    r = await client.bash("sleep 300 & echo started $!", session=session_name, timeout=10)
    assert "started" in r.output and not r.timed_out


async def test_huge_output_is_capped(client: ToolClient, session_name: str) -> None:
    r = await client.bash("seq 1 2000000", session=session_name, timeout=120)
    assert r.truncated and r.exit_code == 0
    head, marker_and_tail = r.output.split("\n[... ", 1)
    assert head.startswith("1\n2\n3\n")
    assert marker_and_tail.endswith("1999999\n2000000\n")
    total = sum(len(f"{i}\n") for i in range(1, 2000001))
    dropped = total - 30000
    assert truncation_marker(dropped) in r.output
    r = await client.bash("seq 1 1000", session=session_name, output_cap=100)
    assert r.truncated and len(r.output.encode()) < 100 + 60


async def test_binary_and_ansi_output(client: ToolClient, session_name: str) -> None:
    r = await client.bash(
        r"printf 'a\x00b\xff\xfec\n'; printf '\033[31mred\033[0m\n'; head -c 3000 /dev/urandom",
        session=session_name,
    )
    assert r.exit_code == 0
    lines = r.output.split("\n")
    assert lines[0] == "ab\ufffd\ufffdc"
    assert lines[1] == "red"
    assert "\x1b" not in r.output and "\x00" not in r.output
    r = await client.bash(r"printf 'progress 10%%\rprogress 100%%\n'", session=session_name)
    assert r.output == "progress 100%\n"


async def test_many_sessions_concurrently(client: ToolClient, session_name: str) -> None:
    names = [f"{session_name}-{i}" for i in range(12)]
    results = await asyncio.gather(
        *(client.bash(f"sleep 0.2; echo {n}", session=n, timeout=60) for n in names)
    )
    assert [r.output for r in results] == [f"{n}\n" for n in names]
    # Requests to one session queue up in order.
    ordered = await asyncio.gather(*(client.bash(f"echo {i}", session=names[0]) for i in range(10)))
    assert [r.output for r in ordered] == [f"{i}\n" for i in range(10)]
    for n in names:
        assert await client.bash_close(n)


async def test_sandbox_id_exported(
    client: ToolClient, session_name: str, shared_server: RunningServer
) -> None:
    r = await client.bash("echo $RAAS_SANDBOX_ID; echo ${PYTHONPATH:-none}", session=session_name)
    assert r.output.split("\n")[0] == shared_server.sandbox_id
    assert r.output.split("\n")[1] == "none"
