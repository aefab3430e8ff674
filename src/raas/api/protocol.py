"""What the HTTP API needs from whatever it serves.

The routes talk to one object through these methods only. :class:`raas.pipeline.service.RolloutService`
is one; a cluster router (:mod:`raas.cluster.router`) is another, which is how a trainer that knows one
URL gets the same native and ProRL-compatible API from one node or from a whole cluster.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from raas.core.jobs import JobInfo, JobRequest, JobResult, SubmitResponse
from raas.pipeline.config import ServiceConfig
from raas.pipeline.events import Subscription


class Served(Protocol):
    """A rollout service as the API sees it (see the module docstring)."""

    config: ServiceConfig
    gauges: CollectorRegistry

    @property
    def accepting(self) -> bool: ...

    async def start(self) -> None: ...

    async def shutdown(self, grace_s: float | None = None) -> None: ...

    async def submit(self, request: JobRequest) -> SubmitResponse: ...

    async def submit_many(self, requests: Sequence[JobRequest]) -> list[SubmitResponse]: ...

    async def get(self, job_id: str) -> JobInfo: ...

    async def result(self, job_id: str) -> JobResult | None: ...

    async def wait(self, job_id: str, timeout: float | None) -> JobResult | None: ...  # noqa: ASYNC109

    async def cancel(self, job_id: str) -> JobInfo: ...

    def events(self) -> AbstractAsyncContextManager[Subscription]: ...

    def close_event_streams(self) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def llm_servers(self) -> list[dict[str, Any]]: ...

    # A service changes its own balancer at once; a router has nodes to tell, so it may return an
    # awaitable (the routes await it through :func:`settle`).
    def add_llm_server(
        self, address: str, *, weight_version: str | None = None, kind: str = "auto"
    ) -> Awaitable[None] | None: ...

    def remove_llm_server(self, address: str) -> Awaitable[None] | None: ...

    def clear_llm_servers(self) -> Awaitable[None] | None: ...

    async def pause_llm(self) -> None: ...

    async def resume_llm(self) -> None: ...


async def settle(outcome: Awaitable[None] | None) -> None:
    """Await what a :class:`Served` method returned, if it is awaitable."""
    if outcome is not None:
        await outcome
