"""The records behind :class:`~raas.trainer.rollout.RolloutClient`: its failure policy and counters (public),
and its per-sample and per-service state."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from raas.trainer.client import RaasClient
from raas.trainer.types import Group


@dataclass
class FailurePolicy:
    """What to do with samples the service filtered (failed, timed out, cancelled by someone else)."""

    resubmit: bool = True
    max_resubmits: int = 2
    """Per sample: how many times a filtered result is replaced by a fresh attempt before it is dropped."""
    max_moves: int = 3
    """Per sample: how many times it may be moved off a service that stopped answering."""
    min_group_size: int = 2
    """Usable samples a group needs; fewer and it is refilled or dropped."""
    refill: bool = False
    """Submit new samples (new trajectory ids) into a group that fell below ``min_group_size``."""
    max_refill_samples: int = 4
    """Per group: at most this many refill samples in total."""
    give_up_after_s: float = 300.0
    """A sample that finds no healthy service for this long is dropped (kind ``unavailable``)."""


@dataclass
class ClientStats:
    """Cumulative counters (the DAPO sampler reports per-step differences)."""

    submitted: int = 0
    results: int = 0
    usable: int = 0
    filtered: int = 0
    resubmitted: int = 0
    dropped_samples: int = 0
    refilled_samples: int = 0
    dropped_groups: int = 0
    completed_groups: int = 0
    cancelled: int = 0
    moved: int = 0
    services_down: int = 0
    stream_reconnects: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class JobRecord:
    """One attempt of one sample: where it runs and how often it was resubmitted or moved."""

    job_id: str
    group: Group
    index: int
    attempt: int = 0
    moves: int = 0
    service: ServiceState | None = None
    acked: bool = False
    """The current service accepted it (only then does a 404 there mean the job was lost)."""
    done: bool = False
    homeless_since: float | None = None

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "instance": {**self.group.instance, "trajectory_id": self.index, "group_id": self.group.group_id},
            "job_id": self.job_id,
        }
        if self.group.sampling_params is not None:
            body["sampling_params"] = self.group.sampling_params
        body.update(self.group.request_fields)
        return body


@dataclass
class ServiceState:
    """One raas service as the client sees it."""

    url: str
    client: RaasClient
    host: str
    healthy: bool = True
    """Takes new jobs."""
    dead: bool = False
    """Silent for longer than ``dead_after_s``: its jobs were moved."""
    last_ok: float = field(default_factory=time.monotonic)
    outstanding: dict[str, JobRecord] = field(default_factory=dict)
    abandoned: set[str] = field(default_factory=set)
    watcher: asyncio.Task[None] | None = None
    polls: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(64))
    """``consume="poll"``: long-polls open at once (each holds a connection)."""
