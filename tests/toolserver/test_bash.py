"""bash over the real server: a pty, a real bash, the real socket and client."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox.client import ToolClient
from raas.toolserver.protocol import truncation_marker

from .conftest import RunningServer, start_server

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
    # Ignore SIGINT first (children inherit it), so Ctrl-C cannot win a race with the command's start.
    await client.bash("trap '' INT", session=session_name)
    r = await client.bash("sleep 60", session=session_name, timeout=1)
    assert r.timed_out and not r.restarted
    assert r.exit_code == 137
    await client.bash("trap - INT", session=session_name)
    assert (await client.bash("echo alive", session=session_name)).output == "alive\n"


async def test_unrecoverable_shell_is_restarted(client: ToolClient, session_name: str) -> None:
    await client.bash("VAR=lost; trap '' INT", session=session_name)
    # A busy loop in the shell itself: Ctrl-C is ignored and the foreground group is the shell.
    r = await client.bash("while :; do :; done", session=session_name, timeout=1)
    assert r.timed_out and r.restarted and r.exit_code is None
    r = await client.bash("echo ${VAR:-fresh}", session=session_name)
    assert r.output == "fresh\n" and not r.restarted


async def test_no_output_timeout(client: ToolClient, session_name: str) -> None:
    r = await client.bash("echo start; sleep 60", session=session_name, no_output_timeout=1)
    assert r.timed_out and r.output.strip() == "start"
    # A command that keeps printing is not cut by the no-output limit.
    r = await client.bash(
        "for i in 1 2 3 4 5 6 7 8; do echo $i; sleep 0.5; done", session=session_name, no_output_timeout=2.5
    )
    assert not r.timed_out and r.output.split() == [str(i) for i in range(1, 9)]


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


async def wait_until_empty(probe: Callable[[], list[int]], limit_s: float = 10.0) -> list[int]:
    """Killed processes take a moment to disappear from /proc; return what is still there at the limit."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while (left := probe()) and loop.time() < end:  # noqa: ASYNC110 - /proc has no event
        await asyncio.sleep(0.05)
    return left


def sleepers(tag: str) -> list[int]:
    """Pids of live ``sleep <tag>`` processes."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if argv[:2] == [b"sleep", tag.encode()]:
                found.append(int(name))
    return found


async def test_exit_with_background_job_kills_it(client: ToolClient, session_name: str) -> None:
    tag = str(4000 + int(session_name[-4:], 16) % 1000) + ".5"
    r = await client.bash(f"sleep {tag} & exit 5", session=session_name, timeout=30)
    assert r.restarted and r.exit_code == 5
    assert await wait_until_empty(lambda: sleepers(tag)) == []


async def test_close_kills_the_sessions_processes(client: ToolClient, session_name: str) -> None:
    tag = str(5000 + int(session_name[-4:], 16) % 1000) + ".5"
    await client.bash(f"sleep {tag} &", session=session_name)
    running = asyncio.create_task(client.bash(f"sleep {tag}", session=session_name))
    await client.ping()
    assert sleepers(tag)
    assert await client.bash_close(session_name)
    with pytest.raises(RaasError) as exc:
        await running
    assert exc.value.kind == "tool_error" and "closed" in exc.value.message
    assert await wait_until_empty(lambda: sleepers(tag)) == []
    assert session_name not in {s.session for s in await client.bash_list()}


async def test_session_limit(bundle_dir: Path) -> None:
    srv = await start_server(bundle_dir, extra_args=("--max-sessions", "2"))
    try:
        async with ToolClient(srv.socket) as c:
            await c.bash("true", session="one")
            await c.bash("true", session="two")
            with pytest.raises(RaasError) as exc:
                await c.bash("true", session="three")
            assert exc.value.kind == "tool_error" and "limit 2" in exc.value.message
            await c.bash_close("one")
            assert (await c.bash("echo ok", session="three")).output == "ok\n"
            info = {s.session: s for s in await c.bash_list()}
            assert set(info) == {"two", "three"} and info["two"].alive and not info["two"].busy
    finally:
        assert await srv.stop() == 0
        srv.cleanup()


async def test_shell_killed_mid_command_is_restarted(client: ToolClient, session_name: str) -> None:
    await client.bash("STATE=old", session=session_name)
    r = await client.bash("echo dying; kill -9 $$", session=session_name, timeout=30)
    assert r.restarted and r.exit_code is None and not r.timed_out
    assert r.output.startswith("dying")
    r = await client.bash("echo ${STATE:-new}", session=session_name)
    assert r.output == "new\n" and not r.restarted


async def test_interactive_program_waiting_for_input(client: ToolClient, session_name: str) -> None:
    # A REPL survives Ctrl-C (KeyboardInterrupt) and needs its process group killed.
    r = await client.bash("python3 -i -q", session=session_name, timeout=1)
    assert r.timed_out and not r.restarted
    r = await client.bash("echo back", session=session_name)
    assert r.output == "back\n"
