"""EVAL of one SWE task in a fresh sandbox: apply the policy's patch, run the hidden tests, grade.

Outcomes (``EvalOutput.details["outcome"]``; reward 1 only for ``resolved``):

* ``resolved`` — every FAIL_TO_PASS and PASS_TO_PASS test passes (R2E: the run matches
  ``expected_output_json``);
* ``unresolved`` — the tests ran and some failed, or the patch broke the test run itself (no results);
* ``empty_patch`` — the policy changed nothing; the tests are not run (``run_empty_patch`` runs them);
* ``patch_failed`` — the patch applies neither with ``git apply`` nor with ``patch --fuzz``;
* ``patch_too_large`` — over ``patch_cap_bytes``; ``no_patch`` — the policy broke the repository so no
  patch could be taken; ``tests_timed_out`` — the test run passed ``test_timeout_s``.

All of these are the policy's doing: reward 0, not filtered. When the harness itself breaks — the hidden
test patch does not apply although the policy's patch cannot touch its files, the test script is missing,
or the log shows an environment failure by SWE-bench's own classifier
(``swebench.harness.infra_failure``, tier ``environment``) — EVAL raises ``eval_error``: the job fails
and is filtered, never scored 0.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

from raas.agent.tools import truncate
from raas.core.executors import Executor
from raas.errors import RaasError
from raas.sandbox.base import Sandbox

from . import grading, r2e, runner
from .instance import SweTask

EVAL_SCRIPT = "/tmp/.raas-swe-eval.sh"
RUN_TESTS = "/tmp/.raas-swe-run_tests.sh"


@dataclass
class Verdict:
    outcome: str
    details: dict[str, Any] = field(default_factory=dict)
    test_log: str | None = None

    @property
    def resolved(self) -> bool:
        return self.outcome == "resolved"


def eval_error(message: str) -> RaasError:
    return RaasError(message, kind="eval_error", stage="eval")


def environment_failure(log: str) -> str | None:
    """SWE-bench's reason when a log without results shows the environment broke (not the patch)."""
    try:
        from swebench.harness.infra_failure import TIER_ENVIRONMENT, classify_text
    except ImportError:  # pragma: no cover - depends on the install
        return None
    found = classify_text(log)
    return found[0] if found is not None and found[1] == TIER_ENVIRONMENT else None


def _no_results(log: str, details: dict[str, Any], cap: int) -> Verdict:
    reason = environment_failure(log)
    if reason is not None:
        raise eval_error(f"the test environment failed ({reason}); log tail: {log[-1500:]}")
    return Verdict("unresolved", {**details, "log_valid": False}, truncate(log, cap))


async def evaluate_task(
    sb: Sandbox, task: SweTask, patch: str, *, timeout_s: float, log_cap: int, grader: Executor
) -> Verdict:
    """Grade ``patch`` for ``task`` in ``sb`` (a fresh sandbox, repository at the base commit)."""
    if task.grading == "test_cmd":
        return await _by_test_cmd(sb, task, patch, timeout_s, log_cap, grader)
    if task.grading == "eval_script":
        return await _by_eval_script(sb, task, patch, timeout_s, log_cap, grader)
    return await _by_r2e(sb, task, patch, timeout_s, log_cap)


async def _apply(sb: Sandbox, task: SweTask, patch: str) -> tuple[str | None, str]:
    if not patch.strip():
        return "none", ""
    return await runner.apply_patch(sb, patch, "model", workdir=task.workdir, fuzzy=True)


async def _by_test_cmd(
    sb: Sandbox, task: SweTask, patch: str, timeout_s: float, cap: int, grader: Executor
) -> Verdict:
    record = task.grading_record()
    res = await runner.evaluate(sb, record, patch, timeout_s=timeout_s, fuzzy=True, grader=grader)
    details: dict[str, Any] = {"apply_method": res.apply_method}
    if not res.patch_applied:
        return Verdict("patch_failed", {**details, "apply_output": res.apply_output[-2000:]})
    if not res.test_patch_applied:
        raise eval_error(
            "the hidden test patch did not apply on top of the policy's patch (which cannot touch its "
            f"files): {res.apply_output[-1500:]}"
        )
    assert res.run is not None
    log = res.run.output
    details.update(test_exit_code=res.run.exit_code, test_s=round(res.run.seconds, 3))
    if res.run.timed_out:
        return Verdict("tests_timed_out", details, truncate(log, cap))
    assert res.grade is not None
    if not res.grade.log_valid:
        return _no_results(log, details, cap)
    details.update(res.grade.to_dict())
    return Verdict("resolved" if res.grade.resolved else "unresolved", details, truncate(log, cap))


async def _by_eval_script(
    sb: Sandbox, task: SweTask, patch: str, timeout_s: float, cap: int, grader: Executor
) -> Verdict:
    from swebench.harness.utils import parse_eval_script, record_test_exit_code

    method, out = await _apply(sb, task, patch)
    if method is None:
        return Verdict("patch_failed", {"apply_output": out[-2000:]})
    assert task.eval_script is not None
    lines = record_test_exit_code(parse_eval_script(task.eval_script))
    await sb.tools.write_file(EVAL_SCRIPT, "\n".join(["#!/bin/bash", "set -uxo pipefail", *lines]) + "\n")
    run = await runner.run_command(sb, f"bash {EVAL_SCRIPT}", timeout_s=timeout_s, workdir=task.workdir)
    details: dict[str, Any] = {"apply_method": method, "test_s": round(run.seconds, 3)}
    if run.timed_out:
        return Verdict("tests_timed_out", details, truncate(run.output, cap))
    g = await grader.run(grading.grade, task.grading_record(), run.output, None, framed=True)
    if not g.log_valid:
        return _no_results(run.output, details, cap)
    details.update(g.to_dict())
    return Verdict("resolved" if g.resolved else "unresolved", details, truncate(run.output, cap))


async def _by_r2e(sb: Sandbox, task: SweTask, patch: str, timeout_s: float, cap: int) -> Verdict:
    method, out = await _apply(sb, task, patch)
    if method is None:
        return Verdict("patch_failed", {"apply_output": out[-2000:]})
    wd = shlex.quote(task.workdir)
    if task.run_tests is not None:
        await sb.tools.write_file(RUN_TESTS, task.run_tests)
        command = task.test_cmd or f"bash {RUN_TESTS}"
    else:
        check = await sb.tools.bash(f"test -f {wd}/run_tests.sh", timeout=30)
        if check.exit_code != 0 and task.test_cmd is None:
            raise eval_error(f"the image has no {task.workdir}/run_tests.sh and the record no run_tests")
        command = task.test_cmd or "bash run_tests.sh"
    # run_tests.sh names the hidden tests relative to the repository (`pytest r2e_tests`), as in R2E-Gym.
    link = f"cd {wd} && if [ -d /r2e_tests ] && [ ! -e r2e_tests ]; then ln -s /r2e_tests r2e_tests; fi"
    await sb.tools.bash(link, timeout=30)
    run = await runner.run_command(sb, command, timeout_s=timeout_s, workdir=task.workdir)
    details: dict[str, Any] = {
        "apply_method": method,
        "test_exit_code": run.exit_code,
        "test_s": round(run.seconds, 3),
    }
    if run.timed_out:
        return Verdict("tests_timed_out", details, truncate(run.output, cap))
    g = r2e.grade(run.output, task.expected_output)
    if not g.log_valid:
        return _no_results(run.output, details, cap)
    details.update(g.to_dict())
    return Verdict("resolved" if g.resolved else "unresolved", details, truncate(run.output, cap))
