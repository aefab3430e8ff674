"""The ledger's integrity check at start: refuse to run on a ledger that lost or garbled what it held.

SQLite alone cannot tell "a new, empty ledger" from "a ledger truncated to 0 bytes", nor notice that the
write-ahead log holding the last commits was deleted after a crash: it would open either and the service
would answer 404 for every job it had accepted. So next to the ledger lives a small identity file
(``<ledger>.identity.json``, replaced atomically) that records the ledger's id — also stored inside the
database — and whether the ledger is open. At start:

* identity file present, database missing or empty → refuse: results existed;
* identity says "open" (the last run did not close the ledger) and the ``-wal`` file is gone → refuse:
  commits that were only in the log are lost;
* ``PRAGMA quick_check`` reports damage (or SQLite cannot read the file at all) → refuse;
* the database's id differs from the identity's → refuse: another ledger was put in its place.

A refusal is a :class:`LedgerCorrupt` naming the file, what is wrong and what to do. A ledger written by
an older raas (no id yet) is adopted; a lost identity file is rewritten from the database.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import uuid
from pathlib import Path
from typing import Any

from raas.errors import RaasError

IDENTITY_SUFFIX = ".identity.json"
QUICK_CHECK_LINES = 5


class LedgerCorrupt(RaasError):
    """The ledger cannot be trusted; the service must not start on it."""

    def __init__(self, path: Path, problem: str) -> None:
        identity = identity_path(path)
        super().__init__(
            f"the ledger {path} is unusable: {problem}. Restore it from a backup (with its -wal file, if "
            f"any), or move {path}, its -wal/-shm files and {identity.name} out of {path.parent} to start "
            "with an empty ledger (every earlier job and result is then gone)",
            kind="internal",
        )
        self.path = path


def identity_path(path: Path) -> Path:
    return path.with_name(path.name + IDENTITY_SUFFIX)


def wal_path(path: Path) -> Path:
    return path.with_name(path.name + "-wal")


def read_identity(path: Path) -> dict[str, Any] | None:
    ident = identity_path(path)
    try:
        data = json.loads(ident.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise LedgerCorrupt(path, f"its identity file {ident} cannot be read ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("ledger_id"), str):
        raise LedgerCorrupt(path, f"its identity file {ident} does not name a ledger id")
    return data


def write_identity(path: Path, ledger_id: str, *, open_: bool) -> None:
    """Replace the identity file atomically (write, fsync, rename, fsync the directory)."""
    ident = identity_path(path)
    tmp = ident.with_name(f".{ident.name}.{os.getpid()}.tmp")
    body = json.dumps({"ledger_id": ledger_id, "open": open_, "pid": os.getpid()}).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, ident)
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        dfd = os.open(ident.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def check_files(path: Path) -> dict[str, Any] | None:
    """Before SQLite opens anything: what the identity file says against the files on disk."""
    identity = read_identity(path)
    if identity is None:
        return None
    was = f"{identity_path(path).name} records ledger {identity['ledger_id']} here"
    if not path.exists():
        raise LedgerCorrupt(path, f"the file is missing, but {was}")
    if path.stat().st_size == 0:
        raise LedgerCorrupt(path, f"the file is empty (0 bytes), but {was}")
    if identity.get("open") and not wal_path(path).exists():
        raise LedgerCorrupt(
            path,
            f"its write-ahead log {wal_path(path).name} is missing although the last run did not close "
            "the ledger: the jobs and results committed since its last checkpoint are lost",
        )
    return identity


def quick_check(conn: sqlite3.Connection, path: Path) -> None:
    """``PRAGMA quick_check``: b-tree structure, page links, record formats (not every index entry)."""
    try:
        rows = conn.execute("PRAGMA quick_check").fetchmany(QUICK_CHECK_LINES)
    except sqlite3.DatabaseError as exc:
        raise LedgerCorrupt(path, f"SQLite cannot read it ({exc})") from exc
    if [r[0] for r in rows] != ["ok"]:
        found = "; ".join(str(r[0]).replace("\n", " ") for r in rows)
        raise LedgerCorrupt(path, f"PRAGMA quick_check found damage: {found}")


def settle_identity(conn: sqlite3.Connection, path: Path, identity: dict[str, Any] | None) -> str:
    """Match the database's id with the identity file's (giving a new ledger its id); returns the id."""
    conn.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    row = conn.execute("SELECT value FROM meta WHERE key='ledger_id'").fetchone()
    stored = row[0] if row else None
    if identity is not None and stored != identity["ledger_id"]:
        found = f"ledger {stored}" if stored else "a database without a ledger id"
        raise LedgerCorrupt(
            path,
            f"{identity_path(path).name} records ledger {identity['ledger_id']}, but the file holds {found} "
            "(was another file put in its place?)",
        )
    if stored is None:
        stored = uuid.uuid4().hex
        conn.execute("INSERT INTO meta (key, value) VALUES ('ledger_id', ?)", (stored,))
    return str(stored)
