"""The agent's bash tool drives an interactive program: the policy sees that it waits, then types into it."""

from __future__ import annotations

import pytest

from raas.agent.tools import ToolSet
from raas.sandbox import Sandbox

pytestmark = pytest.mark.integration


async def test_bash_tool_types_into_a_waiting_program(sandbox: Sandbox) -> None:
    tools = ToolSet(["bash"])
    obs = await tools.dispatch(
        sandbox,
        "bash",
        {"command": "read -p 'Proceed? [y/n] ' a; echo \"answer=$a\""},
        timeout_s=60,
        cap_bytes=4000,
    )
    assert not obs.is_error
    assert obs.text.startswith("Proceed? [y/n] ") and "waits for input" in obs.text and "is_input" in obs.text
    obs = await tools.dispatch(
        sandbox, "bash", {"command": "y\n", "is_input": True}, timeout_s=60, cap_bytes=4000
    )
    assert obs.text == "answer=y\n[exit code 0]"
    # Typing when nothing runs is the policy's mistake: an error observation, not a failed job.
    obs = await tools.dispatch(
        sandbox, "bash", {"command": "y\n", "is_input": True}, timeout_s=60, cap_bytes=4000
    )
    assert obs.is_error and obs.kind == "tool_error" and "no command is running" in obs.text
