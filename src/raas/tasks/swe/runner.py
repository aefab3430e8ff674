"""Running tests in raas sandboxes: the builder's suite runs and the SWE-bench evaluation loop.

Test output goes to a file inside the sandbox and is read back whole (the bash tool caps what it returns,
and ``-rA`` summaries of large suites are long). Every run has a wall-clock limit enforced by the tool
server: a mutation that loops forever is a timed-out run, not a hung build.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raas.core.executors import Executor
from raas.errors import RaasError
from raas.sandbox.base import Sandbox, backend_class
from raas.sandbox.config import SandboxConfig, make_config

from . import grading
from .records import SweRecord

if TYPE_CHECKING:
    from raas.sandbox import SandboxManager

TEST_LOG = "/tmp/raas-swe-test-output.txt"
APPLY_TIMEOUT_S = 60.0


@dataclass
class CommandRun:
    """One run of a test command."""

    exit_code: int | None
    output: str
    timed_out: bool
    seconds: float


def sandbox_config(
    image: str | Path,
    *,
    backend: str = "bwrap",
    timeout_s: float = 300.0,
    memory_mb: int | None = 4096,
    workdir: str = "/testbed",
) -> SandboxConfig:
    """A networkless sandbox from ``image`` whose ``workdir`` (the repository) is a writable copy."""
    fields: dict[str, Any] = {
        "backend": backend,
        "image": str(image),
        "network": False,
        "workdir": workdir,
        "command_timeout_s": timeout_s,
        "memory_mb": memory_mb,
        "max_procs": 512,
        "start_timeout_s": 120,
    }
    if backend_class(backend).supports_seed:  # raas sizes the writable area itself (bwrap, apptainer)
        fields["disk_mb"] = 1024
    return make_config(**fields)


async def run_command(
    sb: Sandbox, command: str, *, timeout_s: float, workdir: str = "/testbed"
) -> CommandRun:
    """Run ``command`` in ``workdir``; its combined output is read back from a file, uncapped."""
    t0 = time.monotonic()
    res = await sb.tools.bash(
        f"cd {shlex.quote(workdir)} && ( {command} ) > {TEST_LOG} 2>&1", timeout=timeout_s
    )
    try:
        raw = await sb.tools.read_file(TEST_LOG)
    except RaasError:
        raw = b""
    return CommandRun(
        exit_code=None if res.timed_out else res.exit_code,
        output=raw.decode("utf-8", errors="replace"),
        timed_out=res.timed_out,
        seconds=time.monotonic() - t0,
    )


async def apply_patch(
    sb: Sandbox, patch: str, name: str, *, workdir: str = "/testbed", fuzzy: bool = False
) -> tuple[str | None, str]:
    """Apply a patch in ``workdir``: ``git apply``, then (``fuzzy``) SWE-bench's fallback
    ``patch --batch --fuzz=5 -p1``. Returns (the method that applied it or None, the tools' output)."""
    path = f"/tmp/raas-{name}.patch"
    await sb.tools.write_file(path, patch.encode("utf-8"))
    wd = shlex.quote(workdir)
    res = await sb.tools.bash(f"cd {wd} && git apply --verbose {path}", timeout=APPLY_TIMEOUT_S)
    if res.exit_code == 0:
        return "git apply", res.output
    if not fuzzy:
        return None, res.output
    # A failed `patch` may have applied some hunks: restore the tracked files it touched first.
    fb = await sb.tools.bash(
        f"cd {wd} && patch --batch --fuzz=5 -p1 --no-backup-if-mismatch -r - -i {path}",
        timeout=APPLY_TIMEOUT_S,
    )
    if fb.exit_code == 0:
        return "patch --fuzz", res.output + fb.output
    await sb.tools.bash(f"cd {wd} && git checkout -- . 2>/dev/null; true", timeout=APPLY_TIMEOUT_S)
    return None, res.output + fb.output


@dataclass
class EvalResult:
    """The evaluation of one patch against one record."""

    patch_applied: bool  # False: the model's patch did not apply (nothing was run)
    apply_output: str
    apply_method: str | None = None  # "git apply" or "patch --fuzz" (None: empty patch or not applied)
    test_patch_applied: bool = False  # True as well when the record has no test patch (nothing to apply)
    run: CommandRun | None = None
    grade: grading.Grade | None = None

    @property
    def resolved(self) -> bool:
        return self.grade is not None and self.grade.resolved


async def evaluate(
    sb: Sandbox,
    record: Mapping[str, Any],
    model_patch: str,
    *,
    timeout_s: float = 300.0,
    fuzzy: bool = True,
    grader: Executor | None = None,
) -> EvalResult:
    """SWE-bench's evaluation in ``sb`` (started from the record's image, the repository at its
    ``workdir`` and ``base_commit``): apply the model patch (``git apply``, then ``patch --fuzz`` unless
    ``fuzzy`` is off; an empty patch is skipped), apply ``test_patch`` (none when empty), run ``test_cmd``, grade with
    SWE-bench's parser and grading functions (on ``grader``, the service's pool for it; a one-off caller
    such as the offline builder may leave it to the loop's default pool)."""
    workdir = str(record.get("workdir", "/testbed"))
    out, method = "", None
    if model_patch.strip():
        method, out = await apply_patch(sb, model_patch, "model", workdir=workdir, fuzzy=fuzzy)
        if method is None:
            return EvalResult(patch_applied=False, apply_output=out)
    test_patch = str(record.get("test_patch") or "")
    if test_patch.strip():  # empty: the tests are already in the repository
        applied, test_out = await apply_patch(sb, test_patch, "test", workdir=workdir)
        if applied is None:
            return EvalResult(True, out + test_out, method, test_patch_applied=False)
    run = await run_command(sb, str(record["test_cmd"]), timeout_s=timeout_s, workdir=workdir)
    if run.timed_out:
        return EvalResult(True, out, method, True, run, None)
    if grader is not None:
        grade = await grader.run(grading.grade, record, run.output, run.exit_code)
    else:
        grade = await asyncio.to_thread(grading.grade, record, run.output, run.exit_code)
    return EvalResult(True, out, method, True, run, grade)


class SuiteSandboxes:
    """The builders' test runs: each in a fresh networkless sandbox from an image, at most ``jobs`` at
    once, every sandbox closed when its run ends."""

    def __init__(self, manager: SandboxManager, backend: str, jobs: int, suite_timeout_s: float) -> None:
        self.manager = manager
        self.backend = backend
        self.suite_timeout_s = suite_timeout_s
        self._slots = asyncio.Semaphore(max(1, jobs))

    async def run(
        self,
        image: Path,
        tar: bytes,
        files: dict[str, bytes],
        command: str,
        timeout_s: float,
        fetch: str | None = None,
    ) -> tuple[CommandRun, bytes | None]:
        """Run ``command`` on the tree ``tar`` at /testbed, with ``files`` (absolute paths) written first;
        returns the run and the content of ``fetch`` afterwards (None if absent)."""
        async with self._slots:
            cfg = sandbox_config(image, backend=self.backend, timeout_s=timeout_s)
            async with self.manager.sandbox(cfg, owner="swe-build") as sb:
                await sb.tools.upload_bytes(tar, "/testbed")
                dirs = sorted({str(Path(p).parent) for p in files if not p.startswith("/testbed/")})
                if dirs:
                    await sb.tools.bash("mkdir -p " + " ".join(shlex.quote(d) for d in dirs), timeout=30)
                for path, data in files.items():
                    await sb.tools.write_file(path, data)
                run = await run_command(sb, command, timeout_s=timeout_s)
                extra = None
                if fetch is not None:
                    try:
                        extra = await sb.tools.read_file(fetch)
                    except RaasError:
                        extra = None
                return run, extra

    async def verify(self, record: SweRecord) -> bool:
        """At base_commit the FAIL_TO_PASS tests fail and the PASS_TO_PASS ones pass; with the gold patch
        the instance is resolved; the repository is one clean commit."""
        data: dict[str, Any] = record.model_dump()
        cfg = sandbox_config(record.image, backend=self.backend, timeout_s=self.suite_timeout_s)
        async with self._slots:
            async with self.manager.sandbox(cfg, owner="swe-verify") as sb:
                state = await sb.tools.bash(
                    "cd /testbed && git status --porcelain && git rev-parse HEAD && git rev-list --all --count",
                    timeout=60,
                )
                if state.exit_code != 0 or state.output.split() != [record.base_commit, "1"]:
                    return False
                before = await evaluate(sb, data, "", timeout_s=self.suite_timeout_s)
            g = before.grade
            if g is None or not g.log_valid or g.resolved:
                return False
            if g.tests_status["FAIL_TO_PASS"]["success"] or g.tests_status["PASS_TO_PASS"]["failure"]:
                return False
            async with self.manager.sandbox(cfg, owner="swe-verify") as sb:
                gold = await evaluate(sb, data, record.patch, timeout_s=self.suite_timeout_s)
        return gold.resolved
