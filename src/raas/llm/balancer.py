"""Balance generate calls over many inference servers.

Each trajectory is pinned to one server (its prefix stays in that server's KV cache). Its first request
goes where the routing policy (:mod:`raas.llm.routing`) says: by default to its GRPO group's home server
while the home's load allows (the group's shared prompt is then prefilled once), else to the server with
the fewest in-flight requests, ties rotating. A server that stops answering is marked unhealthy, its
trajectories fail over to the others, and a background health check brings it back.

Weight sync is exact: every ``generate()`` call is admitted through a gate that ``pause()`` takes as a
writer. A call counts as in flight from admission until it returns, across all its attempts (retries,
failover to another server, the health check it may run when no server is healthy), so ``pause()``
returns only when no admitted call can still send anything; calls arriving while paused wait for
``resume()``. Between ``pause()`` returning and ``resume()`` the balancer sends nothing to any server
(the background health check skips its rounds too), and every result is stamped with the weight version
its server had when the attempt that produced it was sent.

Every attempt is timed into ``raas_llm_attempt_seconds{server, outcome}``: ``ok``, ``failover`` (the
server failed and the call moved on to another), ``error`` (the call failed with this attempt) or
``cancelled``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from raas.core.metrics import observe_llm_attempt
from raas.errors import RaasError
from raas.llm.routing import GroupHomes, RoutingConfig
from raas.llm.servers import ServerClient, detect_kind, make_client
from raas.llm.servers.base import TextSink
from raas.llm.types import GenerateResult, LLMUnavailable, SamplingParams


@dataclass
class _Server:
    address: str
    kind: str
    weight_version: str | None
    client: ServerClient | None = None
    healthy: bool = True
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    last_error: str | None = None
    pinned: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class LLMBalancer:
    """Registry of inference servers plus routing; use as ``async with LLMBalancer() as b``."""

    def __init__(
        self,
        *,
        http: httpx.AsyncClient | None = None,
        request_timeout_s: float = 600.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        health_interval_s: float = 5.0,
        max_failovers: int = 3,
        routing: RoutingConfig | None = None,
    ) -> None:
        self._own_http = http is None
        self.http = http or httpx.AsyncClient(
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=128)
        )
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.health_interval_s = health_interval_s
        self.max_failovers = max_failovers
        self._servers: dict[str, _Server] = {}
        self._pins: dict[str, str] = {}
        self.routing = routing or RoutingConfig()
        self._groups = GroupHomes(self.routing.idle_groups)
        self._rotation = itertools.count()
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._admitted = 0
        self._health_task: asyncio.Task[None] | None = None
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------------------
    async def __aenter__(self) -> LLMBalancer:
        self.start_health_checks()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start_health_checks(self) -> None:
        """Probe every server every ``health_interval_s`` (unhealthy ones come back when they answer)."""
        if self._health_task is None and self.health_interval_s > 0:
            self._health_task = asyncio.create_task(self._health_loop(), name="raas-llm-health")

    async def aclose(self) -> None:
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        if self._own_http:
            await self.http.aclose()

    # -- registry ----------------------------------------------------------------------------------
    def add(self, address: str, weight_version: str | None = None, kind: str = "auto") -> None:
        """Register a server (its kind is detected on first use when ``auto``); re-adding updates
        the weight version."""
        address = address.rstrip("/")
        if not address.startswith(("http://", "https://")):
            raise RaasError(f"server address must be an http(s) URL, got {address!r}", kind="bad_request")
        if address in self._servers:
            self._servers[address].weight_version = weight_version
            return
        self._servers[address] = _Server(address, kind, weight_version)

    def remove(self, address: str) -> None:
        """Forget a server; its trajectories move elsewhere on their next turn."""
        state = self._servers.pop(address.rstrip("/"), None)
        if state is not None:
            for tid in state.pinned:
                self._pins.pop(tid, None)
            self._groups.forget_address(state.address)

    def clear(self) -> None:
        self._servers.clear()
        self._pins.clear()
        self._groups.clear()

    def set_weight_version(self, weight_version: str | None, address: str | None = None) -> None:
        """Stamp a new weight version on one server, or on all of them."""
        for state in self._servers.values():
            if address is None or state.address == address.rstrip("/"):
                state.weight_version = weight_version

    def servers(self) -> list[dict[str, Any]]:
        return [
            {
                "address": s.address,
                "kind": s.kind,
                "weight_version": s.weight_version,
                "healthy": s.healthy,
                "in_flight": s.in_flight,
                "requests": s.requests,
                "failures": s.failures,
                "pinned": len(s.pinned),
                "groups": self._groups.live_on(s.address),
                "cached_tokens": s.cached_tokens,
                "prompt_tokens": s.prompt_tokens,
                "last_error": s.last_error,
            }
            for s in self._servers.values()
        ]

    def pinned_server(self, trajectory_id: str) -> str | None:
        return self._pins.get(trajectory_id)

    def group_home(self, group_id: str) -> str | None:
        """The server the group's new trajectories go to while its load allows (``group`` routing)."""
        return self._groups.home(group_id, touch=False)

    def group_counts(self) -> dict[str, int]:
        """Groups with live trajectories, idle groups still remembered, trajectories in live groups."""
        return self._groups.counts()

    def release(self, trajectory_id: str) -> None:
        """The trajectory is done: unpin it (its group becomes idle once all its trajectories are)."""
        address = self._pins.pop(trajectory_id, None)
        if address and address in self._servers:
            self._servers[address].pinned.discard(trajectory_id)
        self._groups.leave(trajectory_id)

    @property
    def in_flight(self) -> int:
        """``generate()`` calls admitted and not yet returned (each counts once, whatever its attempts)."""
        return self._admitted

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    # -- weight sync -------------------------------------------------------------------------------
    async def pause(self) -> None:
        """Stop admitting ``generate()`` calls and wait until every admitted one has returned, all its
        retries and failovers included. When this returns, nothing is sent to any server until
        :meth:`resume`."""
        self._open.clear()
        while self._admitted:
            await self._idle.wait()

    def resume(self) -> None:
        self._open.set()

    async def _admit(self) -> None:
        # Event.wait() can return after a later pause() cleared the gate again: re-check before counting.
        while not self._open.is_set():
            await self._open.wait()
        self._admitted += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._admitted -= 1
        if self._admitted == 0:
            self._idle.set()

    # -- routing -----------------------------------------------------------------------------------
    def _candidates(self, exclude: set[str]) -> list[_Server]:
        return [s for s in self._servers.values() if s.healthy and s.address not in exclude]

    def _choose(self, exclude: set[str]) -> _Server | None:
        candidates = self._candidates(exclude)
        if not candidates:
            return None
        least = min(s.in_flight for s in candidates)
        tied = [s for s in candidates if s.in_flight == least]
        return tied[next(self._rotation) % len(tied)]

    def _route(self, trajectory_id: str | None, group_id: str | None, exclude: set[str]) -> _Server | None:
        """The server for the next attempt: the trajectory's own, else per the routing mode."""
        mode = self.routing.mode
        if mode == "round_robin":
            candidates = self._candidates(exclude)
            return candidates[next(self._rotation) % len(candidates)] if candidates else None
        if trajectory_id is not None:
            pinned = self._servers.get(self._pins.get(trajectory_id, ""))
            if pinned is not None and pinned.healthy and pinned.address not in exclude:
                return pinned
        if mode != "group" or group_id is None:
            return self._choose(exclude)
        if trajectory_id is not None:  # the group stays live until all its trajectories are released
            self._groups.join(group_id, trajectory_id)
        candidates = self._candidates(exclude)
        if not candidates:
            return None
        home = self._servers.get(self._groups.home(group_id) or "")
        if home is not None and home.healthy and home.address not in exclude:
            least = min(s.in_flight for s in candidates)
            if self.routing.home_has_room(home.in_flight, least):
                return home
            return self._choose(exclude)  # spill: this trajectory goes elsewhere, the home stays
        chosen = self._choose(exclude)
        if chosen is not None:  # new group, or its home is gone, unhealthy or failed this call: move it
            self._groups.set_home(group_id, chosen.address)
        return chosen

    def _pin(self, trajectory_id: str, state: _Server) -> None:
        old = self._pins.get(trajectory_id)
        if old == state.address:
            return
        if old and old in self._servers:
            self._servers[old].pinned.discard(trajectory_id)
        self._pins[trajectory_id] = state.address
        state.pinned.add(trajectory_id)

    async def _client(self, state: _Server) -> ServerClient:
        async with state.lock:
            if state.client is None:
                kind = state.kind
                if kind == "auto":
                    kind = await detect_kind(state.address, self.http)
                    state.kind = kind
                state.client = make_client(
                    kind,
                    state.address,
                    self.http,
                    request_timeout_s=self.request_timeout_s,
                    retries=self.retries,
                    backoff_s=self.backoff_s,
                )
            return state.client

    def _mark_unhealthy(self, state: _Server, error: str) -> None:
        state.healthy = False
        state.failures += 1
        state.last_error = error
        for tid in list(state.pinned):
            if self._pins.get(tid) == state.address:
                del self._pins[tid]
        state.pinned.clear()

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        trajectory_id: str | None = None,
        group_id: str | None = None,
        on_text: TextSink | None = None,
    ) -> GenerateResult:
        """Generate on the trajectory's server (pinning it on first use; ``group_id``, the GRPO group's
        key, picks that first server under ``group`` routing), failing over on errors that mean the
        server is gone. Waits while the balancer is paused. ``on_text``: stream the text as it is
        generated, where the server kind can (:attr:`ServerClient.streams`)."""
        sampling = sampling or SamplingParams()
        await self._admit()
        try:
            return await self._generate(prompt_ids, sampling, trajectory_id, group_id, on_text)
        finally:
            self._leave()

    async def _generate(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        trajectory_id: str | None,
        group_id: str | None,
        on_text: TextSink | None = None,
    ) -> GenerateResult:
        tried: set[str] = set()
        last_error = "no inference server registered"
        failed: tuple[str, float] | None = None  # the last attempt that failed over: (server, seconds)
        try:
            for _ in range(self.max_failovers + 1):
                state = self._route(trajectory_id, group_id, tried)
                if state is None and not tried:
                    await self.check_health()
                    state = self._route(trajectory_id, group_id, tried)
                if state is None:
                    break
                if failed is not None:
                    observe_llm_attempt(failed[0], failed[1], "failover")
                    failed = None
                if trajectory_id is not None and self.routing.mode != "round_robin":
                    self._pin(trajectory_id, state)
                tried.add(state.address)
                version = state.weight_version
                state.in_flight += 1
                started = time.perf_counter()
                outcome = "error"
                try:
                    client = await self._client(state)
                    if on_text is None:
                        result = await client.generate(prompt_ids, sampling)
                    else:
                        result = await client.generate(prompt_ids, sampling, on_text)
                    outcome = "ok"
                except RaasError as exc:
                    if exc.kind != "llm_unavailable":  # the server is there; the request is at fault
                        raise
                    last_error = exc.message
                    self._mark_unhealthy(state, exc.message)
                    outcome = "unavailable"
                    continue
                except asyncio.CancelledError:
                    outcome = "cancelled"
                    raise
                finally:
                    state.in_flight -= 1
                    elapsed = time.perf_counter() - started
                    if outcome == "unavailable":
                        failed = (state.address, elapsed)
                    else:
                        observe_llm_attempt(state.address, elapsed, outcome)
                state.requests += 1
                state.prompt_tokens += len(prompt_ids)
                if result.cached_tokens:
                    state.cached_tokens += int(result.cached_tokens)
                if version is not None:
                    result.weight_version = version
                elif result.extra.get("weight_version") is not None:
                    result.weight_version = str(result.extra["weight_version"])
                return result
        finally:
            if failed is not None:  # nothing was left to fail over to
                observe_llm_attempt(failed[0], failed[1], "error")
        raise LLMUnavailable(f"no healthy inference server could serve the request: {last_error}")

    # -- health ------------------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Probe all servers now; mark each healthy or not."""
        states = list(self._servers.values())
        results = await asyncio.gather(*(self._probe(s) for s in states))
        for state, ok in zip(states, results, strict=True):
            if ok:
                state.healthy = True
            elif state.healthy:
                self._mark_unhealthy(state, "health check failed")

    async def _probe(self, state: _Server) -> bool:
        try:
            client = await self._client(state)
        except RaasError:
            return False
        return await client.health()

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_interval_s)
            if self.paused:  # weights are being swapped: a probe now would only mark servers unhealthy
                continue
            with contextlib.suppress(Exception):
                await self.check_health()
