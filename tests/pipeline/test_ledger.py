"""The SQLite ledger on its own: durability, recovery after a crash, retention."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from raas.core.jobs import ErrorInfo, JobResult
from raas.errors import RaasError
from raas.pipeline.ledger import Ledger

pytestmark = pytest.mark.unit


async def _insert(
    ledger: Ledger, job_id: str, *, retry: bool = False, at: float = 100.0, source: str = "x", **request: Any
) -> None:
    existing = await ledger.insert_job(
        job_id=job_id,
        request={"instance": {"data_source": source}, **request},
        data_source=source,
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


async def test_recover_requeues_resumes_or_interrupts_each_job_by_what_it_had_done(tmp_path: Path) -> None:
    """After a crash: nothing generated yet → queued again (same attempt, same order); RUN output
    committed → resumed at EVAL with it; inside RUN without a checkpoint → interrupted, unless it asked
    for ``retry_on_restart``; ``resume_on_restart: false`` → interrupted wherever it was; an external
    rollout → resumed only once closed (committed)."""
    ledger = Ledger(tmp_path / "l.db")
    await ledger.open()
    at = 100.0
    cases = {
        "q": ("queued", {}),
        "i": ("init", {}),
        "w": ("queued_run", {}),
        "r": ("run", {}),
        "e": ("queued_eval", {}),
        "c": ("eval", {}),
        "optout": ("queued", {"resume_on_restart": False}),
        "optout-c": ("eval", {"resume_on_restart": False}),
        "ext-q": ("queued", {"external_rollout": True}),
        "ext-c": ("run", {"external_rollout": True}),
    }
    for job_id, (status, request) in cases.items():
        at += 1
        await _insert(ledger, job_id, at=at, **request)
        if status != "queued":
            ledger.transition(job_id, status, at)
    for job_id in ("c", "optout-c", "ext-c"):
        await ledger.checkpoint(job_id, "run", json.dumps({"run_output": {"answer": job_id}}), 150.0)
    await _insert(ledger, "again", retry=True, at=at + 1)
    ledger.transition("again", "run", 150.0)
    await _insert(ledger, "stop-me", at=at + 2)
    ledger.transition("stop-me", "run", 150.0)
    await ledger.request_cancel("stop-me", 151.0)  # acknowledged, then the crash before it stopped
    await ledger.close()  # the service "died" here

    ledger = Ledger(tmp_path / "l.db")
    await ledger.open()
    recovery = await ledger.recover(max_attempts=2, now=200.0)
    assert [j.job_id for j in recovery.requeued] == ["q", "i", "w", "again"]  # in their old order
    assert [j.attempts for j in recovery.requeued] == [1, 1, 1, 2]
    assert [(r.job.job_id, r.checkpoint["run_output"]["answer"]) for r in recovery.resumed] == [
        ("c", "c"),
        ("ext-c", "ext-c"),
    ]
    assert sorted(recovery.interrupted) == ["e", "ext-q", "optout", "optout-c", "r"]
    assert recovery.cancelled == ["stop-me"]
    stopped = await ledger.get("stop-me")
    assert stopped is not None and stopped.status == "cancelled" and stopped.result["reward"] is None  # type: ignore[index]
    for job_id in ("q", "i", "w"):
        row = await ledger.get(job_id)
        assert row is not None and row.status == "queued"
        assert "nothing generated yet" in ((await ledger.transitions(job_id))[-1][2] or "")
    assert (await ledger.get("c")).status == "queued_eval"  # type: ignore[union-attr]
    stages = {}
    for job_id in recovery.interrupted:
        row = await ledger.get(job_id)
        assert row is not None and row.status == "failed" and row.result is not None
        assert row.result["reward"] is None and row.result["filter"] is True
        assert row.result["error"]["kind"] == "interrupted"
        stages[job_id] = row.result["error"]["stage"]
    assert stages == {"e": "queue", "ext-q": "queue", "optout": "queue", "optout-c": "eval", "r": "run"}
    assert "external rollout" in (await ledger.get("ext-q")).result["error"]["message"]  # type: ignore[union-attr,index]
    # an interrupted job's checkpoint is gone with it; a resumed one's stays until the job ends
    assert await ledger.checkpoint_of("optout-c", "run") is None
    assert await ledger.checkpoint_of("c", "run") is not None
    await ledger.finish(JobResult(job_id="c", status="completed", reward=1.0, filter=False), 210.0)
    assert await ledger.checkpoint_of("c", "run") is None
    # A second crash while the retried job was in RUN again: it has used its attempts.
    ledger.transition("again", "run", 250.0)
    recovery = await ledger.recover(max_attempts=2, now=300.0)
    assert "again" in recovery.interrupted
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


async def test_recover_replays_run_jobs_by_their_policy_and_keeps_turns_across_a_second_crash(
    tmp_path: Path,
) -> None:
    """A job inside RUN with committed turns is re-queued to replay them when its data source's policy
    says ``replay`` (an attempt), restarted or failed otherwise; a replaying job that crashes again before
    it got back to RUN still replays them (the same attempt)."""
    from raas.pipeline.turns import turn_stage

    ledger = Ledger(tmp_path / "l.db")
    await ledger.open()
    for job_id in ("replay", "restart", "fail"):
        await _insert(ledger, job_id, source=job_id)  # each its own data source, with that policy
        ledger.transition(job_id, "run", 101.0)
        for k in range(2):
            ledger.checkpoint_turn(job_id, turn_stage(k), json.dumps({"base": 0, "delta": [k]}), 102.0)
    await ledger.close()

    ledger = Ledger(tmp_path / "l.db")
    await ledger.open()
    recovery = await ledger.recover(max_attempts=3, now=200.0, resume_in_run=lambda ds: str(ds))
    assert [(r.job.job_id, [t["delta"] for t in r.checkpoint["turns"]]) for r in recovery.replayed] == [
        ("replay", [[0], [1]])
    ]
    assert [j.job_id for j in recovery.requeued] == ["restart"] and recovery.interrupted == ["fail"]
    assert recovery.replayed[0].job.attempts == 2
    # crashed again while replaying, before RUN: its turns are still there and still replayed
    ledger.transition("replay", "init", 210.0)
    again = await ledger.recover(max_attempts=3, now=300.0, resume_in_run=lambda ds: str(ds))
    assert [(r.job.job_id, len(r.checkpoint["turns"]), r.job.attempts) for r in again.replayed] == [
        ("replay", 2, 2)
    ]
    await ledger.close()
