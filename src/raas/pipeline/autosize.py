"""``auto`` stage workers: sized from the machine at start, then from what the stages measurably cost.

A stage's worker count only caps how many jobs are inside it at once (an unused slot costs nothing), so
the question is how much concurrency pays. The stages differ (measured on 2 cores, bench/pipeline.py):
INIT and EVAL spend CPU (sandbox start-up, test suites: CPU-bound, more of them than cores only adds
contention), RUN mostly waits for the inference server (wait-bound: its concurrency should follow the
policy server, not the cores), and every job inside a stage holds a sandbox (memory).

So, per stage set to ``auto``:

* start: INIT ``2 x cpus``, RUN ``8 x cpus``, EVAL ``2 x cpus``;
* every ``tick_s``, for a stage that has jobs waiting while all its workers are busy: grow by a quarter
  when the machine's CPUs had headroom over the tick (busy < ``grow_below``) — for a wait-bound stage that
  is nearly always, for a CPU-bound one only until the cores are used; shrink by an eighth when the CPUs
  were saturated (busy > ``shrink_above``) and the stage's own jobs take more than their share of the time
  (its active/workers ratio is what holds the CPU: INIT and EVAL only — RUN waits);
* bounds: at least ``cpus`` (INIT, EVAL) or ``2 x cpus`` (RUN), at most ``16 x cpus`` (INIT, EVAL) and, for
  every stage, as many sandboxes as half the available memory holds at ``sandbox_mb`` each.

Machine CPU use comes from ``/proc/stat`` (all processes: the sandboxes' work is not in raas's own CPU
time). Decisions and the current counts are visible in ``/status`` (``stages.<stage>.workers``).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("raas.pipeline")

AUTO = "auto"
CPU_BOUND = ("init", "eval")


class Resizable(Protocol):
    workers: int
    running: int

    def waiting(self) -> int: ...


def cpu_count() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def available_mb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return float("inf")


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])
    return total - idle, total


@dataclass(frozen=True)
class Bounds:
    start: int
    low: int
    high: int


def bounds_for(stage: str, cpus: int, memory_mb: float, sandbox_mb: float) -> Bounds:
    by_memory = max(1, int(memory_mb / 2 / sandbox_mb)) if memory_mb != float("inf") else 4096
    if stage == "run":
        low, start, high = 2 * cpus, 8 * cpus, 4096
    else:
        low, start, high = cpus, 2 * cpus, 16 * cpus
    high = max(low, min(high, by_memory, 4096))
    return Bounds(start=min(max(start, low), high), low=low, high=high)


def auto_worker_bounds(config: Any) -> dict[str, Bounds]:
    """Bounds of the stages a :class:`~raas.pipeline.config.ServiceConfig` sets to ``auto``."""
    stages = [s for s in ("init", "run", "eval") if getattr(config, f"{s}_workers") == AUTO]
    if not stages:
        return {}
    cpus, memory = cpu_count(), available_mb()
    return {s: bounds_for(s, cpus, memory, config.warm_pool.sandbox_mb) for s in stages}


class WorkerAutosizer:
    """Adjusts the worker counts of the ``auto`` stages; :meth:`run` is a task the scheduler owns."""

    def __init__(
        self,
        pools: dict[str, Resizable],
        bounds: dict[str, Bounds],
        *,
        on_change: Callable[[str], None],
        tick_s: float = 2.0,
        grow_below: float = 0.85,
        shrink_above: float = 0.97,
        ticks: Callable[[], tuple[int, int]] = cpu_ticks,
    ) -> None:
        self.pools = pools
        self.bounds = bounds
        self.on_change = on_change
        self.tick_s = tick_s
        self.grow_below = grow_below
        self.shrink_above = shrink_above
        self.ticks = ticks
        self._last = ticks()
        self.busy: float | None = None

    def step(self) -> dict[str, int]:
        """One decision from the CPU use since the last step; returns the stages' new counts."""
        busy_now, total_now = self.ticks()
        d_total = total_now - self._last[1]
        self.busy = (busy_now - self._last[0]) / d_total if d_total > 0 else None
        self._last = (busy_now, total_now)
        changed: dict[str, int] = {}
        if self.busy is None:
            return changed
        for stage, b in self.bounds.items():
            pool = self.pools[stage]
            saturated = pool.running >= pool.workers and pool.waiting() > 0
            new = pool.workers
            if saturated and self.busy < self.grow_below:
                new = min(b.high, pool.workers + max(1, pool.workers // 4))
            elif self.busy > self.shrink_above and stage in CPU_BOUND and pool.running >= pool.workers:
                new = max(b.low, pool.workers - max(1, pool.workers // 8))
            if new != pool.workers:
                log.info(
                    "auto workers: %s %d -> %d (CPU busy %.0f%%)", stage, pool.workers, new, 100 * self.busy
                )
                pool.workers = new
                changed[stage] = new
                self.on_change(stage)
        return changed

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.step()
