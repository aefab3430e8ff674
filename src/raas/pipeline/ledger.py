"""The durable ledger: every accepted job, every state transition and every result, in SQLite (WAL).

Why a ledger: a trainer must never lose an accepted job silently. The service writes a job here before it
answers 202, writes each transition as it happens and writes the result before it reports the job done.
After a crash, :meth:`Ledger.recover` re-queues what had generated nothing yet, resumes at EVAL what had
committed its RUN output (:meth:`Ledger.checkpoint`), replays RUN's committed turns
(:meth:`Ledger.checkpoint_turn`) where the task's policy says so, and turns the rest into
``failed``/``interrupted`` results (see :mod:`raas.pipeline.ledger_recovery`).

All SQLite work runs on one writer thread with one connection; consecutive operations are grouped into one
transaction (group commit), so the event loop never blocks on disk and thousands of transitions per second
cost a few commits. WAL with ``synchronous=NORMAL`` survives a killed process (not a power cut).

At open the ledger checks its integrity and refuses (:class:`LedgerCorrupt`) a file that is damaged, was
emptied or replaced, or lost its write-ahead log after a crash: see :mod:`raas.pipeline.ledger_integrity`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from raas.core.jobs import JobResult
from raas.errors import RaasError
from raas.pipeline import ledger_integrity as integrity
from raas.pipeline import ledger_recovery
from raas.pipeline.ledger_integrity import LedgerCorrupt
from raas.pipeline.ledger_recovery import CANCEL_REQUESTED, Recovery
from raas.pipeline.ledger_rows import TERMINAL_SQL, LedgerJob, add_transition, row_of
from raas.pipeline.ledger_search import INDEXES

__all__ = ["Ledger", "LedgerCorrupt", "LedgerJob", "Recovery"]

T = TypeVar("T")
log = logging.getLogger("raas.ledger")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    data_source TEXT,
    instance_id TEXT,
    trajectory_id TEXT,
    priority INTEGER NOT NULL DEFAULT 0,
    retry_on_restart INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 1,
    request TEXT NOT NULL,
    result TEXT,
    error TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    finished_at REAL
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status);
CREATE INDEX IF NOT EXISTS jobs_finished ON jobs(finished_at);
CREATE TABLE IF NOT EXISTS transitions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    status TEXT NOT NULL,
    at REAL NOT NULL,
    detail TEXT
);
CREATE INDEX IF NOT EXISTS transitions_job ON transitions(job_id);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT NOT NULL,
    stage TEXT NOT NULL,
    body TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (job_id, stage)
);
"""

TRANSITION_DELAY_S = 0.005
"""How long a fire-and-forget transition may wait for company before it is handed to the writer."""


class _Stop:
    pass


_Op = tuple[Callable[[sqlite3.Connection], Any], "asyncio.Future[Any] | None"]


def _resolve(outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    """Runs on the event loop: hand each committed operation's outcome to whoever awaits it."""
    for fut, value, exc in outcomes:
        if fut.done():
            continue
        if exc is None:
            fut.set_result(value)
        else:
            fut.set_exception(exc)


_STOP = _Stop()


class Ledger:
    """SQLite ledger with a single writer thread; see the module docstring."""

    def __init__(
        self, path: str | Path, *, result_ttl_s: float | None = None, max_results: int | None = None
    ) -> None:
        self.path = Path(path)
        self.result_ttl_s = result_ttl_s
        self.max_results = max_results
        # Operations queued by the event loop during one loop iteration travel to the writer as one batch
        # (one cross-thread wake-up), and one callback per committed batch resolves the waiting futures.
        self._ops: queue.SimpleQueue[list[_Op] | _Stop] = queue.SimpleQueue()
        self._pending: list[_Op] = []
        self._flush_handle: asyncio.Handle | None = None
        self._flush_soon = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def open(self) -> None:
        if self._thread is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RaasError(
                f"cannot create the ledger directory {self.path.parent}: {exc}", kind="internal"
            ) from exc
        self._loop = asyncio.get_running_loop()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._writer, args=(ready,), name="raas-ledger", daemon=True)
        self._thread.start()
        await asyncio.wrap_future(ready)

    @property
    def running(self) -> bool:
        """True while the writer thread is alive (leak checks)."""
        return self._thread is not None and self._thread.is_alive()

    async def close(self) -> None:
        """Flush every queued write, then close the connection and join the writer thread."""
        if self._thread is None or self._closed:
            return
        self._closed = True
        self._flush()
        self._ops.put(_STOP)
        # The writer says when it is done (no pool thread spent waiting on a join); then the join is
        # only the thread's last instructions.
        await asyncio.wrap_future(self._stopped)
        self._thread.join()

    def _connect(self) -> tuple[sqlite3.Connection, str]:
        """Open the database after the integrity checks of :mod:`raas.pipeline.ledger_integrity`; mark the
        ledger open in its identity file. Returns the connection and the ledger's id."""
        identity = integrity.check_files(self.path)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=True)
        try:
            integrity.quick_check(conn, self.path)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=5000")
            conn.executescript(_SCHEMA)
            conn.executescript(INDEXES)  # the inspector's list (raas.pipeline.ledger_search)
            ledger_id = integrity.settle_identity(conn, self.path, identity)
            integrity.write_identity(self.path, ledger_id, open_=True)
        except BaseException:
            conn.close()
            raise
        return conn, ledger_id

    def _disconnect(self, conn: sqlite3.Connection, ledger_id: str) -> None:
        """Fold the write-ahead log into the database, then mark the ledger closed (only once nothing
        lives in the log alone), then close."""
        try:
            busy = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            if not busy:
                integrity.write_identity(self.path, ledger_id, open_=False)
        except Exception as exc:  # still close; the next start sees the ledger as not closed cleanly
            log.warning("could not checkpoint the ledger %s on close: %s", self.path, exc)
        finally:
            conn.close()

    def _writer(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            self._write_until_stopped(ready)
        finally:
            self._stopped.set_result(None)

    def _write_until_stopped(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            conn, ledger_id = self._connect()
        except RaasError as exc:
            ready.set_exception(exc)
            return
        except Exception as exc:  # an unusable path must surface as a typed error, not a dead thread
            ready.set_exception(RaasError(f"cannot open ledger {self.path}: {exc}", kind="internal"))
            return
        ready.set_result(None)
        stop = False
        try:
            while not stop:
                items = [self._ops.get()]
                while True:
                    try:
                        items.append(self._ops.get_nowait())
                    except queue.Empty:
                        break
                work: list[_Op] = []
                for item in items:
                    if isinstance(item, _Stop):
                        stop = True
                    else:
                        work.extend(item)
                if work:
                    self._commit(conn, work)
        finally:
            self._disconnect(conn, ledger_id)

    def _commit(self, conn: sqlite3.Connection, work: list[_Op]) -> None:
        """Run one batch in one transaction. Never raises: a failure is handed to whoever waits, as a
        typed error, and the writer thread lives on (a dead writer would leave every caller hanging)."""
        outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        try:
            conn.execute("BEGIN")
            for fn, fut in work:
                try:
                    value, exc = fn(conn), None
                except Exception as e:
                    value, exc = None, _typed(e)
                if fut is not None:
                    outcomes.append((fut, value, exc))
            conn.execute("COMMIT")
        except Exception as e:
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            error = _typed(e)
            outcomes = [(fut, None, error) for _, fut in work if fut is not None]
        if outcomes and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting any more
                self._loop.call_soon_threadsafe(_resolve, outcomes)

    def _submit(self, fn: Callable[[sqlite3.Connection], T], *, wait: bool) -> asyncio.Future[T] | None:
        if self._thread is None or self._closed or self._loop is None:
            raise RaasError("the ledger is closed", kind="internal")
        fut: asyncio.Future[T] | None = self._loop.create_future() if wait else None
        self._pending.append((fn, fut))
        if wait:
            # Someone awaits this: hand the batch over at the end of this loop iteration.
            if self._flush_handle is not None and not self._flush_soon:
                self._flush_handle.cancel()
                self._flush_handle = None
            if self._flush_handle is None:
                self._flush_handle = self._loop.call_soon(self._flush)
                self._flush_soon = True
        elif self._flush_handle is None:
            # Fire-and-forget transitions may wait a few milliseconds to share a batch.
            self._flush_handle = self._loop.call_later(TRANSITION_DELAY_S, self._flush)
            self._flush_soon = False
        return fut

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        self._flush_handle = None
        batch, self._pending = self._pending, []
        if batch:
            self._ops.put(batch)

    async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        fut = self._submit(fn, wait=True)
        assert fut is not None
        return await fut

    # -- writes ------------------------------------------------------------------------------------------

    async def insert_job(
        self,
        *,
        job_id: str,
        request: dict[str, Any],
        data_source: str | None,
        instance_id: str | None,
        trajectory_id: str | None,
        priority: int,
        retry_on_restart: bool,
        at: float,
    ) -> LedgerJob | None:
        """Record an accepted job (committed when this returns). Returns the existing row if the id is taken."""
        body = json.dumps(request)

        def op(conn: sqlite3.Connection) -> LedgerJob | None:
            existing = _fetch(conn, job_id)
            if existing is not None:
                return existing
            conn.execute(
                "INSERT INTO jobs (job_id, status, data_source, instance_id, trajectory_id, priority,"
                " retry_on_restart, attempts, request, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (
                    job_id,
                    "queued",
                    data_source,
                    instance_id,
                    trajectory_id,
                    priority,
                    int(retry_on_restart),
                    1,
                    body,
                    at,
                    at,
                ),
            )
            add_transition(conn, job_id, "queued", at, None)
            return None

        return await self._call(op)

    def transition(self, job_id: str, status: str, at: float, detail: str | None = None) -> None:
        """Record a non-terminal state change. Fire-and-forget: ordered with every later write."""

        def op(conn: sqlite3.Connection) -> None:
            conn.execute("UPDATE jobs SET status=?, updated_at=? WHERE job_id=?", (status, at, job_id))
            add_transition(conn, job_id, status, at, detail)

        self._submit(op, wait=False)

    def note(self, job_id: str, kind: str, at: float, detail: str | None = None) -> None:
        """Add ``kind`` to a job's history without changing its state (e.g. a sandbox it opened).
        Fire-and-forget, like :meth:`transition`."""

        def op(conn: sqlite3.Connection) -> None:
            add_transition(conn, job_id, kind, at, detail)

        self._submit(op, wait=False)

    async def request_cancel(self, job_id: str, at: float) -> None:
        """Commit that ``job_id`` was asked to stop (returns once on disk): a restart before its
        ``cancelled`` result is written still ends it cancelled instead of resuming it."""

        def op(conn: sqlite3.Connection) -> None:
            add_transition(conn, job_id, CANCEL_REQUESTED, at, None)

        await self._call(op)

    async def finish(self, result: JobResult, at: float) -> None:
        """Record a terminal result (committed when this returns)."""
        body = result.model_dump_json()
        error = result.error.model_dump_json() if result.error else None

        def op(conn: sqlite3.Connection) -> None:
            conn.execute(
                "UPDATE jobs SET status=?, result=?, error=?, updated_at=?, finished_at=? WHERE job_id=?",
                (result.status, body, error, at, at, result.job_id),
            )
            conn.execute("DELETE FROM checkpoints WHERE job_id=?", (result.job_id,))
            add_transition(conn, result.job_id, result.status, at, error)

        await self._call(op)

    async def flush(self) -> None:
        """Wait until every write queued so far is committed."""
        await self._call(lambda conn: None)

    # -- reads -------------------------------------------------------------------------------------------

    async def get(self, job_id: str) -> LedgerJob | None:
        return await self._call(lambda conn: _fetch(conn, job_id))

    async def transitions(self, job_id: str) -> list[tuple[str, float, str | None]]:
        def op(conn: sqlite3.Connection) -> list[tuple[str, float, str | None]]:
            rows = conn.execute(
                "SELECT status, at, detail FROM transitions WHERE job_id=? ORDER BY seq", (job_id,)
            ).fetchall()
            return [(r[0], r[1], r[2]) for r in rows]

        return await self._call(op)

    async def counts(self) -> dict[str, int]:
        def op(conn: sqlite3.Connection) -> dict[str, int]:
            return {r[0]: r[1] for r in conn.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status")}

        return await self._call(op)

    async def unfinished(self) -> list[LedgerJob]:
        def op(conn: sqlite3.Connection) -> list[LedgerJob]:
            rows = conn.execute(
                f"SELECT * FROM jobs WHERE status NOT IN {TERMINAL_SQL} ORDER BY created_at"
            ).fetchall()
            return [row_of(r) for r in rows]

        return await self._call(op)

    # -- recovery and retention --------------------------------------------------------------------------

    async def recover(
        self,
        *,
        max_attempts: int,
        now: float | None = None,
        resume_in_run: Callable[[str | None], str] | None = None,
    ) -> Recovery:
        """Re-queue, resume (at EVAL, or by replaying RUN's committed turns) or close as interrupted every
        job a previous run left unfinished (:mod:`raas.pipeline.ledger_recovery`); ``resume_in_run`` gives
        a data source's choice for a job inside RUN (default ``fail``). Nothing is dropped silently."""
        at = time.time() if now is None else now
        return await self._call(
            lambda conn: ledger_recovery.recover(
                conn, max_attempts=max_attempts, at=at, resume_in_run=resume_in_run
            )
        )

    async def checkpoint(self, job_id: str, stage: str, body: str, at: float) -> None:
        """Commit a stage's output (``run``: what EVAL needs to grade the job without generating again);
        returns once it is on disk. Dropped when the job ends."""

        def op(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT OR REPLACE INTO checkpoints (job_id, stage, body, at) VALUES (?,?,?,?)",
                (job_id, stage, body, at),
            )
            add_transition(conn, job_id, "checkpoint", at, f"{stage} output committed ({len(body)} bytes)")

        await self._call(op)

    def checkpoint_turn(self, job_id: str, stage: str, body: str, at: float) -> None:
        """Add one turn checkpoint (:mod:`raas.pipeline.turns`). Fire-and-forget, ordered with every other
        write and committed with its group: a crash loses at most the newest turns."""

        def op(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT OR REPLACE INTO checkpoints (job_id, stage, body, at) VALUES (?,?,?,?)",
                (job_id, stage, body, at),
            )

        self._submit(op, wait=False)

    async def checkpoint_of(self, job_id: str, stage: str) -> str | None:
        def op(conn: sqlite3.Connection) -> str | None:
            r = conn.execute(
                "SELECT body FROM checkpoints WHERE job_id=? AND stage=?", (job_id, stage)
            ).fetchone()
            return r[0] if r else None

        return await self._call(op)

    async def prune(self, now: float | None = None) -> int:
        """Drop finished jobs past the TTL and the oldest beyond ``max_results``. Unfinished jobs are kept."""
        at = time.time() if now is None else now
        ttl, cap = self.result_ttl_s, self.max_results

        def op(conn: sqlite3.Connection) -> int:
            doomed: list[str] = []
            if ttl is not None:
                doomed += [
                    r[0]
                    for r in conn.execute(
                        f"SELECT job_id FROM jobs WHERE status IN {TERMINAL_SQL} AND finished_at < ?",
                        (at - ttl,),
                    )
                ]
            if cap is not None:
                doomed += [
                    r[0]
                    for r in conn.execute(
                        f"SELECT job_id FROM jobs WHERE status IN {TERMINAL_SQL}"
                        " ORDER BY finished_at DESC LIMIT -1 OFFSET ?",
                        (cap,),
                    )
                ]
            unique = sorted(set(doomed))
            for i in range(0, len(unique), 500):
                chunk = unique[i : i + 500]
                marks = ",".join("?" * len(chunk))
                conn.execute(f"DELETE FROM jobs WHERE job_id IN ({marks})", chunk)
                conn.execute(f"DELETE FROM transitions WHERE job_id IN ({marks})", chunk)
                conn.execute(f"DELETE FROM checkpoints WHERE job_id IN ({marks})", chunk)
            return len(unique)

        return await self._call(op)


def _typed(exc: BaseException) -> BaseException:
    if isinstance(exc, RaasError):
        return exc
    return RaasError(f"ledger write failed: {type(exc).__name__}: {exc}", kind="internal")


def _fetch(conn: sqlite3.Connection, job_id: str) -> LedgerJob | None:
    r = conn.execute("SELECT * FROM jobs WHERE job_id=?", (job_id,)).fetchone()
    return row_of(r) if r else None
