"""Finding and killing a sandbox's processes through /proc, and removing what a sandbox wrote."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from raas.sandbox import procs
from raas.sandbox.base import remove_tree

pytestmark = pytest.mark.unit

TAGS = ("sb-111111111111", "sb-333333333333", "sb-444444444444", "sb-555555555555", "sb-666666666666")


@pytest.fixture(autouse=True)
def no_tagged_leftovers() -> Iterator[None]:
    """Whatever these tests start is gone afterwards (and the check itself must find nothing left)."""
    yield
    for tag in TAGS:
        procs.kill_by_env(tag)
    assert [t for t in procs.pids_with_env_prefix("sb-").values() if t in TAGS] == []


def spawn_tagged(tag: str, script: str = "exec sleep 300") -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["sh", "-c", script], env={**os.environ, procs.ENV_KEY: tag}, start_new_session=True
    )


def test_identity_checks() -> None:
    p = spawn_tagged("sb-111111111111")
    try:
        started = procs.start_time(p.pid)
        assert started is not None
        assert procs.environ_value(p.pid) == "sb-111111111111"
        assert procs.is_same_process(p.pid, started, "sb-111111111111")
        assert not procs.is_same_process(p.pid, started + 1, "sb-111111111111")  # pid reused later
        assert not procs.is_same_process(p.pid, started, "sb-222222222222")
        assert p.pid in procs.pids_with_env("sb-111111111111")
    finally:
        p.kill()
        p.wait()
    assert procs.start_time(p.pid) is None


def test_environment_lookup_matches_only_the_exact_variable() -> None:
    """Look-alikes must not count: a longer key ending in the name, the id in another variable's value,
    a value that merely starts with the id; the first definition wins, at any place in the block."""
    key = procs.ENV_KEY.encode() + b"="
    look = procs._environ_lookup
    assert look(key + b"sb-1\0A=b\0", key) == b"sb-1"
    assert look(b"A=b\0" + key + b"sb-1", key) == b"sb-1"  # last entry, no trailing NUL
    assert look(b"A=b\0" + key + b"sb-1\0" + key + b"sb-2\0", key) == b"sb-1"
    assert look(b"X" + key + b"sb-1\0", key) is None
    assert look(b"A=" + key + b"sb-1\0", key) is None
    assert look(b"", key) is None
    # A process whose environment only mentions the id elsewhere is not the sandbox's.
    decoy = subprocess.Popen(
        ["sleep", "300"], env={"DECOY": "sb-555555555555", "X" + procs.ENV_KEY: "sb-555555555555"}
    )
    try:
        assert decoy.pid not in procs.pids_with_env("sb-555555555555")
        assert procs.environ_value(decoy.pid) is None
        assert procs.environ_value(decoy.pid, "DECOY") == "sb-555555555555"
    finally:
        decoy.kill()
        decoy.wait()


def test_kill_by_env_gets_forks_and_spares_others() -> None:
    # A process tree that keeps forking, in its own sessions: only the tag finds all of it.
    target = spawn_tagged(
        "sb-333333333333", "setsid sleep 300 & (sleep 300 &) ; while true; do sleep 1; done"
    )
    other = spawn_tagged("sb-444444444444")
    try:
        assert procs.kill_by_env("sb-333333333333") >= 3
        assert procs.pids_with_env("sb-333333333333") == []
        assert procs.environ_value(other.pid) == "sb-444444444444"
    finally:
        for p in (target, other):
            p.kill()
            p.wait()


def test_a_process_that_execs_in_a_loop_is_never_missed(tmp_path: Path) -> None:
    """While execve sets up its new memory map, /proc/PID/environ reads as empty (about a fifth of the
    time for a script that re-execs itself); a scan that took that for "no environment" missed such a
    process in ~30% of scans, and a sandbox's close could leave it running."""
    again = tmp_path / "again"
    again.write_text('#!/bin/sh\nexec "$0"\n')
    again.chmod(0o755)
    looping = subprocess.Popen(
        [str(again)], env={**os.environ, procs.ENV_KEY: "sb-666666666666"}, start_new_session=True
    )
    bare = subprocess.Popen(["env", "-i", "sleep", "300"])  # an empty environment: read, then given up on
    try:
        misses = sum(looping.pid not in procs.pids_with_env("sb-666666666666") for _ in range(300))
        assert misses == 0
        assert procs.kill_by_env("sb-666666666666") == 1
        assert looping.wait(timeout=30) == -9
    finally:
        for p in (looping, bare):
            p.kill()
            p.wait()


def test_wait_gone_reports_stragglers() -> None:
    p = spawn_tagged("sb-555555555555")
    try:
        assert procs.wait_gone([p.pid], 0.05) == [p.pid]
        p.kill()
        assert procs.wait_gone([p.pid], 30) == []
    finally:
        p.kill()
        p.wait()


def test_remove_tree_copes_with_read_only_dirs(tmp_path: Path) -> None:
    d = tmp_path / "ws" / "locked" / "deeper"
    d.mkdir(parents=True)
    (d / "f").write_text("x")
    (d / "f").chmod(0)
    d.chmod(0o500)
    (tmp_path / "ws" / "locked").chmod(0)
    remove_tree(tmp_path / "ws")
    assert not (tmp_path / "ws").exists()
    remove_tree(tmp_path / "ws")  # absent: fine
    assert procs.mounts_under(tmp_path) == []
