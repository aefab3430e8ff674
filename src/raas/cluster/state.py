"""The router's bookkeeping: an unfinished job it owns and a node it follows."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from raas.cluster.nodes import NodeClient, NodeRecord
from raas.core.jobs import JobInfo, JobResult
from raas.errors import RaasError


@dataclass
class Tracked:
    """An unfinished job the router owns."""

    job_id: str
    request: dict[str, Any]
    info: JobInfo
    node: str | None = None
    tried: set[str] = field(default_factory=set)
    moves: int = 0
    sent: asyncio.Event = field(default_factory=asyncio.Event)
    send_error: RaasError | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    claimed: bool = False  # a result is being recorded
    result: JobResult | None = None

    def set_status(self, status: str, at: float) -> None:
        self.info = self.info.model_copy(update={"status": status, "updated_at": at})


@dataclass
class NodeState:
    record: NodeRecord
    client: NodeClient
    jobs: set[str] = field(default_factory=set)
    connected: bool = False
    unreachable_since: float | None = None
    full_until: float = 0.0
    draining: bool = False
    llm: set[str] = field(default_factory=set)  # inference servers the router attached here
    llm_paused: bool = False
    follower: asyncio.Task[None] | None = None

    @property
    def node_id(self) -> str:
        return self.record.node_id

    @property
    def url(self) -> str:
        return self.record.url or ""

    def load(self) -> float:
        return len(self.jobs) / max(1, self.record.capacity)


@dataclass
class RouterSettings:
    """How the router watches its nodes."""

    poll_s: float = 1.0  # how often it asks the node source for the membership
    node_deadline_s: float = 15.0  # unreachable this long (while Ray still lists it) = lost
    max_moves: int = 3  # how many node losses one job may survive
    reconcile_s: float = 30.0  # how often each node is asked about its jobs anyway (a missed result)
    submit_wait_s: float = 10.0  # how long submit waits for the first hand-over (its errors are the caller's)
