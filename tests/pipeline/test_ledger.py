"""The SQLite ledger on its own: durability, recovery after a crash, retention."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from raas.core.jobs import ErrorInfo, JobResult
from raas.errors import RaasError
from raas.pipeline.ledger import Ledger

pytestmark = pytest.mark.unit


async def _insert(ledger: Ledger, job_id: str, *, retry: bool = False, at: float = 100.0) -> None:
    existing = await ledger.insert_job(
        job_id=job_id,
        request={"instance": {"data_source": "x"}},
        data_source="x",
        instance_id=f"i-{job_id}",
        trajectory_id=None,
        priority=0,
        retry_on_restart=retry,
        at=at,
    )
    assert existing is None


async def test_accepted_job_is_committed_and_visible_to_another_connection(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.db")
    await ledger.open()
    await _insert(ledger, "a")
    other = sqlite3.connect(tmp_path / "l.db")
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert other.execute("SELECT status FROM jobs WHERE job_id='a'").fetchone() == ("queued",)
    ledger.transition("a", "init", 101.0)
    await ledger.flush()
    assert other.execute("SELECT status FROM jobs WHERE job_id='a'").fetchone() == ("init",)
    other.close()
    again = await ledger.insert_job(
        job_id="a",
        request={},
        data_source="y",
        instance_id=None,
        trajectory_id=None,
        priority=0,
        retry_on_restart=False,
        at=1.0,
    )
    assert again is not None and again.status == "init" and again.data_source == "x"
    await ledger.close()


async def test_results_survive_reopen(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.db")
    await ledger.open()
    await _insert(ledger, "a")
    await ledger.finish(JobResult(job_id="a", status="completed", reward=1.0, filter=False), 105.0)
    await ledger.close()
    reopened = Ledger(tmp_path / "l.db")
    await reopened.open()
    row = await reopened.get("a")
    assert (
        row is not None
        and row.status == "completed"
        and row.result is not None
        and row.result["reward"] == 1.0
    )
    assert [s for s, _, _ in await reopened.transitions("a")] == ["queued", "completed"]
    recovery = await reopened.recover(max_attempts=3)
    assert recovery.requeued == [] and recovery.interrupted == []
    await reopened.close()


async def test_recover_interrupts_or_requeues_in_flight_jobs(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.db")
    await ledger.open()
    for job_id, status in (("q", "queued"), ("r", "run"), ("e", "queued_eval")):
        await _insert(ledger, job_id)
        if status != "queued":
            ledger.transition(job_id, status, 101.0)
    await _insert(ledger, "again", retry=True)
    ledger.transition("again", "eval", 101.0)
    await ledger.close()  # the service "died" here

    ledger = Ledger(tmp_path / "l.db")
    await ledger.open()
    recovery = await ledger.recover(max_attempts=2, now=200.0)
    assert sorted(recovery.interrupted) == ["e", "q", "r"]
    assert [j.job_id for j in recovery.requeued] == ["again"] and recovery.requeued[0].attempts == 2
    stages = {}
    for job_id in ("q", "r", "e"):
        row = await ledger.get(job_id)
        assert row is not None and row.status == "failed" and row.result is not None
        assert row.result["reward"] is None and row.result["filter"] is True
        assert row.result["error"]["kind"] == "interrupted"
        assert row.result["timing"]["total_s"] == 100.0
        stages[job_id] = row.result["error"]["stage"]
    assert stages == {"q": "queue", "r": "run", "e": "queue"}
    # A second crash: the retried job has used its attempts and is now closed as interrupted too.
    recovery = await ledger.recover(max_attempts=2, now=300.0)
    assert recovery.interrupted == ["again"] and recovery.requeued == []
    row = await ledger.get("again")
    assert (
        row is not None
        and row.status == "failed"
        and "gave up after 2 attempts" in row.result["error"]["message"]
    )  # type: ignore[index]
    await ledger.close()


async def test_retention_ttl_and_size_keep_unfinished_jobs(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.db", result_ttl_s=50.0, max_results=2)
    await ledger.open()
    for i in range(5):
        await _insert(ledger, f"done{i}", at=float(i))
        await ledger.finish(
            JobResult(job_id=f"done{i}", status="failed", error=ErrorInfo(kind="handler_error", message="x")),
            100.0 + i * 10,
        )
    await _insert(ledger, "running", at=0.0)
    removed = await ledger.prune(now=175.0)  # TTL drops finished_at < 125 (done0..done2); size keeps 2
    assert removed == 3
    counts = await ledger.counts()
    assert counts == {"failed": 2, "queued": 1}
    assert await ledger.get("done4") is not None and await ledger.get("done0") is None
    assert await ledger.transitions("done0") == []
    assert await ledger.prune(now=10_000.0) == 2
    assert await ledger.counts() == {"queued": 1}
    await ledger.close()


async def test_unusable_path_is_a_typed_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    ledger = Ledger(blocker / "l.db")
    with pytest.raises(RaasError):
        await ledger.open()


async def test_closed_ledger_refuses_writes(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.db")
    await ledger.open()
    await ledger.close()
    with pytest.raises(RaasError):
        await ledger.get("a")


async def test_a_failed_write_is_typed_and_the_writer_lives_on(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.db")
    await ledger.open()
    with pytest.raises(RaasError) as e:
        await ledger._call(lambda conn: conn.execute("INSERT INTO no_such_table VALUES (1)"))
    assert e.value.kind == "internal" and "no_such_table" in e.value.message
    await _insert(ledger, "after")  # same writer thread, still serving
    assert (await ledger.get("after")) is not None and ledger.running
    await ledger.close()
    assert not ledger.running
