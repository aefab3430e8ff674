"""How the router follows its nodes: one SSE stream per node, results fetched on terminal events, a
reconcile after every (re)connect, and the one-result rule (the first result recorded wins; copies
elsewhere are cancelled). A mixin of :class:`raas.cluster.router.ClusterRouter`, which owns the state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any, cast

from raas.cluster.nodes import NODE_DOWN, NODE_FAILURES, NodeError
from raas.cluster.state import NodeState, RouterSettings, Tracked
from raas.core.jobs import ErrorInfo, JobEvent, JobResult, JobStatus, Timing, is_terminal
from raas.pipeline.events import EventBus
from raas.pipeline.ledger import Ledger

log = logging.getLogger("raas.cluster.router")


class NodeFollowing:
    """Result flow from the nodes into the router's ledger and event bus (see the module docstring)."""

    nodes: dict[str, NodeState]
    jobs: dict[str, Tracked]
    queue: list[str]
    finished: dict[str, int]
    ledger: Ledger
    bus: EventBus
    settings: RouterSettings
    _wake: asyncio.Event

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        raise NotImplementedError

    def _requeue(self, t: Tracked, why: str) -> None:
        raise NotImplementedError

    # -- following a node ------------------------------------------------------------------------------

    async def _follow(self, node: NodeState) -> None:
        """Follow ``node``'s event stream for as long as it is a member, reconnecting with backoff."""
        backoff = 0.2
        while True:
            try:
                async for event in node.client.events(on_open=lambda: self._opened(node)):
                    backoff = 0.2
                    await self._on_event(node, event)
            except asyncio.CancelledError:
                raise
            except NODE_FAILURES as exc:
                log.debug("event stream of %s broke: %s", node.url, exc)
            except Exception:
                log.exception("event stream of %s failed", node.url)
            if node.connected:
                node.connected = False
                node.unreachable_since = time.monotonic()
            await asyncio.sleep(backoff)
            backoff = min(2.0, backoff * 2)

    def _opened(self, node: NodeState) -> None:
        """The stream is open: from now on no event is missed, so ask the node about its jobs once."""
        node.connected = True
        node.draining = False
        node.unreachable_since = None
        self._spawn(self._reconcile(node), f"raas-router-reconcile-{node.node_id[:12]}")
        self._wake.set()

    async def _reconcile(self, node: NodeState) -> None:
        """Ask ``node`` about every job it holds for the router: pick up results missed while the stream
        was down, and re-queue jobs it does not know (it lost its ledger)."""
        for job_id in sorted(node.jobs):
            t = self.jobs.get(job_id)
            if t is None or t.claimed:
                continue
            try:
                info = await node.client.get(job_id)
            except NodeError as exc:
                if exc.kind == "not_found" and self.nodes.get(node.node_id) is node:
                    node.jobs.discard(job_id)
                    t.node = None
                    self.queue.append(job_id)
                    self._wake.set()
                continue
            except NODE_DOWN:
                return
            if is_terminal(info.status):
                await self._fetch_result(node, job_id)
            elif info.status != t.info.status:
                self._record_status(t, info.status, info.updated_at)

    async def _on_event(self, node: NodeState, event: JobEvent) -> None:
        t = self.jobs.get(event.job_id)
        if t is None or t.claimed or node.node_id not in t.tried:
            return
        if is_terminal(event.status):
            self._spawn(self._fetch_result(node, event.job_id), "raas-router-result")
        elif t.node == node.node_id:
            self._record_status(t, event.status, event.at)

    def _record_status(self, t: Tracked, status: str, at: float) -> None:
        t.set_status(status, at)
        self.ledger.transition(t.job_id, status, at)
        self.bus.publish(JobEvent(job_id=t.job_id, status=cast(JobStatus, status), at=at))

    async def _fetch_result(self, node: NodeState, job_id: str) -> None:
        try:
            result = await node.client.result(job_id)
        except NODE_FAILURES as exc:
            log.info("could not fetch the result of %s from %s: %s", job_id, node.url, exc)
            return
        t = self.jobs.get(job_id)
        if result is None or t is None:
            return
        if result.error is not None and result.error.kind == "interrupted" and result.error.stage != "router":
            # The node shut down (or restarted) under the job: not the job's outcome; run it elsewhere.
            if t.node == node.node_id and not t.claimed:
                node.jobs.discard(job_id)
                self._requeue(t, f"node {node.node_id} interrupted it ({result.error.message})")
            return
        await self._deliver(t, result, node.node_id)

    async def _deliver(self, t: Tracked, result: JobResult, node_id: str | None) -> None:
        """Record ``result`` as the job's one result (the first to arrive wins)."""
        if t.claimed:
            return
        t.claimed = True  # a second copy's result arriving while this one is written is ignored
        now = time.time()
        await self.ledger.finish(result, now)
        t.result = result
        t.set_status(result.status, now)
        t.done.set()
        self.jobs.pop(t.job_id, None)
        with contextlib.suppress(ValueError):
            self.queue.remove(t.job_id)
        for node in self.nodes.values():
            node.jobs.discard(t.job_id)
        self.finished[result.status] = self.finished.get(result.status, 0) + 1
        self.bus.publish(
            JobEvent(
                job_id=t.job_id,
                status=result.status,
                at=now,
                reward=result.reward,
                filter=result.filter,
                error=result.error,
            )
        )
        others = t.tried - {node_id} if node_id else t.tried
        for other in others:
            copy_node = self.nodes.get(other)
            if copy_node is not None:
                self._spawn(self._cancel_copies(copy_node, {t.job_id}), "raas-router-cancel-copy")
        self._wake.set()

    async def _cancel_copies(self, node: NodeState, job_ids: set[str]) -> None:
        for job_id in sorted(job_ids):
            with contextlib.suppress(*NODE_FAILURES):
                await node.client.cancel(job_id)

    async def _finish_here(self, t: Tracked, status: str, error: ErrorInfo) -> None:
        """A result the router writes itself (a job that never got to run anywhere)."""
        result = JobResult(
            job_id=t.job_id,
            instance_id=t.info.instance_id,
            trajectory_id=t.info.trajectory_id,
            status=cast(Any, status),
            error=error,
            filter=True,
            timing=Timing(total_s=max(0.0, time.time() - t.info.created_at)),
        )
        await self._deliver(t, result, None)
