"""``raas swe eval``: grade existing patches (SWE-bench predictions) against SWE records, offline.

Why: a user with a model's patches wants SWE-bench's verdict without writing a trainer or a policy. Each
patch is graded by the task handler's own EVAL stage (:meth:`raas.tasks.swe.handler.SweHandler.eval`) in
a fresh sandbox from the record's image, exactly as a rollout's patch is: the patch stands in for what
RUN would have produced (the ``git_patch`` artifact), and the result is built by the pipeline's result
builder, so a row has the fields ``raas run`` writes. Bad input is an error row for that instance only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raas.core.jobs import ErrorInfo, Job, JobResult, Timing
from raas.core.trajectory import RunOutput
from raas.errors import RaasError
from raas.pipeline.results import build_result, error_of, evaluated, failed
from raas.sandbox import SandboxManager
from raas.sandbox.config import config_from_dict
from raas.tasks.base import Env, JobSandboxes, TaskHandler
from raas.tasks.datasets import load_dataset
from raas.tasks.registry import HandlerRegistry
from raas.tasks.swe.images import SWE_SOURCES

INPUT_STAGE = "input"
"""The ``error.stage`` of a problem found before grading (the prediction or the record)."""
TRAJECTORY_FIELDS = {"messages", "turns", "token_trajectory", "segments"}
"""Empty in an eval row (there is no rollout), so left out of it."""


@dataclass
class Prediction:
    """One row of a SWE-bench predictions file (``error``: why it cannot be graded)."""

    instance_id: str
    model_patch: str
    model_name_or_path: str = ""
    error: ErrorInfo | None = None


def _bad(message: str, kind: str = "bad_request") -> ErrorInfo:
    return ErrorInfo(stage=INPUT_STAGE, kind=kind, message=message)


def looks_like_diff(patch: str) -> bool:
    """A unified diff (``git diff`` or plain ``diff -u``): what ``git apply`` / ``patch`` can read."""
    return "diff --git " in patch or ("\n--- " in "\n" + patch and "\n+++ " in patch and "\n@@" in patch)


def prediction_of(row: Any, where: str) -> Prediction:
    """Read one prediction; a problem with the patch becomes its ``error`` (the others still grade)."""
    if not isinstance(row, dict):
        return Prediction(where, "", error=_bad(f"{where}: a prediction must be a JSON object"))
    ident = row.get("instance_id")
    if not isinstance(ident, str) or not ident:
        return Prediction(where, "", error=_bad(f"{where}: instance_id is missing"))
    name = row.get("model_name_or_path")
    pred = Prediction(ident, "", str(name) if name is not None else "")
    patch = row.get("model_patch")
    if patch is None:  # SWE-bench grades a null patch as an empty one
        return pred
    if not isinstance(patch, str):
        pred.error = _bad(f"{where}: model_patch must be a string, got {type(patch).__name__}")
    elif patch.strip() and not looks_like_diff(patch):
        pred.error = _bad(f"{where}: model_patch is not a unified diff (no 'diff --git' or ---/+++/@@ lines)")
    else:
        pred.model_patch = patch
    return pred


def load_predictions(path: Path) -> list[Prediction]:
    """A SWE-bench predictions file: JSONL, a JSON list, or a JSON object keyed by ``instance_id``.
    An unreadable file is a ``bad_request``; a bad row is a prediction with an ``error``."""
    if not path.is_file():
        raise RaasError(f"predictions file {path} not found", kind="bad_request")
    text = path.read_text(encoding="utf-8")
    rows: list[tuple[Any, str]] = []
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise RaasError(f"{path}: invalid JSON: {e.msg}", kind="bad_request") from e
        if isinstance(data, dict):
            data = [{"instance_id": k, **v} if isinstance(v, dict) else v for k, v in data.items()]
        if not isinstance(data, list):
            raise RaasError(
                f"{path}: a .json predictions file must be a list or an object", kind="bad_request"
            )
        rows = [(r, f"{path}: prediction {i}") for i, r in enumerate(data)]
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((json.loads(line), f"{path}:{lineno}"))
            except json.JSONDecodeError as e:
                pred = Prediction(
                    f"{path}:{lineno}", "", error=_bad(f"{path}:{lineno}: invalid JSON: {e.msg}")
                )
                rows.append((pred, ""))
    return [r if isinstance(r, Prediction) else prediction_of(r, where) for r, where in rows]


def single_prediction(patch_file: Path, instance_id: str, model: str = "") -> Prediction:
    """``--patch FILE --instance ID``: one prediction from a diff file."""
    if not patch_file.is_file():
        raise RaasError(f"patch file {patch_file} not found", kind="bad_request")
    row = {"instance_id": instance_id, "model_patch": patch_file.read_text(encoding="utf-8")}
    return prediction_of({**row, "model_name_or_path": model or patch_file.name}, str(patch_file))


def error_row(pred: Prediction, error: ErrorInfo, job_id: str) -> dict[str, Any]:
    result = build_result(
        Job(job_id=job_id, instance={"instance_id": pred.instance_id}, trajectory_id=job_id),
        failed(error),
        None,
        Timing(),
    )
    return eval_row(result, pred)


def _tests(details: dict[str, Any]) -> tuple[dict[str, dict[str, list[str]]], list[str]]:
    """Per SWE-bench category (FAIL_TO_PASS, PASS_TO_PASS, ...) the tests that passed and failed, and every
    failing test name (R2E records: the tests whose status differs from ``expected_output_json``)."""
    status = details.get("tests_status") or {}
    tests = {
        cat: {"passed": list(v.get("success") or []), "failed": list(v.get("failure") or [])}
        for cat, v in status.items()
        if isinstance(v, dict)
    }
    failing = [t for cat in ("FAIL_TO_PASS", "PASS_TO_PASS") for t in tests.get(cat, {}).get("failed", [])]
    failing += [t for t in details.get("mismatched") or [] if t not in failing]
    return tests, failing


def eval_row(result: JobResult, pred: Prediction) -> dict[str, Any]:
    """A result row: the :class:`JobResult` fields ``raas run`` writes (no trajectory: nothing ran a
    policy), plus the prediction's model and the graded tests lifted out of ``artifacts.eval_details``."""
    row = result.model_dump(mode="json", exclude=TRAJECTORY_FIELDS)
    details = row["artifacts"].get("eval_details") or {}
    tests, failing = _tests(details)
    row.update(
        model_name_or_path=pred.model_name_or_path,
        outcome=row["artifacts"].get("outcome"),
        tests=tests,
        failing_tests=failing,
    )
    return row


async def grade_one(
    handler: TaskHandler,
    manager: SandboxManager,
    default_box: dict[str, Any],
    instance: dict[str, Any],
    pred: Prediction,
    job_id: str,
) -> dict[str, Any]:
    """The handler's EVAL of ``pred.model_patch`` for ``instance``, every sandbox closed on return."""
    job = Job(job_id=job_id, instance=instance, trajectory_id=job_id)
    run = RunOutput(finish_reason="finish_tool", artifacts={"git_patch": pred.model_patch})
    sandboxes = JobSandboxes(manager, config_from_dict(default_box), job_id)
    started = time.monotonic()
    try:
        handler.validate_instance(instance)
    except RaasError as e:
        return error_row(pred, _bad(e.message), job_id)
    limit = handler.policy.stage_timeouts.eval
    try:
        env = Env(job=job, sandboxes=sandboxes, run_output=run)
        async with asyncio.timeout(limit):
            out = await handler.eval(job, env)
        outcome = evaluated(run, out)
    except TimeoutError:
        outcome = failed(ErrorInfo(stage="eval", kind="timeout", message=f"EVAL took over {limit:g} s"))
    except Exception as e:  # a typed error of the handler, or a bug: the row says which, the others go on
        outcome = failed(error_of(e, "eval"))
    finally:
        await sandboxes.close_all()
    elapsed = round(time.monotonic() - started, 3)
    result = build_result(job, outcome, run, Timing(eval_s=elapsed, total_s=elapsed))
    return eval_row(result, pred)


def match(
    instances: list[dict[str, Any]], preds: list[Prediction]
) -> list[tuple[Prediction, dict[str, Any] | None]]:
    """Each prediction with its record (None, and an error on the prediction, when there is none)."""
    by_id = {str(i.get("instance_id")): i for i in instances}
    out: list[tuple[Prediction, dict[str, Any] | None]] = []
    for p in preds:
        inst = by_id.get(p.instance_id)
        if p.error is None and inst is None:
            p.error = _bad(f"instance {p.instance_id!r} is not in the dataset", kind="not_found")
        elif p.error is None and inst is not None and inst.get("data_source") not in SWE_SOURCES:
            p.error = _bad(
                f"instance {p.instance_id!r} is a {inst.get('data_source')!r} record, not a SWE one"
            )
        out.append((p, inst))
    return out


async def evaluate_predictions(
    dataset: str,
    preds: list[Prediction],
    *,
    sandbox: dict[str, Any],
    jobs: int = 2,
    on_done: Callable[[dict[str, Any]], None] | None = None,
    registry: HandlerRegistry | None = None,
) -> list[dict[str, Any]]:
    """Grade every prediction against its record of ``dataset`` (a file ``raas run`` accepts), ``jobs`` at
    a time, with a sandbox manager of its own (closed on return). Rows come back in ``preds`` order."""
    instances = load_dataset(dataset)
    registry = registry or HandlerRegistry()
    run_id = "swe-eval-" + secrets.token_hex(4)
    gate = asyncio.Semaphore(jobs)
    state = Path(tempfile.mkdtemp(prefix="raas-swe-eval-"))
    manager = SandboxManager(state / "sandboxes")

    async def one(i: int, pred: Prediction, inst: dict[str, Any] | None) -> dict[str, Any]:
        job_id = f"{run_id}-{i:05d}"
        if pred.error is not None or inst is None:
            row = error_row(pred, pred.error or _bad("no record"), job_id)
        else:
            async with gate:
                try:
                    handler = registry.get(str(inst["data_source"]))
                except RaasError as e:
                    row = error_row(pred, _bad(e.message), job_id)
                else:
                    row = await grade_one(handler, manager, sandbox, inst, pred, job_id)
        if on_done is not None:
            on_done(row)
        return row

    try:
        pairs = match(instances, preds)
        return list(await asyncio.gather(*(one(i, p, inst) for i, (p, inst) in enumerate(pairs))))
    finally:
        with contextlib.suppress(Exception):
            await manager.close_all()
        shutil.rmtree(state, ignore_errors=True)
