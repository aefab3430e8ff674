"""The policy's patch, taken as an attacker-minded policy would leave the repository: commits of its own,
git config that changes diff output, binary and Latin-1 files, odd names, deletions, mode changes, the
hidden test file planted. The patch must apply in a fresh sandbox and reproduce every byte, without the
hidden test file; a broken repository or an oversized patch is reported, never raised."""

from __future__ import annotations

import asyncio
import os

import pytest
from tests.conftest import unavailable

from raas.errors import RaasError
from raas.sandbox import SandboxManager
from raas.tasks.swe import specs
from raas.tasks.swe.build import BuildOptions, build
from raas.tasks.swe.packages import FAST_PACKAGES
from raas.tasks.swe.patch import extract_patch
from raas.tasks.swe.records import SweRecord
from raas.tasks.swe.runner import apply_patch, sandbox_config
from raas.tasks.swe.workspace import prepare_repo

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SMALL_SET = {"packages": list(FAST_PACKAGES), "per_package": 4, "seed": 0, "jobs": 2}
BINARY = bytes(range(256)) * 4
LATIN1 = "café crème\n".encode("latin-1")


@pytest.fixture(scope="module")
def record(backend_available: dict[str, str | None]) -> SweRecord:
    if backend_available.get("bwrap"):
        unavailable(str(backend_available["bwrap"]))
    try:
        records, _ = asyncio.run(build(BuildOptions(**SMALL_SET)))  # type: ignore[arg-type]
    except RaasError as e:
        if os.geteuid() != 0 and e.kind == "sandbox_start_failed":
            unavailable(f"the SWE small set is not built and this user cannot build it: {e.message}")
        raise
    return records[8]


async def _mess(sb: object, hidden: str, latin1: bool) -> None:
    script = f"""
set -e
cd /testbed
git config user.email p@x && git config user.name policy
git config color.ui always && git config diff.noprefix true && git config diff.external /bin/false
printf '\\n# edited\\n' >> $(git ls-files '*.py' | grep -v test | head -1)
git commit -qam "the policy's own commit"
mkdir -p 'new dir' && printf 'spaced\\n' > 'new dir/a b.txt'
git rm -q $(git ls-files | grep -v '\\.py$' | head -1)
chmod +x $(git ls-files '*.py' | tail -1)
mkdir -p pkgcache/__pycache__ && printf 'x' > pkgcache/__pycache__/m.cpython-311.pyc
mkdir -p $(dirname {hidden}) && printf 'def test_planted():\\n    pass\\n' > {hidden}
"""
    await sb.tools.write_file("/tmp/mess.sh", script)  # type: ignore[attr-defined]
    res = await sb.tools.bash("bash /tmp/mess.sh", timeout=60)  # type: ignore[attr-defined]
    assert res.exit_code == 0, res.output
    await sb.tools.write_file("/testbed/blob.bin", BINARY)  # type: ignore[attr-defined]
    if latin1:
        await sb.tools.write_file("/testbed/latin1.txt", LATIN1)  # type: ignore[attr-defined]


async def _snapshot(sb: object, paths: list[str]) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for p in paths:
        try:
            out[p] = await sb.tools.read_file(f"/testbed/{p}")  # type: ignore[attr-defined]
        except RaasError:
            out[p] = None
    return out


@pytest.mark.parametrize("latin1", [False, True])
async def test_the_patch_reproduces_every_byte_in_a_fresh_sandbox(
    record: SweRecord, sandbox_manager: SandboxManager, latin1: bool
) -> None:
    hidden = specs.test_patch_files(record.test_patch)
    config = sandbox_config(record.image)
    async with sandbox_manager.sandbox(config, owner="run") as run:
        state = await prepare_repo(run, "/testbed", record.base_commit, hidden=[], stage="init")
        assert state.base == record.base_commit and not state.reset
        await _mess(run, hidden[0], latin1)
        patch = await extract_patch(
            run, workdir="/testbed", base=state.base, exclude=hidden, cap_bytes=1 << 22
        )
        assert patch.problem is None and not patch.too_large
        assert patch.binary_fallback is latin1
        assert hidden[0] not in patch.files and not any("__pycache__" in f for f in patch.files)
        assert "blob.bin" in patch.files and "new dir/a b.txt" in patch.files
        assert (
            "\x1b[" not in patch.text and "diff --git a/" in patch.text
        )  # the policy's git config did not apply
        mode = (
            await run.tools.bash("cd /testbed && stat -c %a $(git ls-files '*.py' | tail -1)")
        ).output.split()[0]
        before = await _snapshot(run, patch.files)
    async with sandbox_manager.sandbox(config, owner="eval") as fresh:
        method, out = await apply_patch(fresh, patch.text, "model")
        assert method == "git apply", out
        assert await _snapshot(fresh, patch.files) == before
        assert (await fresh.tools.read_file("/testbed/blob.bin")) == BINARY
        mode_after = (
            await fresh.tools.bash("cd /testbed && stat -c %a $(git ls-files '*.py' | tail -1)")
        ).output
        assert mode_after.split()[0] == mode == "755"
        assert (await fresh.tools.bash(f"test -e /testbed/{hidden[0]}")).exit_code != 0


async def test_a_broken_repository_and_an_oversized_patch_are_reported(
    record: SweRecord, sandbox_manager: SandboxManager
) -> None:
    async with sandbox_manager.sandbox(sandbox_config(record.image), owner="run") as run:
        await run.tools.write_file("/testbed/big.bin", os.urandom(64 * 1024))
        big = await extract_patch(
            run, workdir="/testbed", base=record.base_commit, exclude=[], cap_bytes=4096
        )
        assert big.too_large and big.text == "" and big.size > 4096 and big.files == ["big.bin"]
        await run.tools.bash("rm -rf /testbed/.git", timeout=60)
        broken = await extract_patch(
            run, workdir="/testbed", base=record.base_commit, exclude=[], cap_bytes=4096
        )
        assert broken.text == "" and broken.problem is not None and "RAAS_GIT_FAILED" in broken.problem
