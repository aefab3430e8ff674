"""Built SWE-style instances, end to end in real bwrap sandboxes.

The small set (three fast packages, four instances each) is built once as root (debootstrap, test runs
in sandboxes; ~5 minutes on 2 cores) and cached by key in RAAS_IMAGE_CACHE; later runs, and runs as an
unprivileged user, reuse it. Every instance is then graded through the full loop with SWE-bench's grading
code: the gold patch resolves it, an empty or a wrong patch does not, a patch that does not apply is
reported as such. The no-leak checks look for the original code and the hidden tests inside the image.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from tests.conftest import unavailable
from typer.testing import CliRunner

from raas.errors import RaasError
from raas.sandbox import SandboxManager
from raas.tasks.swe.build import BuildOptions, build
from raas.tasks.swe.cli import app
from raas.tasks.swe.packages import FAST_PACKAGES
from raas.tasks.swe.records import SweRecord, read_jsonl, validate_record
from raas.tasks.swe.runner import EvalResult, evaluate, sandbox_config

# The first test pays for building the small set on a fresh machine (~3-5 minutes on 2 cores).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

SMALL_SET = {"packages": list(FAST_PACKAGES), "per_package": 4, "seed": 0, "jobs": 2}
T = TypeVar("T")


@pytest.fixture(scope="session")
async def swe_set(backend_available: dict[str, str | None]) -> list[SweRecord]:
    if backend_available.get("bwrap"):
        unavailable(str(backend_available["bwrap"]))
    try:
        records, _ = await build(BuildOptions(**SMALL_SET))  # type: ignore[arg-type]
    except RaasError as e:
        if os.geteuid() != 0 and e.kind == "sandbox_start_failed":
            unavailable(f"the SWE small set is not built and this user cannot build it: {e.message}")
        raise
    return records


async def _bounded(items: list[Any], fn: Callable[[Any], Awaitable[T]], n: int = 2) -> list[T]:
    gate = asyncio.Semaphore(n)

    async def one(item: Any) -> T:
        async with gate:
            return await fn(item)

    return await asyncio.gather(*(one(i) for i in items))


async def _eval(manager: SandboxManager, record: SweRecord, patch: str) -> EvalResult:
    async with manager.sandbox(sandbox_config(record.image), owner="test") as sb:
        return await evaluate(sb, record.model_dump(), patch, timeout_s=300)


def _mutated_file(record: SweRecord) -> str:
    m = re.search(r"^diff --git a/(\S+) b/", record.patch, re.M)
    assert m, record.patch
    return m.group(1)


def _changed_old_line(record: SweRecord) -> int:
    """The first line of the buggy file the gold patch changes (or next to which it adds)."""
    m = re.search(r"^@@ -(\d+)", record.patch, re.M)
    assert m
    start = int(m.group(1))
    body = record.patch[m.end() :].split("\n")[1:]
    for i, line in enumerate(ln for ln in body if ln[:1] in " +-"):
        if line[:1] in "+-":
            return start + i
    raise AssertionError(record.patch)


def _functions_around(source: str, line: int) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (
            node.end_lineno or node.lineno
        ):
            names.append(node.name)
    return names


def _original_snippet(record: SweRecord) -> bytes:
    """The original code around the fix: the new side of the gold patch's first hunk (context + added)."""
    hunk = record.patch.split("\n@@", 1)[1].split("\n@@", 1)[0].split("\n")[1:]
    lines = [ln[1:] for ln in hunk if ln[:1] in " +"]
    return "\n".join(lines).encode()


async def test_the_small_set_has_ten_instances_from_three_packages(swe_set: list[SweRecord]) -> None:
    assert len(swe_set) >= 10
    assert len({r.repo for r in swe_set}) >= 3
    assert len({r.instance_id for r in swe_set}) == len(swe_set)
    for r in swe_set:
        validate_record(r.model_dump())
        assert 1 <= len(r.FAIL_TO_PASS) <= 20 and not set(r.FAIL_TO_PASS) & set(r.PASS_TO_PASS)
        assert r.data_source == "swebench" and r.workdir == "/testbed" and r.log_parser == "parse_log_pytest"
        hidden = {t.split("::")[0] for t in r.FAIL_TO_PASS}
        assert all(h in r.test_cmd for h in hidden) and all(f"b/{h}" in r.test_patch for h in hidden)
        assert all(t.split("::")[0] in hidden for t in r.PASS_TO_PASS)
        image = Path(r.image)
        assert image.name.startswith("swe-inst-") and (image / "testbed/.git").is_dir()
        for h in hidden:  # the hidden tests are not in the repository
            assert not (image / "testbed" / h).exists()


async def test_images_are_readable_by_other_users(swe_set: list[SweRecord]) -> None:
    for r in swe_set[:3]:
        for dirpath, _dirs, filenames in os.walk(Path(r.image) / "testbed"):
            assert os.stat(dirpath).st_mode & stat.S_IROTH and os.stat(dirpath).st_mode & stat.S_IXOTH
            for f in filenames:
                assert os.lstat(os.path.join(dirpath, f)).st_mode & stat.S_IROTH, f


async def test_problem_statements_never_name_the_file_or_function(swe_set: list[SweRecord]) -> None:
    for r in swe_set:
        file = _mutated_file(r)
        buggy = (Path(r.image) / "testbed" / file).read_text()
        functions = _functions_around(buggy, _changed_old_line(r))
        assert functions, (r.instance_id, file)
        text = r.problem_statement
        for t in r.FAIL_TO_PASS:
            text = text.replace(t, "")
        assert file not in text, r.instance_id
        if file.endswith("__init__.py"):
            assert file.rsplit("/", 2)[-2] + "/__init__.py" not in text
        else:
            assert file.rsplit("/", 1)[-1] not in text
        for name in functions:
            assert not re.search(rf"\b{re.escape(name)}\b", text), (r.instance_id, name)
        assert r.FAIL_TO_PASS[0] in r.problem_statement


async def test_gold_resolves_and_empty_wrong_and_broken_patches_do_not(
    swe_set: list[SweRecord], sandbox_manager: SandboxManager
) -> None:
    async def check(r: SweRecord) -> dict[str, Any]:
        file = _mutated_file(r)
        buggy = (Path(r.image) / "testbed" / file).read_text()
        n = len(buggy.splitlines())
        # Applies cleanly, changes the buggy file, fixes nothing.
        wrong = (
            f"diff --git a/{file} b/{file}\n--- a/{file}\n+++ b/{file}\n"
            f"@@ -{n},1 +{n},2 @@\n {buggy.splitlines()[-1]}\n+# looked at this\n"
        )
        # Its context is not in the file.
        broken = (
            f"diff --git a/{file} b/{file}\n--- a/{file}\n+++ b/{file}\n"
            "@@ -1,1 +1,1 @@\n-this line is not there\n+neither is this\n"
        )
        gold = await _eval(sandbox_manager, r, r.patch)
        empty = await _eval(sandbox_manager, r, "")
        wrong_res = await _eval(sandbox_manager, r, wrong)
        broken_res = await _eval(sandbox_manager, r, broken)
        return {"id": r.instance_id, "gold": gold, "empty": empty, "wrong": wrong_res, "broken": broken_res}

    for out in await _bounded(swe_set, check):
        gold, empty, wrong, broken = out["gold"], out["empty"], out["wrong"], out["broken"]
        assert gold.patch_applied and gold.resolved, (out["id"], gold.run and gold.run.output[-2000:])
        assert gold.grade is not None and gold.grade.status == "RESOLVED_FULL"
        for res in (empty, wrong):
            assert res.patch_applied and res.test_patch_applied and res.grade is not None, out["id"]
            assert res.grade.log_valid and not res.resolved, out["id"]
            assert res.grade.tests_status["FAIL_TO_PASS"]["failure"], out["id"]
        assert not broken.patch_applied and not broken.resolved and broken.run is None
        assert "error" in broken.apply_output.lower() or "patch" in broken.apply_output.lower()


async def test_a_patch_with_stale_context_applies_with_fuzz_as_in_swebench(
    swe_set: list[SweRecord], sandbox_manager: SandboxManager
) -> None:
    r = swe_set[0]
    lines = r.patch.split("\n")
    first_hunk = next(i for i, ln in enumerate(lines) if ln.startswith("@@"))
    ctx = next(i for i in range(first_hunk + 1, len(lines)) if lines[i].startswith(" "))
    lines[ctx] = lines[ctx] + "  # this context line has drifted"
    stale = "\n".join(lines)
    res = await _eval(sandbox_manager, r, stale)
    assert res.patch_applied and res.apply_method == "patch --fuzz" and res.resolved, res.apply_output
    gold = await _eval(sandbox_manager, r, r.patch)
    assert gold.apply_method == "git apply" and gold.resolved
    async with sandbox_manager.sandbox(sandbox_config(r.image), owner="test") as sb:
        res = await evaluate(sb, r.model_dump(), stale, fuzzy=False)
        assert not res.patch_applied and res.run is None


async def test_a_patch_that_plants_the_hidden_tests_is_not_resolved(
    swe_set: list[SweRecord], sandbox_manager: SandboxManager
) -> None:
    r = swe_set[0]
    hidden = r.test_cmd.split()[-1]
    fake = f"diff --git a/{hidden} b/{hidden}\nnew file mode 100644\n--- /dev/null\n+++ b/{hidden}\n@@ -0,0 +1,2 @@\n+def test_nothing():\n+    pass\n"
    res = await _eval(sandbox_manager, r, fake)
    assert res.patch_applied and not res.test_patch_applied and not res.resolved


async def test_the_image_holds_no_way_back_to_the_original(
    swe_set: list[SweRecord], sandbox_manager: SandboxManager
) -> None:
    scan = r"""
import os, sys, json
needles = [bytes.fromhex(h) for h in json.loads(sys.argv[1])]
found = {}
for top in os.listdir("/"):
    if top in ("proc", "sys", "dev", ".raas"):
        continue
    for dirpath, dirnames, filenames in os.walk("/" + top):
        for f in filenames:
            p = os.path.join(dirpath, f)
            if os.path.islink(p) or not os.path.isfile(p):
                continue
            try:
                data = open(p, "rb").read()
            except OSError:
                continue
            for i, n in enumerate(needles):
                if n in data:
                    found.setdefault(i, []).append(p)
            if f.endswith((".tar.gz", ".whl")) or "/.cache/pip" in p:
                found.setdefault("archive", []).append(p)
print(json.dumps(found))
"""
    by_package: dict[str, SweRecord] = {}
    for r in swe_set:
        by_package.setdefault(r.repo, r)
    for r in by_package.values():
        file = _mutated_file(r)
        original = _original_snippet(r)
        buggy_line = (Path(r.image) / "testbed" / file).read_bytes().splitlines()[_changed_old_line(r) - 1]
        hidden = [
            ln[1:] for ln in r.test_patch.split("\n") if ln.startswith("+") and not ln.startswith("+++")
        ]
        hidden_blob = "\n".join(hidden).encode()
        needles = [original, hidden_blob, buggy_line]
        async with sandbox_manager.sandbox(sandbox_config(r.image), owner="test") as sb:
            git = await sb.tools.bash(
                "cd /testbed && git log --all --format=%H && echo --- && git fsck --lost-found --unreachable 2>&1"
                " && echo --- && git reflog --all --format=%H | sort -u",
                timeout=60,
            )
            log, fsck, reflog = git.output.split("---")
            assert log.split() == [r.base_commit]
            assert "dangling" not in fsck and "unreachable" not in fsck
            assert reflog.split() == [r.base_commit]
            objects = await sb.tools.bash(
                "cd /testbed && git cat-file --batch-all-objects --batch > /tmp/objects.bin", timeout=60
            )
            assert objects.exit_code == 0
            blob = await sb.tools.read_file("/tmp/objects.bin")
            assert buggy_line in blob  # the search sees object contents...
            assert original not in blob and hidden_blob not in blob  # ...and the secrets are not there
            await sb.tools.write_file("/tmp/scan.py", scan)
            res = await sb.tools.bash(
                f"python3 /tmp/scan.py '{json.dumps([n.hex() for n in needles])}'", timeout=300
            )
            found = json.loads(res.output.strip().splitlines()[-1])
            assert "0" not in found and "1" not in found, (r.instance_id, found)
            assert "archive" not in found, found
            assert any(p.startswith("/testbed/") for p in found.get("2", [])), found  # the scan works


def test_the_cli_writes_the_records(swe_set: list[SweRecord], tmp_path: Path) -> None:
    out = tmp_path / "swe.jsonl"
    args = ["build", "--out", str(out), "--report", str(tmp_path / "r.json")]
    args += ["--packages", ",".join(FAST_PACKAGES), "--per-package", "4", "--jobs", "2", "--seed", "0"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    written = list(read_jsonl(out))
    assert [r.instance_id for r in written] == [r.instance_id for r in swe_set]
    assert all(rep["cached"] for rep in json.loads((tmp_path / "r.json").read_text()))


def test_unknown_packages_are_refused() -> None:
    result = CliRunner().invoke(app, ["build", "--packages", "left-pad", "--out", "/dev/null"])
    assert result.exit_code == 2 and "unknown package" in result.output
