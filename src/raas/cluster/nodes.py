"""What the router knows about a raas node and how it talks to one: plain HTTP on the node's native API."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from raas.core.jobs import JobEvent, JobInfo, JobResult, SubmitResponse
from raas.errors import RaasError

log = logging.getLogger("raas.cluster")


@dataclass
class NodeRecord:
    """One raas node service as the cluster's membership source reports it."""

    node_id: str
    url: str | None
    host: str | None
    capacity: int
    alive: bool
    pid: int | None = None
    status: dict[str, Any] = field(default_factory=dict)


class NodeSource(Protocol):
    """Where the router learns which nodes exist (:class:`raas.cluster.ray_nodes.RayNodeSource`)."""

    async def start(self) -> None: ...

    async def snapshot(self) -> list[NodeRecord]: ...

    async def close(self) -> None: ...


class StaticNodeSource:
    """A fixed list of node URLs (no Ray): for a router in front of services started some other way."""

    def __init__(self, urls: list[str], *, capacity: int = 8) -> None:
        self.records = [
            NodeRecord(
                node_id=f"static-{i}",
                url=u.rstrip("/"),
                host=httpx.URL(u).host,
                capacity=capacity,
                alive=True,
            )
            for i, u in enumerate(urls)
        ]

    async def start(self) -> None:
        return None

    async def snapshot(self) -> list[NodeRecord]:
        return list(self.records)

    async def close(self) -> None:
        return None


NODE_DOWN: tuple[type[Exception], ...] = (httpx.HTTPError, RuntimeError)
"""What a call to a node raises when the node is unreachable, or when the router dropped the node and
closed its client while the call was on its way (httpx raises ``RuntimeError`` then)."""


class NodeError(RaasError):
    """A node answered with an error (``status`` is the HTTP status; ``kind`` the node's error kind)."""

    def __init__(self, message: str, *, kind: str, status: int) -> None:
        super().__init__(message, kind=kind, stage="router")
        self.status = status


NODE_FAILURES: tuple[type[Exception], ...] = (*NODE_DOWN, NodeError)
"""Every way a call to a node can fail."""


class NodeClient:
    """The native API of one node. Connection failures raise ``httpx.TransportError`` (the router's
    reachability deadline counts them); error answers raise :class:`NodeError`."""

    def __init__(self, url: str, *, token: str | None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            # As many kept alive as may be open: no connection churn under a burst of hand-overs.
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=32),
            trust_env=False,
        )
        # Calls wait here rather than in httpx's pool, whose queue costs O(queued x connections) per
        # hand-off: a burst of hundreds of hand-overs would spend its time there. The event stream keeps
        # one connection of the pool for itself.
        self._slots = asyncio.Semaphore(24)

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        async with self._slots:
            return await self.http.request(method, path, **kwargs)

    async def close(self) -> None:
        await self.http.aclose()

    @staticmethod
    def _check(r: httpx.Response) -> Any:
        if r.status_code < 300:
            return r.json()
        kind, message = "internal", r.text[:500]
        try:
            body = r.json()
            err = body.get("error") or {}
            kind = err.get("kind") or kind
            message = err.get("message") or body.get("detail") or message
        except (ValueError, AttributeError):
            pass
        raise NodeError(str(message), kind=str(kind), status=r.status_code)

    async def submit(self, request: dict[str, Any]) -> SubmitResponse:
        return SubmitResponse.model_validate(
            self._check(await self._request("POST", "/v1/jobs", json=request))
        )

    async def get(self, job_id: str) -> JobInfo:
        return JobInfo.model_validate(self._check(await self._request("GET", f"/v1/jobs/{job_id}")))

    async def result(self, job_id: str) -> JobResult | None:
        r = await self._request("GET", f"/v1/jobs/{job_id}/result")
        if r.status_code == 202:
            return None
        return JobResult.model_validate(self._check(r))

    async def cancel(self, job_id: str) -> JobInfo:
        return JobInfo.model_validate(self._check(await self._request("DELETE", f"/v1/jobs/{job_id}")))

    async def status(self) -> dict[str, Any]:
        body: dict[str, Any] = self._check(await self._request("GET", "/status"))
        return body

    async def llm_servers(self) -> list[str]:
        body = self._check(await self._request("GET", "/v1/llm/servers"))
        return [str(s.get("address", "")).rstrip("/") for s in body.get("servers", [])]

    async def add_llm_server(self, address: str, *, weight_version: str | None, kind: str) -> None:
        body: dict[str, Any] = {"address": address, "kind": kind}
        if weight_version is not None:
            body["weight_version"] = weight_version
        self._check(await self._request("POST", "/v1/llm/servers", json=body))

    async def remove_llm_server(self, address: str) -> None:
        r = await self._request("DELETE", f"/v1/llm/servers/{quote(address, safe='')}")
        if r.status_code != 404:
            self._check(r)

    async def pause_llm(self) -> None:
        self._check(await self._request("POST", "/v1/llm:pause", timeout=None))

    async def resume_llm(self) -> None:
        self._check(await self._request("POST", "/v1/llm:resume"))

    async def events(self, on_open: Callable[[], None] | None = None) -> AsyncIterator[JobEvent]:
        """The node's job events (SSE) until the stream ends; raises on a broken connection. ``on_open``
        is called once the stream is established (every event after that is delivered)."""
        timeout = httpx.Timeout(None, connect=5.0, read=60.0)  # the node sends a keep-alive every 15 s
        params = {"terminal_only": "true"}  # the router needs the ends; live state is asked for (GET)
        async with self.http.stream("GET", "/v1/events", params=params, timeout=timeout) as r:
            if r.status_code != 200:
                await r.aread()
                self._check(r)
            kind = ""
            opened = False
            async for line in r.aiter_lines():
                if not opened:
                    # The node's first line (": connected") comes once its subscription exists.
                    opened = True
                    if on_open is not None:
                        on_open()
                if line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("data:") and kind == "job":
                    try:
                        yield JobEvent.model_validate(json.loads(line[5:]))
                    except ValueError:
                        log.warning("unreadable event from %s: %.200s", self.url, line)
                elif not line:
                    kind = ""
