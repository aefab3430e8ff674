"""What a restart does with the jobs a previous run of the service left unfinished (one ledger transaction).

Why per stage: a job that has generated nothing yet (queued, in INIT, waiting for RUN) loses nothing by
running again, so it goes back to the queue in its place (``created_at`` order) with its priority; a job
whose RUN output was committed (a stage checkpoint: :meth:`~raas.pipeline.ledger.Ledger.checkpoint`)
resumes at EVAL and never generates again; a job inside RUN goes by its data source's ``resume`` policy:
``replay`` re-queues it with its committed turns (:mod:`raas.pipeline.turns`), ``restart`` runs it again
from INIT (an attempt, as ``retry_on_restart`` asks for any data source), ``fail`` ends it
``failed``/``interrupted`` (filtered, no reward). A request with ``resume_on_restart: false`` keeps the old
all-or-nothing behaviour, and an external rollout resumes only once closed (its agent is gone with the old
process).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from raas.core.jobs import ErrorInfo, JobResult, Timing
from raas.pipeline.ledger_rows import TERMINAL_SQL, LedgerJob, add_transition, row_of
from raas.pipeline.turns import TURN_STAGE, committed_turns

CANCEL_REQUESTED = "cancel_requested"
"""A job's history entry: someone asked to stop it (committed before the cancel is answered)."""

NOT_STARTED = ("queued", "init", "queued_run")
"""States in which a job has generated nothing: running it again from INIT loses nothing."""

_STAGE_OF_STATUS = {
    "queued": "queue",
    "queued_run": "queue",
    "queued_eval": "queue",
    "init": "init",
    "run": "run",
    "eval": "eval",
}


@dataclass
class Resumed:
    """A job that goes on with what it committed: at EVAL with its RUN output (``checkpoint`` is that
    stage checkpoint's body), or from INIT replaying RUN's committed turns (``{"turns": [...]}``)."""

    job: LedgerJob
    checkpoint: dict[str, Any]


@dataclass
class Recovery:
    """What :meth:`Ledger.recover` did: jobs to run again from INIT, jobs to resume at EVAL, jobs closed as
    interrupted."""

    requeued: list[LedgerJob] = field(default_factory=list)
    resumed: list[Resumed] = field(default_factory=list)
    replayed: list[Resumed] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    """Jobs whose cancel was acknowledged before the restart: ended ``cancelled``."""


def _mark(conn: sqlite3.Connection, job: LedgerJob, status: str, at: float, detail: str) -> None:
    conn.execute(
        "UPDATE jobs SET status=?, attempts=?, updated_at=? WHERE job_id=?",
        (status, job.attempts, at, job.job_id),
    )
    add_transition(conn, job.job_id, status, at, detail)
    job.status = status


def recover(
    conn: sqlite3.Connection,
    *,
    max_attempts: int,
    at: float,
    resume_in_run: Callable[[str | None], str] | None = None,
) -> Recovery:
    """Decide, and record, what becomes of every unfinished job (see the module docstring)."""
    rows = [
        row_of(r)
        for r in conn.execute(f"SELECT * FROM jobs WHERE status NOT IN {TERMINAL_SQL} ORDER BY created_at")
    ]
    checkpoints = {
        job_id: body
        for job_id, body in conn.execute(
            f"SELECT c.job_id, c.body FROM checkpoints c JOIN jobs j ON j.job_id = c.job_id "
            f"WHERE c.stage = 'run' AND j.status NOT IN {TERMINAL_SQL}"
        )
    }
    cancelled = {
        job_id
        for (job_id,) in conn.execute(
            f"SELECT DISTINCT t.job_id FROM transitions t JOIN jobs j ON j.job_id = t.job_id "
            f"WHERE t.status = '{CANCEL_REQUESTED}' AND j.status NOT IN {TERMINAL_SQL}"
        )
    }
    out = Recovery()
    for job in rows:
        if job.job_id in cancelled:  # its cancel was acknowledged: it stays cancelled
            _close(
                conn, job, at, "cancelled", "cancelled", "cancelled; the service restarted before it stopped"
            )
            out.cancelled.append(job.job_id)
            continue
        checkpoint = _parsed(checkpoints.get(job.job_id))
        how = plan(
            job.status,
            job.request,
            checkpointed=checkpoint is not None,
            retry_on_restart=job.retry_on_restart,
            attempts=job.attempts,
            max_attempts=max_attempts,
            resume_in_run=resume_in_run,
            data_source=job.data_source,
        )
        if how == "eval" and checkpoint is not None:
            _mark(
                conn, job, "queued_eval", at, "resumed at EVAL after a restart: its RUN output was committed"
            )
            out.resumed.append(Resumed(job, checkpoint))
        elif how == "init" and not (turns := _turns(conn, job.job_id)):
            _mark(
                conn, job, "queued", at, f"re-queued after a restart in {job.status}: nothing generated yet"
            )
            out.requeued.append(job)
        elif how == "init":  # restarted before it got back to its committed turns
            _mark(
                conn, job, "queued", at, f"re-queued after a restart to replay {len(turns)} committed turns"
            )
            out.replayed.append(Resumed(job, {"turns": turns}))
        elif how == "replay":
            turns = _turns(conn, job.job_id)
            job.attempts += 1
            _mark(
                conn,
                job,
                "queued",
                at,
                f"re-queued after a restart in RUN to replay {len(turns)} committed turns",
            )
            out.replayed.append(Resumed(job, {"turns": turns}))
        elif how == "restart":
            job.attempts += 1
            _mark(conn, job, "queued", at, f"re-queued after restart (attempt {job.attempts})")
            # it generates anew: its old turns are no longer its history
            conn.execute(
                "DELETE FROM checkpoints WHERE job_id=? AND stage LIKE ?", (job.job_id, TURN_STAGE + "%")
            )
            out.requeued.append(job)
        else:
            _interrupt(conn, job, at, external=job.request.get("external_rollout", False) is True)
            out.interrupted.append(job.job_id)
    return out


def plan(
    status: str,
    request: dict[str, Any],
    *,
    checkpointed: bool,
    retry_on_restart: bool,
    attempts: int,
    max_attempts: int,
    resume_in_run: Callable[[str | None], str] | None,
    data_source: str | None,
) -> str:
    """What the next start does with an unfinished job (see the module docstring): ``eval`` (resume with
    its committed RUN output), ``init`` (run again from INIT, replaying committed turns if it has any),
    ``replay`` / ``restart`` (inside RUN, an attempt) or ``fail``. Shared by a crash's recovery and a
    graceful shutdown, which leaves for the next start exactly what this says it can go on with."""
    external = request.get("external_rollout", False) is True
    resume = request.get("resume_on_restart", True) is not False and not (external and not checkpointed)
    if resume and checkpointed:
        return "eval"
    if resume and status in NOT_STARTED:
        return "init"
    in_run = "fail"
    if resume and status == "run" and resume_in_run is not None:
        in_run = resume_in_run(data_source)
    if attempts >= max_attempts:
        return "fail"
    if in_run == "replay":
        return "replay"
    if (in_run == "restart" or retry_on_restart) and (resume or not external):
        return "restart"
    return "fail"


def _turns(conn: sqlite3.Connection, job_id: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT stage, body FROM checkpoints WHERE job_id=? AND stage LIKE ?", (job_id, TURN_STAGE + "%")
    ).fetchall()
    return committed_turns(rows)


def _parsed(body: str | None) -> dict[str, Any] | None:
    if body is None:
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _interrupt(conn: sqlite3.Connection, job: LedgerJob, at: float, *, external: bool) -> None:
    reason = "the service stopped while the job was in flight"
    if external:
        reason += "; an external rollout's agent does not survive a restart unless it had closed"
    elif job.retry_on_restart:
        reason += f"; gave up after {job.attempts} attempts"
    _close(conn, job, at, "failed", "interrupted", reason)


def _close(conn: sqlite3.Connection, job: LedgerJob, at: float, status: str, kind: str, reason: str) -> None:
    """End ``job`` with a typed, filtered result and no reward."""
    result = JobResult(
        job_id=job.job_id,
        instance_id=job.instance_id,
        trajectory_id=job.trajectory_id,
        status=status,
        error=ErrorInfo(
            stage=_STAGE_OF_STATUS.get(job.status, "queue"),
            kind=kind,
            message=f"{reason} (last state {job.status})",
        ),
        filter=True,
        timing=Timing(total_s=max(0.0, at - job.created_at)),
    )
    error = result.error.model_dump_json() if result.error else None
    conn.execute(
        "UPDATE jobs SET status=?, result=?, error=?, updated_at=?, finished_at=? WHERE job_id=?",
        (status, result.model_dump_json(), error, at, at, job.job_id),
    )
    add_transition(conn, job.job_id, status, at, error)
    conn.execute("DELETE FROM checkpoints WHERE job_id=?", (job.job_id,))
