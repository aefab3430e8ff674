"""The tool server's JSON decoder words malformed input as ValueError in a process that never imported
the json package (the server's own: CPython 3.11's C scanner then has no JSONDecodeError to raise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import raas

pytestmark = pytest.mark.unit

SRC = str(Path(raas.__file__).resolve().parent.parent)

PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from raas.toolserver import jsonc
assert "json.decoder" not in sys.modules, "the probe must run without the json package"
for text in ("{not json", '{"a": }', "[1, 2", '"\\\\x"'):
    try:
        jsonc.loads(text)
    except ValueError as exc:
        print(type(exc).__name__)
    else:
        print("parsed")
"""


def test_malformed_json_is_a_value_error_without_the_json_package() -> None:
    out = subprocess.run(
        [sys.executable, "-S", "-c", PROBE, SRC], capture_output=True, text=True, timeout=60, check=True
    )
    names = out.stdout.split()
    assert len(names) == 4 and set(names) <= {"ValueError", "JSONDecodeError"}, out.stdout + out.stderr
