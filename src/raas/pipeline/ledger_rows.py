"""A row of the ledger's ``jobs`` table as Python (shared by the ledger and its recovery)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any, cast

from raas.core.jobs import TERMINAL, ErrorInfo, JobInfo, JobStatus

TERMINAL_SQL = "(" + ",".join(f"'{s}'" for s in sorted(TERMINAL)) + ")"
"""The terminal statuses as an SQL list, for ``status IN`` / ``NOT IN``."""


@dataclass
class LedgerJob:
    """One row of the ``jobs`` table."""

    job_id: str
    status: str
    data_source: str | None
    instance_id: str | None
    trajectory_id: str | None
    priority: int
    retry_on_restart: bool
    attempts: int
    request: dict[str, Any]
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    created_at: float
    updated_at: float
    finished_at: float | None

    def info(self) -> JobInfo:
        return JobInfo(
            job_id=self.job_id,
            status=cast(JobStatus, self.status),
            data_source=self.data_source,
            instance_id=self.instance_id,
            trajectory_id=self.trajectory_id,
            priority=self.priority,
            attempts=self.attempts,
            created_at=self.created_at,
            updated_at=self.updated_at,
            error=ErrorInfo(**self.error) if self.error else None,
        )


def row_of(r: tuple[Any, ...]) -> LedgerJob:
    return LedgerJob(
        job_id=r[0],
        status=r[1],
        data_source=r[2],
        instance_id=r[3],
        trajectory_id=r[4],
        priority=r[5],
        retry_on_restart=bool(r[6]),
        attempts=r[7],
        request=json.loads(r[8]),
        result=json.loads(r[9]) if r[9] else None,
        error=json.loads(r[10]) if r[10] else None,
        created_at=r[11],
        updated_at=r[12],
        finished_at=r[13],
    )


def add_transition(conn: sqlite3.Connection, job_id: str, status: str, at: float, detail: str | None) -> None:
    """One entry of a job's history (a state change, or a note such as a sandbox it opened)."""
    conn.execute(
        "INSERT INTO transitions (job_id, status, at, detail) VALUES (?,?,?,?)", (job_id, status, at, detail)
    )
