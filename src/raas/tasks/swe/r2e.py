"""R2E-Gym's grading rule: the output of the image's ``run_tests.sh`` must match ``expected_output_json``.

R2E-Gym ships no package on PyPI, so this follows its runtime (``DockerRuntime._calculate_reward_r2e`` and
``execution_log_parser.parse_log_pytest``) rule by rule: the pytest ``short test summary info`` lines are
read into ``{"<file basename>::<last id part>": status}`` (``FAILED``/``ERROR`` lines cut at `` - ``), ANSI
colour codes are dropped from the keys, keys are cut at `` - `` on both sides, and the reward is 1 only if
both maps have the same size and every parsed test has the expected status.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ANSI_KEY = re.compile(r"\x1b\[\d+m")


def parse_log(log: str) -> dict[str, str]:
    """``{test: PASSED | FAILED | ERROR}`` from pytest's short test summary, keyed as R2E-Gym keys it."""
    if "short test summary info" not in log:
        return {}
    statuses: dict[str, str] = {}
    for line in log.split("short test summary info", 1)[1].strip().split("\n"):
        for status in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(status):
                parts = line.split("::")
                name = "::".join([parts[0].split("/")[-1], parts[-1]])
                if status != "PASSED":
                    name = name.split(" - ")[0]
                statuses[name] = status
                break
    return statuses


def _normalise(statuses: dict[str, str]) -> dict[str, str]:
    clean = {_ANSI_KEY.sub("", k): v for k, v in statuses.items()}
    return {k.split(" - ")[0]: clean[k] for k in sorted(clean)}


@dataclass
class R2EGrade:
    resolved: bool
    parsed: dict[str, str] = field(default_factory=dict)
    mismatched: list[str] = field(default_factory=list)
    """Expected tests missing from the run or with another status (and unexpected ones)."""

    @property
    def log_valid(self) -> bool:
        return bool(self.parsed)

    def to_dict(self) -> dict[str, object]:
        return {"resolved": self.resolved, "log_valid": self.log_valid, "mismatched": self.mismatched[:50]}


def grade(log: str, expected: dict[str, str]) -> R2EGrade:
    parsed = _normalise(parse_log(log))
    want = _normalise(expected)
    mismatched = sorted({k for k in want if parsed.get(k) != want[k]} | {k for k in parsed if k not in want})
    resolved = (
        bool(parsed)
        and len(parsed) == len(want)
        and not any(k and (k not in want or parsed[k] != want[k]) for k in parsed)
    )
    return R2EGrade(resolved, parsed, mismatched)
