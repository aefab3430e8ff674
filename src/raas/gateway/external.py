"""Rollouts whose agent runs outside raas: opened over the API, driven through ``/gateway``, closed by the
agent.

An external rollout is an ordinary job: it is submitted, goes through INIT, RUN and EVAL, and its result is
read like any other. Only its RUN stage differs. Instead of the handler running an agent, RUN opens a
gateway session for the job (the same session a ``harness`` job's sandboxed agent uses), hands its key to
whoever opened the rollout, and waits until the agent closes the rollout (with its final answer or patch)
or abandons it. The handler's EVAL then grades the record.

Lifetimes: the session belongs to the RUN stage that opened it and is closed when that stage ends, on every
path (close, lease expiry, job budget, cancel, shutdown); its key stops working at that moment. The lease
is an idle timeout: a rollout with no request in flight and none for ``lease_s`` seconds is abandoned
(the job ends ``cancelled``, filtered).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raas.agent.config import AgentConfig
from raas.core.jobs import Job
from raas.errors import RaasError

if TYPE_CHECKING:
    from raas.gateway.gateway import Gateway
    from raas.gateway.session import GatewaySession

DEFAULT_LEASE_S = 300.0
MAX_LEASE_S = 24 * 3600.0


@dataclass
class Closing:
    """What the agent sent when it closed its rollout."""

    answer: str | None = None
    patch: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class ExternalRollout:
    """One external rollout's hand-over point between the API (open, close) and its RUN stage."""

    def __init__(self, rollout_id: str, lease_s: float) -> None:
        self.id = rollout_id
        self.lease_s = lease_s
        self.opened: asyncio.Future[GatewaySession] = asyncio.get_running_loop().create_future()
        self.closing: Closing | None = None
        self.closed = asyncio.Event()
        self.ended_reason: str | None = None
        """Set when RUN is over: ``closed`` (by the agent) or ``abandoned`` (the lease ran out), ``ended``
        (the job stopped otherwise)."""
        self.recorded: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        """Set by the pipeline once the record RUN made of the close is committed to the ledger (True), or
        when the job ended before it was (False): the close is answered only then."""

    async def wait_recorded(self, timeout_s: float) -> bool:
        """Whether the close's record was committed (False also after ``timeout_s`` without an answer)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self.recorded), timeout_s)
        except TimeoutError:
            return False

    def fail_open(self, exc: BaseException) -> None:
        """The job ended before its RUN stage opened the session: tell whoever waits to open it."""
        if not self.opened.done():
            self.opened.set_exception(exc)
            self.opened.exception()  # retrieved: nobody may be waiting any more


class ExternalRollouts:
    """The gateway's external rollouts, by id (= the job id)."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._by_id: dict[str, ExternalRollout] = {}

    def expect(self, rollout_id: str, lease_s: float = DEFAULT_LEASE_S) -> ExternalRollout:
        """Register a rollout before its job is submitted, so its RUN stage knows to wait for an agent."""
        if rollout_id in self._by_id:
            raise RaasError(f"rollout {rollout_id} exists already", kind="bad_request", stage="api")
        rollout = ExternalRollout(rollout_id, lease_s)
        self._by_id[rollout_id] = rollout
        return rollout

    def get(self, rollout_id: str) -> ExternalRollout | None:
        return self._by_id.get(rollout_id)

    def forget(self, rollout_id: str, exc: BaseException | None = None) -> None:
        """Drop a rollout (its job ended, or was never accepted); a waiting opener gets ``exc``."""
        rollout = self._by_id.pop(rollout_id, None)
        if rollout is not None:
            rollout.fail_open(
                exc or RaasError("the rollout's job ended before it opened", kind="cancelled", stage="run")
            )

    def close(self, rollout_id: str, key: str | None, closing: Closing) -> ExternalRollout:
        """The agent closes its rollout: only with that rollout's own key, only while it runs."""
        rollout = self._by_id.get(rollout_id)
        session = (
            rollout.opened.result()
            if rollout is not None and rollout.opened.done() and not rollout.opened.exception()
            else None
        )
        if (
            rollout is None
            or session is None
            or key is None
            or not hmac.compare_digest(key.encode(), session.key.encode())
        ):
            raise RaasError(
                f"invalid API key for rollout {rollout_id} (unknown, closed, or another rollout's key)",
                kind="unauthorized",
                stage="run",
            )
        if session.closed or rollout.closing is not None:
            raise RaasError(f"rollout {rollout_id} is closed", kind="unauthorized", stage="run")
        rollout.closing = closing
        session.closed = True  # the key stops working now, before RUN wakes up to revoke it
        rollout.closed.set()
        return rollout

    async def serve(self, job: Job, agent: AgentConfig) -> tuple[GatewaySession, Closing | None]:
        """RUN of an external rollout: open the session, publish it, wait for the close or the lease's end.

        Returns the session (closed) and what the agent sent, or None when the lease ran out (abandoned)."""
        rollout = self._by_id.get(job.job_id)
        if rollout is None:
            raise RaasError(
                "this external rollout's agent connection is gone (the service restarted)",
                kind="interrupted",
                stage="run",
            )
        session = self.gateway.open_session(job, agent=agent)
        try:
            rollout.opened.set_result(session)
            while not rollout.closed.is_set():
                idle = time.monotonic() - session.last_active
                if session.in_flight == 0 and idle >= rollout.lease_s:
                    rollout.ended_reason = "abandoned"
                    return session, None
                wait = rollout.lease_s - idle if session.in_flight == 0 else rollout.lease_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(rollout.closed.wait(), max(wait, 0.01))
            rollout.ended_reason = "closed"
            # a request still generating when the agent closed is answered and recorded before the end
            await session.idle.wait()
            return session, rollout.closing
        finally:
            rollout.ended_reason = rollout.ended_reason or "ended"
            await self.gateway.close_session(session)
            self._by_id.pop(job.job_id, None)
