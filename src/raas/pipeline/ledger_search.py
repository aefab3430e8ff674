"""The ledger's jobs for the trajectory inspector: a filtered, paged list and single results, read through
a read-only SQLite connection of its own (the ledger is in WAL mode: these reads never wait for the writer
thread, and the writer never waits for them).

The filters use the ledger's indexes (:data:`INDEXES`, created with its schema): status, data source and
creation time are columns, a GRPO group is a range of job ids (``<group>.<trajectory>.<attempt>``), the
reward is an index on its JSON path. A weight-version or id-substring filter reads every row it considers.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

from raas.core.jobs import JobResult

INDEXES = """
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(created_at);
CREATE INDEX IF NOT EXISTS jobs_source ON jobs(data_source, created_at);
CREATE INDEX IF NOT EXISTS jobs_reward ON jobs(json_extract(result, '$.reward'));
"""
"""Part of the ledger's schema (:mod:`raas.pipeline.ledger`): what the list's filters and order use."""

_REWARD = "json_extract(result, '$.reward')"


def _like(text: str) -> str:
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def where(
    *,
    status: str | None = None,
    outcome: str | None = None,
    data_source: str | None = None,
    text: str | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    weight_version: str | None = None,
    group: str | None = None,
) -> tuple[str, list[Any]]:
    """The SQL condition (and its parameters) for a list query."""
    clauses: list[str] = []
    params: list[Any] = []
    if status:
        clauses.append("status = ?")
        params.append(status)
    # "+status" keeps SQLite off the status index where the reward index narrows far more (a completed
    # job always has a reward: one EVAL could not score ends failed)
    if outcome == "filtered":
        clauses.append("status IN ('failed', 'timeout', 'cancelled')")
    elif outcome == "resolved":
        clauses.append(f"{_REWARD} >= 1 AND +status = 'completed'")
    elif outcome == "unresolved":
        clauses.append(f"{_REWARD} < 1 AND +status = 'completed'")
    if data_source:
        clauses.append("data_source = ?")
        params.append(data_source)
    if group:
        clauses.append("job_id >= ? AND job_id < ?")  # '/' sorts right after '.'
        params += [group + ".", group + "/"]
    if text:
        clauses.append("(job_id LIKE ? ESCAPE '\\' OR instance_id LIKE ? ESCAPE '\\')")
        params += [_like(text), _like(text)]
    if min_reward is not None:
        clauses.append(f"{_REWARD} >= ?")
        params.append(min_reward)
    if max_reward is not None:
        clauses.append(f"{_REWARD} <= ?")
        params.append(max_reward)
    if weight_version:
        clauses.append("instr(result, ?) > 0")
        params.append(f'"weight_version":{json.dumps(weight_version, ensure_ascii=False)}')
    return (" AND ".join(clauses) or "1"), params


class LedgerSearch:
    """Read-only queries on the ledger at ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=5000")
        return conn

    def _page(self, cond: str, params: list[Any], offset: int, limit: int) -> dict[str, Any]:
        conn = self._connect()
        try:
            total = conn.execute(f"SELECT COUNT(*) FROM jobs WHERE {cond}", params).fetchone()[0]
            rows = conn.execute(
                "SELECT job_id, status, data_source, instance_id, trajectory_id, result, error "
                f"FROM jobs WHERE {cond} ORDER BY created_at DESC, job_id LIMIT ? OFFSET ?",
                [*params, limit, offset],
            ).fetchall()
        finally:
            conn.close()
        return {"total": total, "offset": offset, "rows": rows}

    async def page(self, offset: int, limit: int, **filters: Any) -> dict[str, Any]:
        """``{"total", "offset", "rows"}``: rows are ``(job_id, status, data_source, instance_id,
        trajectory_id, result JSON or None, error JSON or None)``, newest first."""
        cond, params = where(**filters)
        return await asyncio.to_thread(self._page, cond, params, offset, limit)

    def _get(self, job_id: str) -> tuple[JobResult | None, str | None] | None:
        conn = self._connect()
        try:
            row = conn.execute("SELECT result, data_source FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        finally:
            conn.close()
        if row is None:
            return None
        return (JobResult.model_validate_json(row[0]) if row[0] else None), row[1]

    async def get(self, job_id: str) -> tuple[JobResult | None, str | None] | None:
        """The finished job's result and data source; ``(None, source)`` while it runs; None if unknown
        (read and parsed off the event loop)."""
        return await asyncio.to_thread(self._get, job_id)

    def _history(self, job_id: str) -> list[tuple[str, float, str | None]]:
        conn = self._connect()
        try:
            rows = conn.execute(
                "SELECT status, at, detail FROM transitions WHERE job_id = ? ORDER BY seq", (job_id,)
            ).fetchall()
        finally:
            conn.close()
        return [(r[0], r[1], r[2]) for r in rows]

    async def history(self, job_id: str) -> list[tuple[str, float, str | None]]:
        """A job's transitions and notes (``status``, ``at``, ``detail``) in the order they were written."""
        return await asyncio.to_thread(self._history, job_id)
