"""The records a trainer receives, in one place: the service's own result models and the trainer's groups.

Results are the service's :class:`JobResult` (validated from the wire, never a dict), so a field the service
adds shows up here without a second definition. Import them from this module: when the models move, only
the import below changes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from raas.core.jobs import ErrorInfo, JobEvent, JobInfo, JobResult, SubmitResponse, Timing
from raas.core.trajectory import Message, TokenTrajectory, Turn

__all__ = [
    "ErrorInfo",
    "Group",
    "JobEvent",
    "JobInfo",
    "JobResult",
    "Message",
    "SubmitResponse",
    "Timing",
    "TokenTrajectory",
    "Turn",
    "is_valid",
    "version_number",
]


def is_valid(result: JobResult) -> bool:
    """True when a trainer may learn from ``result``: completed, not filtered, with a reward. Everything
    else (failed, timeout, cancelled, ``filter: true``) carries no reward signal at all — never a 0."""
    return result.status == "completed" and not result.filter and result.reward is not None


def version_number(version: str | None) -> int | None:
    """The integer in a weight-version string (``"7"``, ``"step-7"`` → 7), or None when there is none."""
    if version is None:
        return None
    digits = ""
    for ch in reversed(version.strip()):
        if not ch.isdigit():
            break
        digits = ch + digits
    return int(digits) if digits else None


@dataclass
class Group:
    """One instance sampled ``size`` times (``trajectory_id`` 0..size-1), as the trainer consumes it.

    ``results`` holds the usable samples (:func:`is_valid`) by trajectory index; ``failures`` every
    filtered result that was not replaced (kept for inspection, never for training). ``submit_version`` is
    the policy version current when the group was submitted."""

    group_id: str
    instance: dict[str, Any]
    size: int
    sampling_params: dict[str, Any] | None = None
    request_fields: dict[str, Any] = field(default_factory=dict)
    """Other fields of every sample's job request (``timeout_s``, ``priority``)."""
    submit_version: int = 0
    results: dict[int, JobResult] = field(default_factory=dict)
    failures: list[JobResult] = field(default_factory=list)
    submitted_at: float = 0.0
    finished_at: float | None = None
    cancelled: bool = False
    dropped: bool = False
    """Finished with fewer than the failure policy's minimum of usable samples: not for training."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Free for the caller (e.g. the DAPO sampler's bookkeeping)."""

    @property
    def samples(self) -> list[JobResult]:
        """Usable results in trajectory order."""
        return [self.results[i] for i in sorted(self.results)]

    @property
    def rewards(self) -> list[float]:
        return [float(r.reward) for r in self.samples if r.reward is not None]

    @property
    def reward_std(self) -> float:
        """Population standard deviation of the rewards (0 for fewer than two samples)."""
        rewards = self.rewards
        return statistics.pstdev(rewards) if len(rewards) > 1 else 0.0

    @property
    def informative(self) -> bool:
        """DAPO's test: the rewards are not all equal, so group-relative advantages are not all zero."""
        return self.reward_std > 0.0

    def turn_versions(self) -> list[int]:
        """The weight version of every turn of every usable sample (turns without a parsable one skipped)."""
        out: list[int] = []
        for r in self.samples:
            for t in r.turns:
                v = version_number(t.weight_version)
                if v is not None:
                    out.append(v)
        return out

    def oldest_version(self) -> int:
        """The oldest policy version that sampled any turn of the group; the submit version when no turn
        carries one."""
        versions = self.turn_versions()
        return min(versions) if versions else self.submit_version
