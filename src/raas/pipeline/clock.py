"""The budget clock: how much of a job's time a stage may use, and how much it did use.

Only time inside a stage counts against a job's budget (``timeout_s``); queue waits do not. A stage may
also have a ceiling of its own (its handler's stage policy). Time a RUN stage spends while the LLM is
paused through the service (weight sync) is not the job's doing and does not count either: the
:class:`PauseClock` keeps the total paused time, and :func:`run_within` subtracts what passed during the
stage.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from raas.errors import RaasError

EPS = 1e-6


class PauseClock:
    """Seconds the LLM has been paused through this service, in total (monotonic)."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._total = 0.0

    def paused_s(self) -> float:
        current = time.monotonic() - self._since if self._since is not None else 0.0
        return self._total + current

    def pause(self) -> None:
        if self._since is None:
            self._since = time.monotonic()

    def resume(self) -> None:
        if self._since is not None:
            self._total += time.monotonic() - self._since
            self._since = None


@dataclass
class Budget:
    """What a stage may use: the job's remaining in-stage time, capped by the stage's ceiling."""

    total_s: float
    counted_s: float
    ceiling_s: float | None

    @property
    def limit_s(self) -> float:
        remaining = self.total_s - self.counted_s
        return remaining if self.ceiling_s is None else min(remaining, self.ceiling_s)

    def timeout_error(self, stage: str, used_s: float = 0.0) -> RaasError:
        """The ``timeout`` error for a stage stopped after ``used_s`` counted seconds: its own ceiling, or
        the job's budget, whichever ran out."""
        ceiling = self.ceiling_s
        if ceiling is not None and used_s >= ceiling - EPS and self.counted_s + used_s < self.total_s - EPS:
            message = f"{stage} exceeded its stage limit of {ceiling:g}s"
        else:
            message = f"the job used its {self.total_s:g}s budget of in-stage time (stopped in {stage})"
        return RaasError(message, kind="timeout", stage=stage)


@dataclass
class Measured:
    """How a stage task ended against its budget."""

    done: bool
    """False when the limit ran out first (the task is still running)."""
    used_s: float
    """Seconds that count against the budget."""
    elapsed_s: float
    """Wall-clock seconds inside the stage."""


async def run_within(task: asyncio.Task[Any], limit_s: float, pauses: PauseClock | None) -> Measured:
    """Wait for ``task`` until it ends or has used ``limit_s`` counted seconds. With ``pauses``, time
    the LLM spent paused meanwhile is not counted (the wait is extended by it)."""
    started = time.monotonic()
    paused_at_start = pauses.paused_s() if pauses is not None else 0.0
    used = 0.0
    while True:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, limit_s - used))
        used = time.monotonic() - started
        if pauses is not None:
            used -= pauses.paused_s() - paused_at_start
        if done or used >= limit_s:
            return Measured(done=bool(done), used_s=used, elapsed_s=time.monotonic() - started)
