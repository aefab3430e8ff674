"""The bash tool as a terminal inside real sandboxes: every terminal scenario on every backend that runs here."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from raas.sandbox import SandboxConfig, SandboxManager
from raas.sandbox.client import ToolClient
from tests.conftest import SANDBOX_BACKENDS
from tests.toolserver.terminal_scenarios import SCENARIOS, Scenario, temp_dirs_can_be_cleaned

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("scenario", list(SCENARIOS.values()), ids=list(SCENARIOS))
@pytest.mark.parametrize("backend", SANDBOX_BACKENDS)
async def test_terminal_scenario_in_sandbox(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str, scenario: Scenario
) -> None:
    async with sandbox_manager.sandbox(sandbox_config, owner="t") as sb:
        if scenario is temp_dirs_can_be_cleaned:
            await assert_temp_dir_is_private(sb.tools, backend)
        await scenario(sb.tools, f"s-{uuid.uuid4().hex[:8]}")


async def assert_temp_dir_is_private(tools: ToolClient, backend: str) -> None:
    """The scenario empties the sandbox's temp dir: make sure that is not the host's /tmp."""
    marker = Path(f"/tmp/raas-host-marker-{uuid.uuid4().hex}")
    await asyncio.to_thread(marker.write_text, "host")
    try:
        r = await tools.bash(f'echo "${{TMPDIR:-/tmp}}"; test -e {marker} && echo SHARED', timeout=20)
        tmp = r.output.splitlines()[0]
        assert not ("SHARED" in r.output and tmp == "/tmp"), (
            f"{backend}: the sandbox's temp dir is the host's"
        )
    finally:
        await asyncio.to_thread(marker.unlink)
