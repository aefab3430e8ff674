"""The ledger's integrity check at open: a ledger that was emptied, damaged, replaced or lost its
write-ahead log after a crash is refused with a message naming the file and what to do; healthy ledgers
(fresh, reopened, crashed but whole, written by an older raas) open as before."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from raas.core.jobs import JobResult
from raas.errors import RaasError
from raas.pipeline.ledger import Ledger, LedgerCorrupt
from raas.pipeline.ledger_integrity import identity_path, wal_path

pytestmark = pytest.mark.unit

CRASHING_WRITER = """
import asyncio, os, signal, sys
from raas.core.jobs import JobResult
from raas.pipeline.ledger import Ledger

async def main(path: str, n: int) -> None:
    ledger = Ledger(path)
    await ledger.open()
    for i in range(n):
        await ledger.insert_job(job_id=f"j{i}", request={"instance": {"data_source": "x"}}, data_source="x",
                                instance_id=None, trajectory_id=None, priority=0, retry_on_restart=False, at=1.0)
        await ledger.finish(JobResult(job_id=f"j{i}", status="completed", reward=1.0, filter=False), 2.0)
    await ledger.flush()
    if sys.argv[3] == "delete-wal-then-kill":
        os.remove(path + "-wal")
        await ledger.finish(JobResult(job_id="j0", status="completed", reward=0.5, filter=False), 3.0)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no checkpoint: what a crash leaves

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def crash_while_writing(path: Path, n: int, how: str = "kill") -> None:
    """A real process writes ``n`` finished jobs to the ledger at ``path`` and is SIGKILLed."""
    proc = subprocess.run(
        [sys.executable, "-c", CRASHING_WRITER, str(path), str(n), how],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr


async def write_and_close(path: Path, n: int) -> None:
    ledger = Ledger(path)
    await ledger.open()
    for i in range(n):
        await ledger.insert_job(
            job_id=f"j{i}",
            request={"instance": {"data_source": "x", "text": "y" * 400}},
            data_source="x",
            instance_id=None,
            trajectory_id=None,
            priority=0,
            retry_on_restart=False,
            at=1.0,
        )
        await ledger.finish(JobResult(job_id=f"j{i}", status="completed", reward=1.0, filter=False), 2.0)
    await ledger.close()


async def job_count(path: Path) -> int:
    ledger = Ledger(path)
    await ledger.open()
    try:
        return sum((await ledger.counts()).values())
    finally:
        await ledger.close()


async def refused(path: Path) -> LedgerCorrupt:
    ledger = Ledger(path)
    with pytest.raises(LedgerCorrupt) as caught:
        await ledger.open()
    await ledger.close()
    error = caught.value
    assert isinstance(error, RaasError) and error.path == path
    assert str(path) in error.message and "Restore it from a backup" in error.message
    assert identity_path(path).name in error.message
    return error


async def test_a_fresh_ledger_gets_an_identity_that_tracks_open_and_closed(tmp_path: Path) -> None:
    path = tmp_path / "state" / "ledger.sqlite3"
    ledger = Ledger(path)
    await ledger.open()
    ident = json.loads(identity_path(path).read_text())
    assert ident["open"] is True and len(ident["ledger_id"]) == 32
    db = sqlite3.connect(path)
    assert db.execute("SELECT value FROM meta WHERE key='ledger_id'").fetchone() == (ident["ledger_id"],)
    db.close()
    await ledger.close()
    assert json.loads(identity_path(path).read_text()) == {**ident, "open": False}
    assert not wal_path(path).exists()
    assert await job_count(path) == 0  # reopens


async def test_a_ledger_truncated_to_zero_bytes_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    await write_and_close(path, 3)
    path.write_bytes(b"")
    error = await refused(path)
    assert "empty (0 bytes)" in error.message
    assert path.stat().st_size == 0  # refusing touched nothing


async def test_a_deleted_ledger_is_refused_while_its_identity_remains(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    await write_and_close(path, 1)
    path.unlink()
    assert "the file is missing" in (await refused(path)).message
    assert not path.exists()


@pytest.mark.parametrize("damage", ["page header", "whole page", "database header"])
async def test_a_damaged_page_is_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "ledger.sqlite3"
    await write_and_close(path, 200)
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) >= 20 * page
    victim = (len(data) // page // 2) * page  # a page in the middle of the jobs table
    if damage == "page header":
        data[victim : victim + 16] = b"\xff" * 16
    elif damage == "whole page":
        data[victim : victim + page] = random.Random(7).randbytes(page)
    else:
        data[0:100] = b"\x00" * 100
    path.write_bytes(bytes(data))
    error = await refused(path)
    assert "quick_check found damage" in error.message or "SQLite cannot read it" in error.message


async def test_a_crash_leaves_a_ledger_that_reopens_whole(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    crash_while_writing(path, 20)
    assert wal_path(path).exists()
    assert json.loads(identity_path(path).read_text())["open"] is True
    assert await job_count(path) == 20


async def test_a_wal_deleted_after_a_crash_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    crash_while_writing(path, 20)
    wal_path(path).unlink()
    error = await refused(path)
    assert "ledger.sqlite3-wal is missing" in error.message and "lost" in error.message


async def test_a_wal_deleted_while_running_then_a_crash_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    crash_while_writing(path, 20, how="delete-wal-then-kill")
    assert "-wal is missing" in (await refused(path)).message


async def test_a_wal_deleted_while_running_then_a_clean_close_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    ledger = Ledger(path)
    await ledger.open()
    for i in range(5):
        await ledger.insert_job(
            job_id=f"j{i}",
            request={},
            data_source="x",
            instance_id=None,
            trajectory_id=None,
            priority=0,
            retry_on_restart=False,
            at=1.0,
        )
        if i == 2:
            wal_path(path).unlink()  # the open connection keeps writing to the unlinked log
    await ledger.close()  # checkpoints what the log held into the database
    assert await job_count(path) == 5


async def test_another_ledger_put_in_its_place_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    other = tmp_path / "other" / "ledger.sqlite3"
    await write_and_close(path, 1)
    await write_and_close(other, 2)
    os.replace(other, path)
    assert "another file put in its place" in (await refused(path)).message


async def test_a_ledger_from_an_older_raas_is_adopted(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    await write_and_close(path, 4)
    db = sqlite3.connect(path)
    db.execute("DROP TABLE meta")  # as an older raas wrote it: no id, no identity file
    db.commit()
    db.close()
    identity_path(path).unlink()
    assert await job_count(path) == 4
    assert json.loads(identity_path(path).read_text())["open"] is False
    # A lost identity file is rewritten from the database's id.
    ledger_id = json.loads(identity_path(path).read_text())["ledger_id"]
    identity_path(path).unlink()
    assert await job_count(path) == 4
    assert json.loads(identity_path(path).read_text())["ledger_id"] == ledger_id


async def test_an_unreadable_identity_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    await write_and_close(path, 1)
    identity_path(path).write_text("{not json")
    assert "cannot be read" in (await refused(path)).message


def test_crash_helper_is_a_real_crash(tmp_path: Path) -> None:
    """The crash used above leaves what a SIGKILL leaves: the log, and the identity still saying open."""
    path = tmp_path / "ledger.sqlite3"
    crash_while_writing(path, 1)
    assert {p.name for p in tmp_path.iterdir()} >= {
        "ledger.sqlite3",
        "ledger.sqlite3-wal",
        "ledger.sqlite3-shm",
        identity_path(path).name,
    }
    assert asyncio.run(job_count(path)) == 1
