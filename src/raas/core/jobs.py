"""Job requests, states and results: the records the pipeline, the ledger, the API and handlers share.

A job moves ``queued → init → queued_run → run → queued_eval → eval`` and ends in exactly one terminal
status (``completed``, ``failed``, ``timeout``, ``cancelled``). The result keeps the token-exact record of the
rollout and says, through ``filter``, whether a trainer may learn from it: any infrastructure failure
filters the trajectory and never fabricates a reward.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from raas.core.datasource import infer_data_source
from raas.core.trajectory import Message, TokenTrajectory, Turn

JobStatus = Literal[
    "queued",
    "init",
    "queued_run",
    "run",
    "queued_eval",
    "eval",
    "completed",
    "failed",
    "timeout",
    "cancelled",
]
TerminalStatus = Literal["completed", "failed", "timeout", "cancelled"]
StageName = Literal["init", "run", "eval"]

STAGES: tuple[StageName, ...] = ("init", "run", "eval")
TERMINAL: frozenset[str] = frozenset({"completed", "failed", "timeout", "cancelled"})
QUEUED_FOR: dict[StageName, str] = {"init": "queued", "run": "queued_run", "eval": "queued_eval"}

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,199}$"
_JOB_ID_RE = re.compile(JOB_ID_PATTERN)


def is_terminal(status: str) -> bool:
    return status in TERMINAL


def valid_job_id(job_id: str) -> bool:
    return bool(_JOB_ID_RE.match(job_id))


def new_job_id() -> str:
    return uuid.uuid4().hex


NO_DATA_SOURCE = (
    "instance.data_source is missing and the instance's fields imply no task (math: 'problem' and 'answer'; "
    "stem: 'question' and 'answer'; code: test cases; a SWE-bench or R2E-Gym record); name its task handler "
    "in data_source"
)


class JobRequest(BaseModel):
    """What a trainer submits. ``instance.data_source`` picks the task handler (inferred when absent:
    :func:`raas.core.datasource.infer_data_source`)."""

    model_config = ConfigDict(extra="forbid")

    instance: dict[str, Any]
    sampling_params: dict[str, Any] | None = None
    job_id: str | None = Field(
        None, pattern=JOB_ID_PATTERN, description="Idempotency key; generated if absent."
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=7 * 24 * 3600,
        description="Budget for time spent inside stages (queue waits do not count).",
    )
    priority: int = Field(0, ge=-1000, le=1000, description="Higher runs first; FIFO among equals.")
    retry_on_restart: bool = Field(
        False,
        description="A job inside INIT or RUN when the service dies starts again from INIT (generating anew) "
        "instead of failing with `interrupted`.",
    )
    resume_on_restart: bool = Field(
        True,
        description="After a restart, a job that had generated nothing yet (queued, INIT) runs again in its "
        "place and a job past RUN (its RUN output committed) resumes at EVAL. False: a restart fails it "
        "`interrupted` wherever it was.",
    )
    external_rollout: bool = Field(
        False,
        description="Set by POST /v1/gateway/rollouts: the agent runs outside raas, so after a restart the "
        "rollout resumes only if it was closed (its agent is gone otherwise).",
    )

    @field_validator("instance")
    @classmethod
    def _has_data_source(cls, value: dict[str, Any]) -> dict[str, Any]:
        """A missing ``data_source`` is inferred from the fields, as ``raas run`` does for a dataset file
        (one the fields do not imply is refused at admission: :data:`NO_DATA_SOURCE`)."""
        source = value.get("data_source")
        if source is None:
            inferred = infer_data_source(value)
            return value if inferred is None else {**value, "data_source": inferred}
        if not isinstance(source, str) or not source:
            raise ValueError("instance.data_source must be a non-empty string naming a task handler")
        return value


class ErrorInfo(BaseModel):
    """A typed failure: where it happened, what kind, and a human message."""

    stage: str | None = None
    kind: str
    message: str


class Timing(BaseModel):
    """Seconds spent waiting in queues and inside each stage; ``total_s`` is wall time from accept to end.

    ``prewarm_s`` is the time the handler's EVAL prewarm took (e.g. starting the fresh EVAL sandbox), which
    runs alongside RUN: it overlaps ``run_s`` and is not part of ``total_s - queue_s - init_s - run_s -
    eval_s``; 0 for handlers without one. Only what EVAL still had to wait for it counts in ``eval_s``."""

    queue_s: float = 0.0
    init_s: float = 0.0
    run_s: float = 0.0
    eval_s: float = 0.0
    total_s: float = 0.0
    prewarm_s: float = 0.0
    resumed_at: str | None = None
    """Where this job went on after a restart of the service: ``eval`` (its RUN output was committed and
    is graded as it was generated), ``run`` (a fresh INIT, its committed turns replayed, RUN went on:
    ``artifacts.resumed`` counts them) or ``init`` (it ran again from INIT: it had generated nothing yet,
    or its task or request asked for a restart); None: it ran in one go."""


class JobResult(BaseModel):
    """The finished job as a trainer receives it (native API)."""

    job_id: str
    instance_id: str | None = None
    trajectory_id: str | None = None
    status: TerminalStatus
    reward: float | None = None
    resolved: bool | None = None
    error: ErrorInfo | None = None
    filter: bool = True
    messages: list[Message] = Field(default_factory=list)
    turns: list[Turn] = Field(default_factory=list)
    token_trajectory: TokenTrajectory = Field(default_factory=TokenTrajectory)
    segments: list[TokenTrajectory] = Field(
        default_factory=list,
        description="Empty for one token sequence; else every sequence in order (token_trajectory is the last)",
    )
    artifacts: dict[str, Any] = Field(default_factory=dict)
    timing: Timing = Field(default_factory=Timing)


class JobInfo(BaseModel):
    """A job's current state, cheap to poll."""

    job_id: str
    status: JobStatus
    data_source: str | None = None
    instance_id: str | None = None
    trajectory_id: str | None = None
    priority: int = 0
    attempts: int = 1
    created_at: float
    updated_at: float
    error: ErrorInfo | None = None


class SubmitResponse(BaseModel):
    job_id: str
    status: JobStatus
    created: bool = Field(description="False when the job_id already existed (idempotent resubmit).")


class JobEvent(BaseModel):
    """One state change, as published on the event bus and over SSE."""

    job_id: str
    status: JobStatus
    at: float
    reward: float | None = None
    filter: bool | None = None
    error: ErrorInfo | None = None


@dataclass
class Job:
    """A job as a task handler sees it."""

    job_id: str
    instance: dict[str, Any]
    trajectory_id: str
    sampling_params: dict[str, Any] = field(default_factory=dict)
    external_rollout: bool = False
    """The agent runs outside raas (``POST /v1/gateway/rollouts``): INIT need not start a sandbox for it."""

    @property
    def data_source(self) -> str:
        return str(self.instance.get("data_source", ""))

    @property
    def instance_id(self) -> str:
        return str(self.instance.get("instance_id", self.job_id))

    @property
    def group_key(self) -> str:
        """The samples of one GRPO group share this key: the instance's ``group_id`` (the trainer's
        :class:`~raas.trainer.RolloutClient` sets it), else its data source and ``instance_id``."""
        group_id = self.instance.get("group_id")
        if isinstance(group_id, str) and group_id:
            return group_id
        return f"{self.data_source}:{self.instance_id}"
