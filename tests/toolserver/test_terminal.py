"""The bash tool as a terminal, over the real server: the scenarios, server defaults, and the session limit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox.client import ToolClient

from .conftest import start_server
from .terminal_scenarios import SCENARIOS, Scenario

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("scenario", list(SCENARIOS.values()), ids=list(SCENARIOS))
async def test_terminal_scenario(client: ToolClient, session_name: str, scenario: Scenario) -> None:
    await scenario(client, session_name)
    assert await client.bash_close(session_name)


async def test_default_timeout_and_input_wait(bundle_dir: Path) -> None:
    """Under the server's defaults nothing hangs: a silent command is interrupted, a reader returns."""
    srv = await start_server(bundle_dir, extra_args=("--bash-timeout", "2", "--bash-input-wait", "1"))
    try:
        async with ToolClient(srv.socket) as c:
            await c.bash("MARK=kept")
            r = await c.bash("echo start; sleep 30")
            assert r.timed_out and r.interrupted and not r.restarted and r.output.strip() == "start"
            assert (await c.bash("echo $MARK")).output == "kept\n"
            for reader in ("cat", "read x", "python3 -q"):
                r = await c.bash(reader)
                assert r.waiting_for_input and not r.timed_out and r.exit_code is None, reader
                r = await c.bash_send(interrupt=True)
                assert r.interrupted and not r.waiting_for_input and not r.restarted, reader
            # Only a no-output limit: no overall limit while output keeps coming.
            r = await c.bash("for i in 1 2 3 4 5 6; do echo $i; sleep 0.5; done", no_output_timeout=2)
            assert not r.timed_out and r.output.split() == ["1", "2", "3", "4", "5", "6"]
            # A silent command that does not read input is not left running by the input wait.
            r = await c.bash("sleep 1.5; echo slept", timeout=10)
            assert (r.output, r.waiting_for_input) == ("slept\n", False)
    finally:
        assert await srv.stop() == 0
        srv.cleanup()


async def test_session_limit_holds_under_concurrent_first_calls(bundle_dir: Path) -> None:
    srv = await start_server(bundle_dir, extra_args=("--max-sessions", "4"))
    try:
        async with ToolClient(srv.socket) as c:
            results = await asyncio.gather(
                *(c.bash("echo up", session=f"race-{i}", timeout=60) for i in range(40)),
                return_exceptions=True,
            )
            started = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, RaasError)]
            assert len(started) == 4 and len(refused) == 36, results
            assert all(e.kind == "tool_error" and "limit 4" in e.message for e in refused)
            assert len(await c.bash_list()) == 4
            # Concurrent first calls to one name share one shell.
            for info in (await c.bash_list())[:2]:
                assert await c.bash_close(info.session)
            same = await asyncio.gather(*(c.bash("echo $$", session="shared", timeout=60) for _ in range(10)))
            assert len({r.output for r in same}) == 1
    finally:
        assert await srv.stop() == 0
        srv.cleanup()
