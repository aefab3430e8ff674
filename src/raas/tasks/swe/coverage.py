"""Which tests execute which source lines: the builder tries likely bugs first.

One extra run of the suite per package, with a tiny pytest plugin (standard library only, it runs on the
image's python3) that traces lines of the package's source files and attributes each to the test running
at the time, or to ``<import>`` before the first test (module-level code). A bug on a line no test runs
cannot fail a test; a bug on a line that runs at import time usually breaks the whole suite; a bug on a
line few tests run is the kind that fails 1..20 of them. Coverage only orders candidates: whether a bug is
kept is still decided by running the whole suite without tracing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from .mutate import Mutation

PLUGIN_DIR = "/tmp/raas-swe-plugin"
PLUGIN_MODULE = "raas_swe_coverage"
OUTPUT = "/tmp/raas-swe-coverage.json"
ENV_FILES = "RAAS_SWE_COVER_FILES"

PLUGIN_SOURCE = '''\
"""raas swe build: per-test line coverage of the package's source files (stdlib only)."""
import json
import os
import sys
import threading

_FILES = set(p for p in os.environ.get("__ENV__", "").split(os.pathsep) if p)
_current = ["<import>"]
_hits = {}


def _local(frame, event, arg):
    if event == "line":
        key = (frame.f_code.co_filename, frame.f_lineno)
        seen = _hits.get(key)
        if seen is None:
            seen = _hits[key] = set()
        seen.add(_current[0])
    return _local


def _global(frame, event, arg):
    if frame.f_code.co_filename in _FILES:
        return _local
    return None


sys.settrace(_global)
threading.settrace(_global)


def pytest_runtest_logstart(nodeid, location):
    _current[0] = nodeid


def pytest_runtest_logfinish(nodeid, location):
    _current[0] = "<between>"


def pytest_sessionfinish(session, exitstatus):
    sys.settrace(None)
    out = {}
    for (filename, line), who in _hits.items():
        tests = [w for w in who if not w.startswith("<")]
        out.setdefault(filename, {})[str(line)] = [len(tests), "<import>" in who]
    with open("__OUT__", "w") as f:
        json.dump(out, f)
'''.replace("__ENV__", ENV_FILES).replace("__OUT__", OUTPUT)


@dataclass(frozen=True)
class LineCoverage:
    """{(repo-relative file, line): (tests that ran it, ran at import time)}."""

    lines: dict[tuple[str, int], tuple[int, bool]]

    @classmethod
    def parse(cls, data: str, root: str = "/testbed/") -> LineCoverage:
        raw = json.loads(data)
        lines: dict[tuple[str, int], tuple[int, bool]] = {}
        for filename, per_line in raw.items():
            rel = filename[len(root) :] if filename.startswith(root) else filename
            for line, (tests, at_import) in per_line.items():
                lines[(rel, int(line))] = (int(tests), bool(at_import))
        return cls(lines)

    def site(self, m: Mutation) -> tuple[int, bool]:
        """(most tests that ran a line of the site, whether any of its lines ran at import)."""
        tests, at_import = 0, False
        for line in range(m.lineno, m.end_lineno + 1):
            t, i = self.lines.get((m.file, line), (0, False))
            tests, at_import = max(tests, t), at_import or i
        return tests, at_import


def prioritize(candidates: Sequence[Mutation], cov: LineCoverage, max_failing: int) -> list[Mutation]:
    """Candidates no test reaches are dropped; the rest keep their order within three tiers: lines few
    tests run (up to 3 x max_failing), lines many tests run, lines that run at import time."""
    tiers: list[list[Mutation]] = [[], [], []]
    for m in candidates:
        tests, at_import = cov.site(m)
        if at_import:
            tiers[2].append(m)
        elif tests == 0:
            continue
        elif tests <= 3 * max_failing:
            tiers[0].append(m)
        else:
            tiers[1].append(m)
    return [m for tier in tiers for m in tier]
