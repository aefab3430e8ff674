"""``python -m raas.api`` refuses a bad configuration with a clear message and exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--config", "/nonexistent/raas.json"], "cannot read config"),
        (["--handler", "no-equals-sign"], "NAME=MODULE:CLASS"),
        (["--port", "70000"], "invalid service config"),
    ],
)
def test_bad_configuration_exits_2(tmp_path: Path, args: list[str], phrase: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "raas.api", "--state-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert phrase in proc.stderr and "Traceback" not in proc.stderr
