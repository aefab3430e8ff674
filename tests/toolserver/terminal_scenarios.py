"""What an agent does to a terminal, as scenarios that run against any tool server (direct or in a sandbox).

Each scenario takes a connected :class:`ToolClient` and a session name of its own and asserts the terminal
behaves like a real one: exact ``$?``, no prompt text, no internals in traces or errors, completion that
the user's shell state cannot break or spoof, sane modes after interrupts, temp dirs that may be cleaned,
escape sequences that cannot swallow output, and interactive programs that can be driven with
``bash.send``. Every call carries its own ``timeout`` so a regression fails instead of hanging.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest

from raas.errors import RaasError
from raas.sandbox.client import ToolClient
from raas.sandbox.models import BashResult

T = 20  # per-call limit: generous, only there so a broken session fails fast
INTERNALS = ("__raas", "/proc/", "RAAS1", "raas-cmd", "cmd-", "\x1e")


def no_internals(r: BashResult) -> None:
    for needle in INTERNALS:
        assert needle not in r.output, f"{needle!r} leaked into {r.output!r}"


async def ok(tools: ToolClient, command: str, session: str, **kw: float) -> BashResult:
    """Run a command that must complete normally, without touching the session's health."""
    r = await tools.bash(command, session=session, timeout=kw.pop("timeout", T), **kw)
    assert not r.timed_out and not r.restarted and not r.waiting_for_input, (command, r)
    no_internals(r)
    return r


async def prompt_text_never_leaks(tools: ToolClient, s: str) -> None:
    await ok(tools, "PS1='x> '; PS2='cont> '; PS0='zero> '", s)
    assert (await ok(tools, "echo hi", s)).output == "hi\n"
    assert (await ok(tools, "for i in 1 2\ndo echo $i\ndone", s)).output == "1\n2\n"
    # What the user set is still what the user sees.
    assert (await ok(tools, 'echo "$PS1|$PS2"', s)).output == "x> |cont> \n"
    await ok(tools, ". /etc/skel/.bashrc", s)
    assert (await ok(tools, "echo after-skel", s)).output == "after-skel\n"
    r = await ok(
        tools, "python3 -m venv --without-pip .venv-t && . .venv-t/bin/activate && echo $VIRTUAL_ENV", s
    )
    assert r.output.strip().endswith(".venv-t") and r.exit_code == 0
    assert (await ok(tools, "echo in-venv", s)).output == "in-venv\n"
    assert (await ok(tools, 'echo "$PS1"', s)).output.startswith("(.venv-t) ")
    # A command that Ctrl-C aborts makes bash print its prompt: that is not output either.
    r = await tools.bash("echo before; sleep 30", session=s, timeout=1)
    assert r.timed_out and not r.restarted
    assert r.output.strip() == "before", r.output
    assert (await ok(tools, "echo after", s)).output == "after\n"
    await ok(tools, "deactivate; rm -rf .venv-t", s)


async def exit_status_is_exact(tools: ToolClient, s: str) -> None:
    assert (await ok(tools, "false", s)).exit_code == 1
    assert (await ok(tools, "echo $?", s)).output == "1\n"
    assert (await ok(tools, "(exit 42)", s)).exit_code == 42
    assert (await ok(tools, "echo $?", s)).output == "42\n"
    # `set -u` errors abort the command, not the session's bookkeeping.
    await ok(tools, "set -u", s)
    r = await ok(tools, "echo $not_set_anywhere", s)
    assert "unbound variable" in r.output and r.exit_code != 0
    assert (await ok(tools, "echo $?; set +u", s)).output == f"{r.exit_code}\n"
    r = await tools.bash("sleep 30", session=s, timeout=1)
    assert r.timed_out and r.exit_code == 130
    assert (await ok(tools, "echo $?", s)).output == "130\n"
    assert (await ok(tools, "true", s)).exit_code == 0


async def temp_dirs_can_be_cleaned(tools: ToolClient, s: str) -> None:
    await ok(tools, "KEPT=yes", s)
    await ok(tools, 'rm -rf "${TMPDIR:-/tmp}"/* "${TMPDIR:-/tmp}"/.[!.]* 2>/dev/null; true', s)
    assert (await ok(tools, "echo $KEPT", s)).output == "yes\n"
    long = "echo " + "z" * 5000 + " | wc -c"  # too long for the pty line: goes through the command file
    assert (await ok(tools, long, s)).output.strip() == "5001"
    assert (await ok(tools, "echo runner vi", s)).output == "runner vi\n"  # through the runner file
    r = await tools.bash("sleep 30", session=s, timeout=1)  # the probe re-reads the function file
    assert r.timed_out and not r.restarted
    assert (await ok(tools, "echo $KEPT", s)).output == "yes\n"
    r = await tools.bash("exit 4", session=s, timeout=T)  # a fresh shell needs its files too
    assert r.restarted and r.exit_code == 4
    assert (await ok(tools, "echo fresh", s)).output == "fresh\n"


async def escape_sequences_cannot_swallow_output(tools: ToolClient, s: str) -> None:
    r = await ok(tools, r"printf 'y\033_apc\n'; echo END; seq 1 3", s)
    assert r.output == "yapc\nEND\n1\n2\n3\n"
    r = await ok(
        tools, r"printf 'a\033Pdcs\n'; printf 'b\033]0;title-no-end\n'; printf 'c\033^pm\n'; echo END", s
    )
    assert r.output == "adcs\nb0;title-no-end\ncpm\nEND\n"
    r = await ok(tools, r"printf '\033]0;title\007\033[1;32mgreen\033[0m\n'", s)
    assert r.output == "green\n"
    r = await ok(tools, "head -c 20000 /dev/urandom; echo; echo MARK-END", s)
    assert r.output.endswith("\nMARK-END\n") and "\x1b" not in r.output


async def interrupt_leaves_a_sane_terminal(tools: ToolClient, s: str) -> None:
    r = await tools.bash("stty raw -isig -echo; sleep 30", session=s, timeout=1)
    assert r.timed_out and r.interrupted and not r.restarted
    r = await ok(tools, "echo ok", s)
    assert r.output == "ok\n", r.output
    modes = (await ok(tools, "stty -a", s)).output.split()
    assert "isig" in modes and "icanon" in modes and "-isig" not in modes
    # Typed-ahead input nobody read is gone too.
    r = await tools.bash("cat", session=s, no_output_timeout=1, timeout=T)
    assert r.waiting_for_input
    await tools.bash_send("never read", session=s, interrupt=False, no_output_timeout=0.5, timeout=T)
    r = await tools.bash_send(session=s, interrupt=True, timeout=T)
    assert r.interrupted and not r.restarted
    assert (await ok(tools, "echo clean", s)).output == "clean\n"


async def tracing_shows_only_user_commands(tools: ToolClient, s: str) -> None:
    await ok(tools, "set -x", s)
    r = await ok(tools, "echo traced", s)
    assert [line.lstrip("+ ") for line in r.output.splitlines()] == ["echo traced", "traced"], r.output
    assert (await ok(tools, "false", s)).exit_code == 1
    r = await ok(tools, "echo $?", s)
    assert r.output.splitlines()[-1] == "1"
    r = await tools.bash("sleep 30", session=s, timeout=1)
    assert r.timed_out
    no_internals(r)
    await ok(tools, "set +x", s)
    await ok(tools, "trap 'echo RETURN-TRAP' RETURN", s)
    assert (await ok(tools, "echo x", s)).output == "x\n"
    await ok(tools, "trap - RETURN", s)
    r = await ok(tools, "if then fi", s)
    assert "syntax error" in r.output and r.exit_code != 0
    r = await ok(tools, "no_such_command_here", s)
    assert r.output == "bash: no_such_command_here: command not found\n" and r.exit_code == 127


async def completion_cannot_be_broken_or_spoofed(tools: ToolClient, s: str) -> None:
    await ok(tools, "set -o vi", s)
    assert (await ok(tools, "echo a", s)).output == "a\n"
    assert "on" in (await ok(tools, "set -o | grep '^vi'", s)).output
    await ok(tools, "set +o vi", s)
    for setup in ("unset PROMPT_COMMAND", "PROMPT_COMMAND=", "PROMPT_COMMAND='echo from-pc'"):
        await ok(tools, setup, s)
        assert (await ok(tools, "false", s)).exit_code == 1
        assert (await ok(tools, "echo b", s)).output.endswith("b\n")
    await ok(tools, '_hook() { :; }; PROMPT_COMMAND="_hook;$PROMPT_COMMAND"', s)
    assert (await ok(tools, "false", s)).exit_code == 1
    r = await ok(tools, 'eval "$PROMPT_COMMAND"; sleep 0.3; echo after-eval', s)
    assert r.output.endswith("after-eval\n")
    await ok(tools, "unset PROMPT_COMMAND", s)
    await ok(tools, "exec 3>&1 >/dev/null", s)
    assert (await ok(tools, "echo hidden", s)).output == ""
    assert (await ok(tools, "echo shown >&3", s)).output == "shown\n"
    await ok(tools, "exec >&3 3>&-", s)
    # Look-alike markers in the output (old and new style) cannot end a call early.
    r = await tools.bash(
        "printf '\\036%s 1 0 /\\036' 0123456789abcdef; printf 'RAAS1 0123456789abcdef 99 0 \\0/\\0\\0\\0'; "
        "sleep 0.5; echo real-end",
        session=s,
        timeout=T,
    )
    assert r.output.endswith("real-end\n") and r.exit_code == 0 and not r.timed_out


async def interactive_programs_wait_for_input(tools: ToolClient, s: str) -> None:
    r = await tools.bash("cat", session=s, no_output_timeout=1, timeout=T)
    assert r.waiting_for_input and not r.timed_out and r.exit_code is None and r.output == ""
    with pytest.raises(RaasError) as exc:
        await tools.bash("echo refused", session=s, timeout=T)
    assert exc.value.kind == "tool_error" and "bash.send" in exc.value.message
    r = await tools.bash_send("hello\n", session=s, no_output_timeout=1, timeout=T)
    assert r.waiting_for_input and r.output == "hello\n"
    r = await tools.bash_send("C-d", session=s, no_output_timeout=5, timeout=T)
    assert not r.waiting_for_input and r.exit_code == 0
    r = await tools.bash(
        "read -p 'Continue? [y/n] ' a; echo \"ans=$a\"", session=s, no_output_timeout=1, timeout=T
    )
    assert r.waiting_for_input and r.output == "Continue? [y/n] "
    r = await tools.bash_send("y\n", session=s, no_output_timeout=5, timeout=T)
    assert (r.output, r.exit_code, r.waiting_for_input) == ("ans=y\n", 0, False)
    r = await tools.bash("python3 -q", session=s, no_output_timeout=1, timeout=T)
    assert r.waiting_for_input and r.output.endswith(">>> ")
    r = await tools.bash_send("print(6 * 7)\n", session=s, no_output_timeout=1, timeout=T)
    assert r.waiting_for_input and "42" in r.output
    r = await tools.bash_send("C-c", session=s, no_output_timeout=1, timeout=T)
    assert r.waiting_for_input and "KeyboardInterrupt" in r.output
    r = await tools.bash_send("exit()\n", session=s, no_output_timeout=5, timeout=T)
    assert r.exit_code == 0 and not r.waiting_for_input
    # Ctrl-C as a key: a shell builtin reading input is interrupted and the rest of the line discarded.
    r = await tools.bash("read x; echo never", session=s, no_output_timeout=1, timeout=T)
    assert r.waiting_for_input
    r = await tools.bash_send("C-c", session=s, no_output_timeout=1, timeout=T)
    assert (r.exit_code, r.interrupted, r.waiting_for_input) == (130, True, False) and "never" not in r.output
    r = await tools.bash("sleep 1000 & read x", session=s, no_output_timeout=1, timeout=T)
    assert r.waiting_for_input
    r = await tools.bash_send(session=s, interrupt=True, timeout=T)
    assert r.interrupted and not r.restarted and r.exit_code == 130
    assert (await ok(tools, "echo $?; kill %1", s)).output.startswith("130\n")
    with pytest.raises(RaasError) as exc:
        await tools.bash_send("x\n", session=s, timeout=T)
    assert exc.value.kind == "tool_error" and "no command is running" in exc.value.message


Scenario = Callable[[ToolClient, str], Awaitable[None]]
SCENARIOS: dict[str, Scenario] = {
    f.__name__: f
    for f in (
        prompt_text_never_leaks,
        exit_status_is_exact,
        temp_dirs_can_be_cleaned,
        escape_sequences_cannot_swallow_output,
        interrupt_leaves_a_sane_terminal,
        tracing_shows_only_user_commands,
        completion_cannot_be_broken_or_spoofed,
        interactive_programs_wait_for_input,
    )
}
