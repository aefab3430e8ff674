"""The cluster's front door: one URL, the API of one raas service, the capacity of many.

:class:`ClusterRouter` implements :class:`raas.api.protocol.Served`, so ``raas.api`` serves the same native
``/v1`` and ProRL-compatible routes from it as from a single service. Underneath:

* **Durable.** Every accepted job is in the router's own ledger (:class:`raas.pipeline.ledger.Ledger`)
  before ``submit`` returns; each hand-over to a node is a transition whose detail names the node; the
  result is committed before anyone sees the job finish. A router restarted on the same ledger picks up
  its unfinished jobs where they are (node submissions are idempotent on the job id).
* **Least-loaded placement.** A job goes to the healthy node with the fewest unfinished router jobs per
  unit of sandbox capacity; a node that answers 429 is skipped until it has room.
* **Results over SSE.** One event stream per node; a terminal event fetches the result. After every
  (re)connect the router asks the node for each job it holds, so a gap in the stream loses nothing.
* **Node loss.** Membership comes from the node source (Ray's GCS and the node actors). A node Ray reports
  dead, whose actor is gone, or that stays unreachable past ``node_deadline_s`` is dropped and its
  unfinished jobs go back to the queue for the other nodes (at most ``max_moves`` times). The first result
  wins: a copy still running elsewhere is cancelled, and a late duplicate is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

from prometheus_client import CollectorRegistry

from raas.cluster.follow import NodeFollowing
from raas.cluster.llm import LLMAssignment
from raas.cluster.nodes import NODE_DOWN, NODE_FAILURES, NodeClient, NodeError, NodeRecord, NodeSource
from raas.cluster.state import NodeState, RouterSettings, Tracked
from raas.core.jobs import (
    ErrorInfo,
    Job,
    JobEvent,
    JobInfo,
    JobRequest,
    JobResult,
    JobStatus,
    SubmitResponse,
    is_terminal,
    new_job_id,
)
from raas.errors import RaasError
from raas.pipeline.admission import NotAccepting, Overloaded
from raas.pipeline.config import ServiceConfig
from raas.pipeline.events import EventBus, Subscription
from raas.pipeline.ledger import Ledger
from raas.pipeline.lookup import stored_result, wait_result

log = logging.getLogger("raas.cluster.router")


class ClusterRouter(NodeFollowing):
    """See the module docstring. ``config`` is a :class:`ServiceConfig` for the router itself (its state
    dir holds the router's ledger; ``max_pending``, HTTP limits and the API token apply to it)."""

    def __init__(
        self, config: ServiceConfig, source: NodeSource, settings: RouterSettings | None = None
    ) -> None:
        self.config = config
        self.source = source
        self.settings = settings or RouterSettings()
        self.ledger = Ledger(
            config.ledger_file(), result_ttl_s=config.result_ttl_s, max_results=config.max_results
        )
        self.bus = EventBus()
        self.gauges = CollectorRegistry(auto_describe=True)
        self.nodes: dict[str, NodeState] = {}
        self.jobs: dict[str, Tracked] = {}
        self.queue: list[str] = []  # unassigned jobs, in arrival order
        self.finished: dict[str, int] = {}
        self._lost_jobs: dict[str, set[str]] = {}  # node id -> jobs moved away from it
        self.llm = LLMAssignment(lambda: list(self.nodes.values()))
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._accepting = False
        self._started = False
        self._stopped = False

    # -- lifecycle ---------------------------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self._accepting

    async def __aenter__(self) -> ClusterRouter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Open the ledger, learn the nodes, take back the jobs a previous run left, start accepting."""
        if self._started:
            return
        self._started = True
        try:
            self.config.state_dir.mkdir(parents=True, exist_ok=True)
            await self.ledger.open()
            await self.source.start()
            await self._refresh()
            await self._recover()
            self._spawn(self._membership_loop(), "raas-router-membership")
            self._spawn(self._dispatch_loop(), "raas-router-dispatch")
            self._accepting = True
        except BaseException:
            await self.shutdown()
            raise

    async def shutdown(self, grace_s: float | None = None) -> None:
        """Stop accepting and close. Jobs on the nodes keep running; a router started again on the same
        ledger follows them (``grace_s`` is accepted for the protocol's sake: nothing here needs draining)."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        self._accepting = False
        for task in list(self._tasks):
            task.cancel()
        for node in list(self.nodes.values()):
            if node.follower is not None:
                node.follower.cancel()
        tasks = [*self._tasks, *(n.follower for n in self.nodes.values() if n.follower is not None)]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for node in self.nodes.values():
            await node.client.close()
        self.nodes.clear()
        await self.source.close()
        self.bus.close()
        await self.ledger.close()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("router task %s failed", task.get_name(), exc_info=task.exception())

    async def _recover(self) -> None:
        """Unfinished jobs of a previous run: back to the node the ledger says holds them (the follower's
        first reconcile asks it for them), else into the queue."""
        for row in await self.ledger.unfinished():
            node_id = None
            for status, _at, detail in reversed(await self.ledger.transitions(row.job_id)):
                if status != "queued" or detail is None:
                    continue
                if detail.startswith("node "):
                    node_id = detail.split()[1]
                break  # the last hand-over or re-queue decides
            t = Tracked(job_id=row.job_id, request=row.request, info=row.info())
            self.jobs[t.job_id] = t
            node = self.nodes.get(node_id) if node_id else None
            if node is not None:
                t.node = node.node_id
                t.tried.add(node.node_id)
                node.jobs.add(t.job_id)
                t.sent.set()
            else:
                self.queue.append(t.job_id)
        for node in self.nodes.values():
            if node.connected and node.jobs:  # its stream opened before the jobs were attached
                self._spawn(self._reconcile(node), f"raas-router-reconcile-{node.node_id[:12]}")
        if self.jobs:
            log.info("router resumed %d unfinished jobs (%d to place)", len(self.jobs), len(self.queue))

    # -- membership ----------------------------------------------------------------------------------------

    async def _membership_loop(self) -> None:
        last_reconcile = time.monotonic()
        while True:
            await asyncio.sleep(self.settings.poll_s)
            try:
                await self._refresh()
            except Exception:
                log.exception("could not refresh the node list")
            if time.monotonic() - last_reconcile >= self.settings.reconcile_s:
                # A result whose fetch failed while the stream stayed up is picked up here.
                last_reconcile = time.monotonic()
                for node in list(self.nodes.values()):
                    if node.connected and node.jobs:
                        self._spawn(self._reconcile(node), f"raas-router-reconcile-{node.node_id[:12]}")

    async def _refresh(self) -> None:
        records = await self.source.snapshot()
        seen: set[str] = set()
        changed = False
        for rec in records:
            seen.add(rec.node_id)
            node = self.nodes.get(rec.node_id)
            if not rec.alive or not rec.url:
                if node is not None:
                    await self._lose(node, "Ray reports the node or its raas actor dead")
                    changed = True
                continue
            if node is None or node.url != rec.url:
                if node is not None:
                    await self._lose(node, "its service moved to a new address")
                self._add(rec)
                changed = True
            else:
                node.record = rec
        now = time.monotonic()
        for node in list(self.nodes.values()):
            if node.node_id not in seen:
                await self._lose(node, "it is no longer registered")
                changed = True
            elif (
                node.unreachable_since is not None
                and now - node.unreachable_since > self.settings.node_deadline_s
            ):
                await self._lose(node, f"unreachable for over {self.settings.node_deadline_s:g} s")
                changed = True
        if changed:
            self._wake.set()
            if self.llm:
                self._spawn(self.llm.sync(), "raas-router-llm-sync")

    def _add(self, rec: NodeRecord) -> None:
        assert rec.url is not None
        node = NodeState(record=rec, client=NodeClient(rec.url, token=self.config.token()))
        node.unreachable_since = time.monotonic()  # until its event stream is open
        self.nodes[rec.node_id] = node
        node.follower = asyncio.create_task(self._follow(node), name=f"raas-router-follow-{rec.node_id[:12]}")
        stale = self._lost_jobs.pop(rec.node_id, set())
        if stale:  # jobs moved away while it was gone: stop its copies
            self._spawn(self._cancel_copies(node, stale), "raas-router-cancel-copies")
        log.info("raas node %s at %s joined (capacity %d)", rec.node_id[:12], rec.url, rec.capacity)

    async def _lose(self, node: NodeState, reason: str) -> None:
        """Drop ``node``: its unfinished jobs go back to the queue (or fail after ``max_moves`` losses)."""
        self.nodes.pop(node.node_id, None)
        if node.follower is not None:
            node.follower.cancel()
            with contextlib.suppress(BaseException):
                await node.follower
        await node.client.close()
        moved = sorted(node.jobs)
        log.warning("raas node %s lost (%s): %d jobs to move", node.node_id[:12], reason, len(moved))
        if moved:
            self._lost_jobs.setdefault(node.node_id, set()).update(moved)
        for job_id in moved:
            t = self.jobs.get(job_id)
            if t is None or t.claimed:
                continue
            self._requeue(t, f"node {node.node_id} lost ({reason})")

    def _requeue(self, t: Tracked, why: str) -> None:
        """Back to the queue for another node, or failed once it has been moved ``max_moves`` times."""
        t.node = None
        t.moves += 1
        if t.moves > self.settings.max_moves:
            err = ErrorInfo(
                stage="router", kind="interrupted", message=f"moved {t.moves - 1} times; last: {why}"
            )
            self._spawn(self._finish_here(t, "failed", err), "raas-router-give-up")
            return
        now = time.time()
        t.set_status("queued", now)
        t.info = t.info.model_copy(update={"attempts": t.moves + 1})
        self.ledger.transition(t.job_id, "queued", now, f"moved: {why}")
        self.bus.publish(JobEvent(job_id=t.job_id, status="queued", at=now))
        self.queue.append(t.job_id)
        self._wake.set()

    # -- placement -------------------------------------------------------------------------------------

    def _pick(self) -> NodeState | None:
        now = time.monotonic()
        ready = [n for n in self.nodes.values() if n.connected and not n.draining and n.full_until <= now]
        return min(ready, key=lambda n: (n.load(), len(n.jobs), n.node_id)) if ready else None

    async def _dispatch_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)
            self._wake.clear()
            try:
                await self._dispatch()
            except Exception:
                log.exception("dispatch failed")

    async def _dispatch(self) -> None:
        """Hand queued jobs out, highest priority first: each is reserved on its node at once (so the
        next pick sees the load) and sent in a task of its own (hand-overs run in parallel)."""
        while self.queue:
            order = sorted(range(len(self.queue)), key=lambda i: (-self._priority(self.queue[i]), i))
            job_id = self.queue[order[0]]
            t = self.jobs.get(job_id)
            if t is None or t.claimed or t.node is not None:
                self.queue.remove(job_id)
                continue
            node = self._pick()
            if node is None:
                return  # no node can take it now; woken again by a result, a node or the 1 s tick
            self.queue.remove(job_id)
            t.node = node.node_id
            t.tried.add(node.node_id)
            node.jobs.add(job_id)
            self._spawn(self._send(t, node), "raas-router-send")

    def _priority(self, job_id: str) -> int:
        t = self.jobs.get(job_id)
        return t.info.priority if t is not None else 0

    def _unassign(self, t: Tracked, node: NodeState) -> None:
        """Undo a reservation whose hand-over failed: the job goes back to the front of the queue."""
        node.jobs.discard(t.job_id)
        if t.node == node.node_id and not t.claimed:
            t.node = None
            self.queue.insert(0, t.job_id)
        self._wake.set()

    async def _send(self, t: Tracked, node: NodeState) -> None:
        try:
            accepted = await node.client.submit({**t.request, "job_id": t.job_id})
        except NODE_DOWN as exc:
            log.info("node %s unreachable on submit: %s", node.url, exc)
            if node.connected:
                node.connected = False
                node.unreachable_since = time.monotonic()
            self._unassign(t, node)
            return
        except NodeError as exc:
            if exc.status in (400, 413, 422):
                node.jobs.discard(t.job_id)
                t.send_error = RaasError(exc.message, kind="bad_request", stage="api")
                err = ErrorInfo(stage="api", kind="bad_request", message=exc.message)
                await self._finish_here(t, "failed", err)
                t.sent.set()  # after the result is recorded: the caller's 400 finds it there
                return
            if exc.status == 503:
                node.draining = True  # shutting down; cleared when its stream opens again
            else:  # 429 (full) or an error of the node's own: give it a moment
                node.full_until = time.monotonic() + 0.5
            self._unassign(t, node)
            return
        if t.claimed or t.node != node.node_id or self.nodes.get(node.node_id) is not node:
            # Cancelled, finished or moved while the hand-over was in flight: stop this copy.
            node.jobs.discard(t.job_id)
            self._spawn(self._cancel_copies(node, {t.job_id}), "raas-router-cancel-copy")
            return
        self.ledger.transition(t.job_id, "queued", time.time(), f"node {node.node_id} {node.url}")
        t.sent.set()
        if is_terminal(accepted.status):  # it finished there before (an earlier run of this router)
            self._spawn(self._fetch_result(node, t.job_id), "raas-router-result")

    # -- jobs (the Served protocol) --------------------------------------------------------------------

    def _check_accepting(self) -> None:
        if not self._accepting:
            state = "shutting down" if self._stopped else "not started"
            raise NotAccepting(f"the router is {state}", stage="api")

    async def _admit(self, request: JobRequest) -> tuple[Tracked | None, SubmitResponse]:
        job_id = request.job_id or new_job_id()
        t = self.jobs.get(job_id)
        if t is not None:
            return None, SubmitResponse(job_id=job_id, status=t.info.status, created=False)
        job = Job(
            job_id=job_id,
            instance=request.instance,
            trajectory_id=str(request.instance.get("trajectory_id", job_id)),
        )
        body = request.model_copy(update={"job_id": None}).model_dump(mode="json", exclude={"job_id"})
        now = time.time()
        info = JobInfo(
            job_id=job_id,
            status="queued",
            data_source=job.data_source,
            instance_id=job.instance_id,
            trajectory_id=job.trajectory_id,
            priority=request.priority,
            created_at=now,
            updated_at=now,
        )
        t = Tracked(job_id=job_id, request=body, info=info)
        self.jobs[job_id] = t  # claimed synchronously: limits and idempotency see it at once
        try:
            existing = await self.ledger.insert_job(
                job_id=job_id,
                request=body,
                data_source=job.data_source,
                instance_id=job.instance_id,
                trajectory_id=job.trajectory_id,
                priority=request.priority,
                retry_on_restart=request.retry_on_restart,
                at=now,
            )
        except BaseException:
            self.jobs.pop(job_id, None)
            raise
        if existing is not None:
            self.jobs.pop(job_id, None)
            return None, SubmitResponse(job_id=job_id, status=cast(JobStatus, existing.status), created=False)
        self.bus.publish(JobEvent(job_id=job_id, status="queued", at=now))
        self.queue.append(job_id)
        self._wake.set()
        return t, SubmitResponse(job_id=job_id, status="queued", created=True)

    def _room(self, wanted: int) -> None:
        if len(self.jobs) + wanted > self.config.max_pending:
            raise Overloaded(
                f"the router is full ({len(self.jobs)} of {self.config.max_pending} jobs pending; "
                f"{wanted} more requested)",
                self.config.retry_after_s,
            )

    async def submit(self, request: JobRequest) -> SubmitResponse:
        """Accept a job durably (idempotent on ``job_id``), then wait up to ``submit_wait_s`` for its first
        hand-over, so that a job every node refuses as invalid is the caller's ``bad_request`` (its failed
        result stays in the ledger). With no node ready it is accepted and stays queued."""
        self._check_accepting()
        if request.job_id is None or request.job_id not in self.jobs:
            self._room(1)
        t, response = await self._admit(request)
        if t is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(t.sent.wait(), self.settings.submit_wait_s)
            if t.send_error is not None:
                raise t.send_error
        return response

    async def submit_many(self, requests: Sequence[JobRequest]) -> list[SubmitResponse]:
        """Accept a batch (all or nothing for room and duplicate ids). Validation is the nodes': a job a
        node refuses as invalid ends ``failed`` with ``bad_request``."""
        self._check_accepting()
        ids = [r.job_id for r in requests if r.job_id is not None]
        if len(ids) != len(set(ids)):
            raise RaasError("duplicate job_id within the batch", kind="bad_request", stage="api")
        self._room(sum(1 for r in requests if r.job_id is None or r.job_id not in self.jobs))
        return [resp for _, resp in await asyncio.gather(*(self._admit(r) for r in requests))]

    async def get(self, job_id: str) -> JobInfo:
        """The job's state: a job running on a node is asked there (the router follows only the ends of
        jobs, so the node knows the live stage); the router's own record otherwise."""
        t = self.jobs.get(job_id)
        if t is not None:
            node = self.nodes.get(t.node) if t.node else None
            if node is not None and t.sent.is_set() and not t.claimed:
                with contextlib.suppress(*NODE_FAILURES):
                    live = await node.client.get(job_id)
                    if not is_terminal(live.status):  # a finished one is reported once recorded here
                        t.set_status(live.status, live.updated_at)
                        return t.info.model_copy(update={"attempts": t.moves + 1})
            return t.info
        row = await self.ledger.get(job_id)
        if row is None:
            raise RaasError(f"no job {job_id!r}", kind="not_found", stage="api")
        return row.info()

    async def result(self, job_id: str) -> JobResult | None:
        t = self.jobs.get(job_id)
        if t is not None:
            return t.result
        return await stored_result(self.ledger, job_id)

    async def wait(self, job_id: str, timeout: float | None) -> JobResult | None:  # noqa: ASYNC109
        return await wait_result(self.jobs.get(job_id), timeout, lambda: self.result(job_id))

    async def cancel(self, job_id: str) -> JobInfo:
        """Cancel wherever the job is (its node's cancelled result becomes the job's); idempotent."""
        t = self.jobs.get(job_id)
        if t is None:
            return await self.get(job_id)
        node = self.nodes.get(t.node) if t.node else None
        if node is None:
            err = ErrorInfo(stage="queue", kind="cancelled", message="cancelled before it reached a node")
            await self._finish_here(t, "cancelled", err)
            return await self.get(job_id)
        with contextlib.suppress(*NODE_FAILURES):
            await node.client.cancel(job_id)
            await self._fetch_result(node, job_id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(t.done.wait()), self.config.cancel_grace_s + 1.0)
        return await self.get(job_id)

    @contextlib.asynccontextmanager
    async def events(self) -> AsyncIterator[Subscription]:
        async with self.bus.subscribe() as sub:
            yield sub

    def close_event_streams(self) -> None:
        self.bus.close()

    # -- state -------------------------------------------------------------------------------------------

    def node_table(self) -> list[dict[str, Any]]:
        return [
            {
                "node_id": n.node_id,
                "url": n.url,
                "host": n.record.host,
                "capacity": n.record.capacity,
                "jobs": len(n.jobs),
                "load": round(n.load(), 3),
                "healthy": n.connected and not n.draining,
                "llm_servers": sorted(n.llm),
            }
            for n in sorted(self.nodes.values(), key=lambda n: n.node_id)
        ]

    def status(self) -> dict[str, Any]:
        stages: dict[str, dict[str, int]] = {}
        for n in self.nodes.values():
            for name, st in (n.record.status.get("stages") or {}).items():
                agg = stages.setdefault(name, {"queued": 0, "active": 0, "workers": 0})
                for k in agg:
                    agg[k] += int(st.get(k, 0)) if isinstance(st, dict) else 0
        return {
            "accepting": self.accepting,
            "pending": len(self.jobs),
            "max_pending": self.config.max_pending,
            "stages": stages,
            "finished": dict(self.finished),
            "llm_servers": self.llm_servers(),
            "llm_available": True,
            "llm_paused": self.llm.paused,
            "unassigned": len(self.queue),
            "nodes": self.node_table(),
        }

    # -- inference servers (see raas.cluster.llm) ------------------------------------------------------

    def llm_servers(self) -> list[dict[str, Any]]:
        return self.llm.servers()

    async def add_llm_server(
        self, address: str, *, weight_version: str | None = None, kind: str = "auto"
    ) -> None:
        await self.llm.add(address, weight_version=weight_version, kind=kind)

    async def remove_llm_server(self, address: str) -> None:
        await self.llm.remove(address)

    async def clear_llm_servers(self) -> None:
        await self.llm.clear()

    async def pause_llm(self) -> None:
        await self.llm.pause()

    async def resume_llm(self) -> None:
        await self.llm.resume()
