"""The SWE handler end to end through the full HTTP service, in real bwrap (and apptainer) sandboxes.

The built small set of ``raas swe build`` (three packages, twelve instances; built once and cached, see
test_swe_integration.py) is served to a scripted policy that speaks vLLM's wire protocol and acts through
the real tools: typing the gold patch with the editor (or ``git apply`` in bash) resolves the instance
(reward 1), an edit that fixes nothing does not (0), no edit is an empty patch (0, tests skipped), a patch
that does not apply is ``patch_failed`` (0, not filtered), a broken hidden test patch is ``eval_error``
(filtered). The hidden tests are never visible in the RUN sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.agent.scripted import tool_call
from tests.conftest import unavailable
from tests.doubles.scripted_llm import ScriptedLLM

from raas.agent.config import AgentConfig
from raas.cli.inprocess import service_in_process
from raas.errors import RaasError
from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer
from raas.pipeline.config import ServiceConfig
from raas.sandbox import SandboxManager
from raas.tasks.registry import HandlerRegistry
from raas.tasks.swe import r2e
from raas.tasks.swe.build import BuildOptions, build
from raas.tasks.swe.config import SweConfig
from raas.tasks.swe.handler import SweHandler
from raas.tasks.swe.packages import FAST_PACKAGES
from raas.tasks.swe.patch import ExtractedPatch
from raas.tasks.swe.records import SweRecord
from raas.tasks.swe.replay import ScriptBook, gold_by_bash, gold_by_editor, wrong_edit
from raas.tasks.swe.runner import apply_patch, run_command, sandbox_config
from raas.trainer.client import RaasClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

SMALL_SET = {"packages": list(FAST_PACKAGES), "per_package": 4, "seed": 0, "jobs": 2}


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


class CorruptingSweHandler(SweHandler):
    """Test double: the real handler, but the patch it takes from the RUN sandbox is corrupted (a removed
    line that is not in the file), so EVAL meets a patch that does not apply."""

    name = "test.swe-corrupt"

    async def extract_patch(self, sandbox: Any, task: Any, base: str) -> ExtractedPatch:
        patch: ExtractedPatch = await super().extract_patch(sandbox, task, base)
        patch.text = re.sub(r"^-(?!--).*$", "-this line is not in the file", patch.text, count=1, flags=re.M)
        return patch


class ShortEvalSweHandler(SweHandler):
    """The real handler with a 5 s limit on EVAL's test run (as ``swe-mini`` has 60 s)."""

    name = "test.swe-short-eval"
    config = SweConfig(test_timeout_s=5.0)


def instance(r: SweRecord, **extra: Any) -> dict[str, Any]:
    return {**r.model_dump(mode="json"), **extra}


def buggy_file(r: SweRecord) -> tuple[str, int]:
    m = re.search(r"^diff --git a/(\S+) b/", r.patch, re.M)
    assert m
    return m.group(1), len((Path(r.image) / "testbed" / m.group(1)).read_text().splitlines())


def hidden_file(r: SweRecord) -> str:
    return r.FAIL_TO_PASS[0].split("::")[0]


@contextlib.asynccontextmanager
async def swe_service(
    tmp_path: Path,
    book: ScriptBook,
    manager: SandboxManager,
    backend: str = "bwrap",
    image: str | None = None,
) -> AsyncIterator[str]:
    registry = HandlerRegistry()
    registry.register(CorruptingSweHandler)
    registry.register(ShortEvalSweHandler)
    async with ScriptedLLM(book) as llm:
        config = ServiceConfig(
            state_dir=tmp_path / "svc",
            sandbox={"backend": backend, "image": image},
            llm_servers=[llm.url],
            tokenizer_dir=prepare_tokenizer(),
            agent=AgentConfig(max_turns=8, max_tokens_per_turn=8192, context_budget=32768),
            init_workers=2,
            run_workers=4,
            eval_workers=2,
            default_timeout_s=900,
            shutdown_grace_s=0.0,
        )
        async with service_in_process(config, sandbox_manager=manager, handlers=registry) as url:
            yield url
    assert manager.list() == [], "the service left sandboxes open"


async def run_jobs(url: str, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    async with RaasClient(url, timeout_s=60) as client:
        await client.submit_batch(jobs)
        return list(await asyncio.gather(*(client.wait(j["job_id"], timeout_s=900) for j in jobs)))


def observations(result: dict[str, Any]) -> str:
    return "\n".join(m["content"] for m in result["messages"] if m["role"] == "tool")


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(prepare_tokenizer())


async def test_gold_wrong_and_empty_through_the_service(
    swe_set: list[SweRecord], tok: ChatTokenizer, sandbox_manager: SandboxManager, tmp_path: Path
) -> None:
    book = ScriptBook(tok)
    jobs: list[dict[str, Any]] = []
    first_per_repo = {r.repo: r for r in reversed(swe_set)}.values()
    for i, r in enumerate(swe_set):
        look = f"test -e /testbed/{hidden_file(r)} && echo HIDDEN_VISIBLE || echo HIDDEN_ABSENT; git -C /testbed status --short"
        calls = [tool_call("bash", command=look)]
        calls += gold_by_bash(r.patch) if i == 0 else gold_by_editor(r.patch)
        jobs.append(
            {"job_id": f"gold-{i}", "instance": instance(r), "sampling_params": book.add(f"gold-{i}", calls)}
        )
    for i, r in enumerate(first_per_repo):
        path, n = buggy_file(r)
        jobs.append(
            {
                "job_id": f"wrong-{i}",
                "instance": instance(r),
                "sampling_params": book.add(f"wrong-{i}", wrong_edit(path, n)),
            }
        )
        jobs.append(
            {"job_id": f"empty-{i}", "instance": instance(r), "sampling_params": book.add(f"empty-{i}", [])}
        )
    async with swe_service(tmp_path, book, sandbox_manager) as url:
        results = {res["job_id"]: res for res in await run_jobs(url, jobs)}
    by_id = {r.instance_id: r for r in swe_set}
    for job_id, res in results.items():
        assert res["status"] == "completed" and res["filter"] is False, (
            job_id,
            res["error"],
            res["artifacts"],
        )
        arts, details = res["artifacts"], res["artifacts"]["eval_details"]
        record = by_id[res["instance_id"]]
        if job_id.startswith("gold"):
            assert res["reward"] == 1.0 and res["resolved"] is True, (
                job_id,
                details,
                arts.get("test_log", "")[-2000:],
            )
            assert arts["outcome"] == "resolved" and details["status"] == "RESOLVED_FULL"
            assert arts["git_patch"].startswith(f"diff --git a/{buggy_file(record)[0]}")
            assert arts["patch_files"] == [buggy_file(record)[0]]
            assert "HIDDEN_ABSENT" in observations(res) and "HIDDEN_VISIBLE" not in observations(res)
            assert details["eval_sandbox"] == "prewarmed" and res["timing"]["prewarm_s"] > 0
            assert "passed" in arts["test_log"]
        elif job_id.startswith("wrong"):
            assert (res["reward"], res["resolved"], arts["outcome"]) == (0.0, False, "unresolved"), details
            assert "# reviewed" in arts["git_patch"] and details["tests_status"]["FAIL_TO_PASS"]["failure"]
        else:
            assert (res["reward"], arts["outcome"], arts["git_patch"]) == (0.0, "empty_patch", "")
            assert "test_log" not in arts  # skipped: an empty patch runs no tests
    assert results["gold-0"]["turns"][1]["output_ids"]  # the bash `git apply` turn was sampled


async def test_patch_failed_eval_error_and_bad_records(
    swe_set: list[SweRecord], tok: ChatTokenizer, sandbox_manager: SandboxManager, tmp_path: Path
) -> None:
    r = swe_set[4]
    book = ScriptBook(tok)
    hidden = hidden_file(r)
    broken_tests = r.test_patch.replace("new file mode 100644\n", "").replace(
        "--- /dev/null", f"--- a/{hidden}"
    )
    jobs = [
        {
            "job_id": "corrupt",
            "instance": instance(r, data_source="test.swe-corrupt"),
            "sampling_params": book.add("corrupt", gold_by_editor(r.patch)),
        },
        {
            "job_id": "harness-broken",
            "instance": instance(r, test_patch=broken_tests),
            "sampling_params": book.add("harness-broken", gold_by_editor(r.patch)),
        },
        {  # a patch whose module loops for ever on import: the tests time out, a policy's failure
            "job_id": "loops",
            "instance": instance(r, data_source="test.swe-short-eval"),
            "sampling_params": book.add(
                "loops",
                [
                    tool_call(
                        "bash",
                        command=f"printf '\\nwhile True:\\n    pass\\n' >> /testbed/{buggy_file(r)[0]}",
                    )
                ],
            ),
        },
    ]
    async with swe_service(tmp_path, book, sandbox_manager) as url:
        corrupt, broken, loops = await run_jobs(url, jobs)
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            bad = instance(r)
            del bad["FAIL_TO_PASS"]
            resp = await http.post("/v1/jobs", json={"instance": bad})
            assert resp.status_code == 400 and "field FAIL_TO_PASS" in resp.json()["detail"]
            resp = await http.post("/v1/jobs", json={"instance": instance(r, base_commit="HEAD")})
            assert resp.status_code == 400 and "field base_commit" in resp.json()["detail"]
            resp = await http.post("/v1/jobs", json={"instance": instance(r, PASS_TO_PASS="[oops")})
            assert resp.status_code == 400 and "field PASS_TO_PASS" in resp.json()["detail"]
    assert corrupt["status"] == "completed" and corrupt["filter"] is False
    assert (corrupt["reward"], corrupt["artifacts"]["outcome"]) == (0.0, "patch_failed")
    assert "this line is not in the file" in corrupt["artifacts"]["git_patch"]
    assert broken["status"] == "failed" and broken["filter"] is True and broken["reward"] is None
    assert broken["error"]["kind"] == "eval_error" and broken["error"]["stage"] == "eval"
    assert loops["status"] == "completed" and loops["filter"] is False, loops["error"]
    assert (loops["reward"], loops["artifacts"]["outcome"]) == (0.0, "tests_timed_out")
    assert "while True:" in loops["artifacts"]["git_patch"]
    # (under SWE's default limit of 1,800 s it would outlast this test's own 1,500 s timeout)


async def test_prorl_process_returns_git_patch_under_apptainer(
    swe_set: list[SweRecord],
    tok: ChatTokenizer,
    sandbox_manager: SandboxManager,
    tmp_path: Path,
    backend_available: dict[str, str | None],
) -> None:
    if backend_available.get("apptainer"):
        unavailable(str(backend_available["apptainer"]))
    r = swe_set[8]
    book = ScriptBook(tok)
    params = book.add("apptainer-gold", gold_by_editor(r.patch))
    async with swe_service(tmp_path, book, sandbox_manager, backend="apptainer") as url:
        async with httpx.AsyncClient(base_url=url, timeout=900) as http:
            assert (await http.post("/start")).status_code == 200
            resp = await http.post("/process", json={"instance": instance(r), "sampling_params": params})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["resolved"] is True and body["reward"] == 1.0, body.get("artifacts", {}).get("eval_details")
    assert body["git_patch"] == body["artifacts"]["git_patch"] and body["git_patch"].startswith("diff --git")


def r2e_image(r: SweRecord, dest: Path) -> Path:
    """An R2E-Gym-shaped image from a built instance: the hidden tests in /r2e_tests, /testbed/run_tests.sh
    running them with pytest -rA (hard links to the cached image where allowed)."""
    root = dest / "r2e-root"
    if subprocess.run(["cp", "-al", r.image, str(root)], capture_output=True, check=False).returncode != 0:
        # Another user may not link root's files: copy them (a few root-only apt/dpkg lock files fail).
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["cp", "-a", r.image, str(root)], capture_output=True, check=False)
        assert (root / "testbed" / ".git").is_dir() and (root / "usr" / "bin" / "python3").exists()
    hidden = hidden_file(r)
    text = "".join(
        line[1:] + "\n"
        for line in r.test_patch.split("\n")
        if line.startswith("+") and not line.startswith("+++")
    )
    (root / "r2e_tests").mkdir()
    (root / "r2e_tests" / "test_1.py").write_text(text)
    script = root / "testbed" / "run_tests.sh"
    script.unlink(missing_ok=True)
    script.write_text("python3 -B -m pytest -rA -p no:cacheprovider --rootdir=/testbed r2e_tests\n")
    for p in (root / "r2e_tests", root / "r2e_tests" / "test_1.py", script):
        p.chmod(0o755 if p.is_dir() else 0o644)
    assert hidden  # the same tests, under R2E-Gym's layout
    return root


async def test_an_r2e_gym_record_hides_its_tests_and_grades_by_expected_output(
    swe_set: list[SweRecord],
    tok: ChatTokenizer,
    sandbox_manager: SandboxManager,
    tmp_path: Path,
    visible_tmp: Path,
) -> None:
    r = swe_set[0]
    root = r2e_image(r, visible_tmp)
    # R2E-Gym's expected output is the run of the tests on the fixed code: made here the same way.
    async with sandbox_manager.sandbox(sandbox_config(root), owner="expected") as sb:
        assert (await apply_patch(sb, r.patch, "gold"))[0] == "git apply"
        await sb.tools.bash("cd /testbed && ln -s /r2e_tests r2e_tests", timeout=30)
        run = await run_command(sb, "bash run_tests.sh", timeout_s=300)
    expected = r2e.parse_log(run.output)
    assert len(expected) > len(r.FAIL_TO_PASS) and set(expected.values()) == {"PASSED"}
    row = {
        "data_source": "r2e-gym",
        "repo_name": r.repo,
        "docker_image": "unused/by-this-test",
        "image": str(root),
        "problem_statement": r.problem_statement,
        "expected_output_json": json.dumps(expected),
        "instance_id": "r2e-" + r.instance_id,
    }
    book = ScriptBook(tok)
    look = tool_call(
        "bash", command="ls /r2e_tests /testbed/run_tests.sh /testbed/r2e_tests 2>&1; echo LOOKED"
    )
    jobs = [
        {
            "job_id": "r2e-gold",
            "instance": row,
            "sampling_params": book.add("r2e-gold", [look, *gold_by_editor(r.patch)]),
        },
        {
            "job_id": "r2e-wrong",
            "instance": row,
            "sampling_params": book.add("r2e-wrong", wrong_edit(*buggy_file(r))),
        },
    ]
    try:
        async with swe_service(tmp_path, book, sandbox_manager) as url:
            gold, wrong = await run_jobs(url, jobs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert gold["status"] == "completed", gold["error"]
    details = gold["artifacts"]["eval_details"]
    assert gold["reward"] == 1.0 and gold["artifacts"]["outcome"] == "resolved", details
    seen = observations(gold)
    # run_tests.sh and the repository's link are gone; /r2e_tests (a mount point) is there, but empty.
    assert "LOOKED" in seen and seen.count("No such file or directory") == 2, seen
    assert "/r2e_tests:\n" in seen and "test_1.py" not in seen
    assert "run_tests.sh" not in gold["artifacts"]["git_patch"]
    assert wrong["reward"] == 0.0 and wrong["artifacts"]["outcome"] == "unresolved"
    assert wrong["artifacts"]["eval_details"]["mismatched"]
