"""Per-handler stage policy: how long each stage of a job may take and how much of a stage's worker pool
one ``data_source`` may hold.

Why: one service runs tasks of very different cost side by side. A SWE evaluation that takes ten minutes
must not hold every EVAL worker while math jobs, which verify in milliseconds, wait behind it. A handler
declares its policy as a class attribute (``TaskHandler.policy``); the service's config may override it
per ``data_source`` (``ServiceConfig.handler_policies``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from raas.core.jobs import STAGES, StageName


class StageTimeouts(BaseModel):
    """Per-stage ceilings in seconds (None = no ceiling of its own; the job's total budget still applies)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    init: float | None = Field(None, gt=0)
    run: float | None = Field(None, gt=0)
    eval: float | None = Field(None, gt=0)

    def of(self, stage: StageName) -> float | None:
        value: float | None = getattr(self, stage)
        return value


class StageShares(BaseModel):
    """Per stage, the largest fraction of that stage's workers one ``data_source`` may hold at once, in
    (0, 1] (None = all of them). The limit is ``max(1, floor(share * workers))`` concurrent jobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    init: float | None = Field(None, gt=0, le=1)
    run: float | None = Field(None, gt=0, le=1)
    eval: float | None = Field(None, gt=0, le=1)

    def limit(self, stage: StageName, workers: int) -> int:
        """Concurrent jobs of one ``data_source`` allowed in ``stage`` out of ``workers``."""
        share: float | None = getattr(self, stage)
        if share is None:
            return workers
        return max(1, min(workers, math.floor(share * workers + 1e-9)))


class StagePolicy(BaseModel):
    """A handler's stage policy. Settings it leaves out (None) fall back to the service's
    (``ServiceConfig.stage_timeouts``; no share limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage_timeouts: StageTimeouts = Field(default_factory=StageTimeouts)
    max_share: StageShares = Field(default_factory=StageShares)
    resume: Literal["replay", "restart", "fail"] = Field(
        "replay",
        description="What a restart does with a job inside RUN: 'replay' its committed turns in a fresh "
        "sandbox and go on sampling (a tool that answers differently ends it failed/replay_diverged); "
        "'restart' it from INIT, generating anew; 'fail' it (interrupted). Jobs past RUN always resume at "
        "EVAL and jobs before RUN always run again.",
    )

    def overridden_by(self, override: StagePolicy) -> StagePolicy:
        """This policy with every setting ``override`` states explicitly (``None`` included) replaced."""
        return StagePolicy.model_validate(
            _deep_merge(self.model_dump(), override.model_dump(exclude_unset=True))
        )

    def with_default_timeouts(self, defaults: StageTimeouts) -> StagePolicy:
        """Fill the stage timeouts this policy leaves open from ``defaults`` (the service-wide ceilings)."""
        filled = {
            s: self.stage_timeouts.of(s) if self.stage_timeouts.of(s) is not None else defaults.of(s)
            for s in STAGES
        }
        return self.model_copy(update={"stage_timeouts": StageTimeouts(**filled)})


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
