"""Sweeping dirs left by killed processes: only a dead owner's dirs go."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raas.core.reaping import reap_dead_owner_dirs
from raas.sandbox.manager import reap_stale_bundles
from raas.toolserver.bundle import build_bundle

pytestmark = pytest.mark.unit


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_dirs_of_dead_owners_are_removed(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        owners = {"dead": str(dead_pid()), "live": str(live.pid), "self": str(os.getpid()), "odd": "x1"}
        if os.geteuid() != 0:
            owners["init"] = "1"  # another user's live process: cannot be signalled, so it is kept
        for name in owners:
            (tmp_path / name / "sub").mkdir(parents=True)
        removed = reap_dead_owner_dirs(sorted(tmp_path.iterdir()), lambda p: owners[p.name])
        assert removed == [tmp_path / "dead"]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(owners) - {"dead"})
    finally:
        live.kill()
        live.wait()


def test_a_killed_builders_bundle_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    mine, _ = build_bundle(tmp_path)
    parts = mine.name.split("-")
    orphan = tmp_path / "-".join([*parts[:-2], str(dead_pid()), parts[-1]])
    mine.rename(orphan)  # as if a process that died had built it
    mine, _ = build_bundle(tmp_path)
    assert reap_stale_bundles(tmp_path) == [orphan]
    assert mine.is_dir() and not orphan.exists()
