"""The result builder: from what a job produced and how it ended to the :class:`JobResult` a trainer gets.

Pure functions, no I/O, so every rule is visible in one place:

* a job's status comes from its error kind (:func:`status_for`): ``timeout`` (the job's own budget,
  see :mod:`raas.errors`) is status ``timeout``, ``cancelled`` is ``cancelled``, every other kind is
  ``failed``;
* only a ``completed`` job has a reward and ``filter = false``; every failure is filtered and has none
  (:func:`raas.errors.is_infrastructure` kinds never reach the policy, and no failure is ever a reward);
* ``artifacts`` are the handler's run and eval artifacts plus ``finish_reason``, ``answer``, ``metrics``,
  ``eval_details`` and, for failures, ``traceback``.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from raas.core.jobs import ErrorInfo, Job, JobResult, TerminalStatus, Timing
from raas.core.trajectory import EvalOutput, RunOutput, TokenTrajectory
from raas.errors import RaasError

STATUS_OF_KIND: dict[str, TerminalStatus] = {"timeout": "timeout", "cancelled": "cancelled"}
"""Error kinds with a job status of their own; all others are ``failed``."""


def status_for(kind: str) -> TerminalStatus:
    """The job status of a job that ended with an error of ``kind``."""
    return STATUS_OF_KIND.get(kind, "failed")


def error_of(exc: BaseException, stage: str) -> ErrorInfo:
    """The typed error a stage's exception becomes (an untyped one is the handler's ``handler_error``)."""
    if isinstance(exc, RaasError):
        return ErrorInfo(stage=stage, kind=exc.kind, message=exc.message)
    if isinstance(exc, asyncio.CancelledError):
        return ErrorInfo(stage=stage, kind="cancelled", message="cancelled")
    return ErrorInfo(stage=stage, kind="handler_error", message=f"{type(exc).__name__}: {exc}")


INTERRUPTED_IN_FLIGHT = "the service shut down while the job was in flight"
INTERRUPTED_STUCK = "the service shut down and the job did not stop in time"


def interrupted(stage: str, message: str = INTERRUPTED_IN_FLIGHT) -> ErrorInfo:
    return ErrorInfo(stage=stage, kind="interrupted", message=message)


def run_artifacts(run: RunOutput | None) -> dict[str, Any]:
    """What a RUN stage contributes to the artifacts (nothing when it never finished)."""
    if run is None:
        return {}
    arts: dict[str, Any] = dict(run.artifacts)
    arts["finish_reason"] = run.finish_reason
    if run.answer is not None:
        arts["answer"] = run.answer
    if run.metrics:
        arts["metrics"] = run.metrics
    return arts


@dataclass(frozen=True)
class Outcome:
    """How a job ended, before it becomes a result."""

    status: TerminalStatus
    reward: float | None = None
    resolved: bool | None = None
    error: ErrorInfo | None = None
    artifacts: dict[str, Any] | None = None


def failed(error: ErrorInfo, *, traceback: str | None = None, resolved: bool | None = None) -> Outcome:
    """A job that ended with ``error`` (status from its kind)."""
    return Outcome(
        status=status_for(error.kind),
        error=error,
        resolved=resolved,
        artifacts={"traceback": traceback} if traceback else None,
    )


def evaluated(run: RunOutput | None, out: EvalOutput) -> Outcome:
    """A job whose EVAL stage returned ``out``: completed with its reward, or failed when the reward is
    missing or not a finite number (never guessed)."""
    arts = run_artifacts(run)
    arts.update(out.artifacts)
    if out.details:
        arts["eval_details"] = out.details
    if out.reward is None or not math.isfinite(out.reward):
        error = ErrorInfo(stage="eval", kind="handler_error", message="evaluation produced no usable reward")
        return Outcome(status="failed", error=error, resolved=out.resolved, artifacts=arts)
    return Outcome(status="completed", reward=float(out.reward), resolved=out.resolved, artifacts=arts)


def build_result(job: Job, outcome: Outcome, run: RunOutput | None, timing: Timing) -> JobResult:
    """The :class:`JobResult` of ``job``; ``run`` is the RUN stage's output if it finished."""
    arts = dict(outcome.artifacts or {})
    if run is not None and "finish_reason" not in arts:
        arts.update(run.artifacts)
        arts["finish_reason"] = run.finish_reason
    completed = outcome.status == "completed"
    return JobResult(
        job_id=job.job_id,
        instance_id=job.instance_id,
        trajectory_id=job.trajectory_id,
        status=outcome.status,
        reward=outcome.reward if completed else None,
        resolved=outcome.resolved,
        error=outcome.error,
        filter=not completed,
        messages=run.messages if run else [],
        turns=run.turns if run else [],
        token_trajectory=run.token_trajectory if run else TokenTrajectory(),
        segments=run.segments if run else [],
        artifacts=arts,
        timing=timing,
    )


def not_requeued(job_id: str, instance_id: str | None, trajectory_id: str | None, why: str) -> JobResult:
    """The result of a job the ledger re-queued after a restart that can no longer be admitted."""
    return JobResult(
        job_id=job_id,
        instance_id=instance_id,
        trajectory_id=trajectory_id,
        status="failed",
        error=ErrorInfo(stage="queue", kind="bad_request", message=f"cannot re-queue after restart: {why}"),
        filter=True,
    )
