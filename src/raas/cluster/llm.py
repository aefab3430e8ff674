"""Node-aware inference servers for the router: each server is attached to the raas node on its own host
first (its traffic then stays on that machine), the rest spread over the nodes with the fewest, by
:func:`raas.core.placement.plan_llm_assignment`; pause and resume (weight sync) go to every node."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from raas.cluster.nodes import NODE_FAILURES, NodeError
from raas.cluster.state import NodeState
from raas.core.placement import plan_llm_assignment
from raas.errors import RaasError

log = logging.getLogger("raas.cluster.router")


class LLMAssignment:
    """The router's inference servers and which node uses each (``NodeState.llm``)."""

    def __init__(self, nodes: Callable[[], Iterable[NodeState]]) -> None:
        self._nodes = nodes
        self._servers: dict[str, tuple[str | None, str]] = {}  # address -> (weight_version, kind)
        self._lock = asyncio.Lock()
        self.paused = False

    def __bool__(self) -> bool:
        return bool(self._servers)

    def servers(self) -> list[dict[str, Any]]:
        where: dict[str, list[str]] = {}
        for n in self._nodes():
            for a in n.llm:
                where.setdefault(a, []).append(n.node_id)
        return [
            {"address": a, "weight_version": v, "kind": k, "nodes": sorted(where.get(a, []))}
            for a, (v, k) in self._servers.items()
        ]

    async def add(self, address: str, *, weight_version: str | None = None, kind: str = "auto") -> None:
        """Attach ``address`` (re-adding one updates its weight version on the nodes that use it)."""
        address = address.rstrip("/")
        self._servers[address] = (weight_version, kind)
        await self.sync(update=address)

    async def remove(self, address: str) -> None:
        address = address.rstrip("/")
        if address not in self._servers:
            raise RaasError(f"no LLM server {address!r}", kind="not_found", stage="api")
        del self._servers[address]
        await self.sync()

    async def clear(self) -> None:
        self._servers.clear()
        await self.sync()

    async def sync(self, update: str | None = None) -> None:
        """Bring every node's servers to the plan (after a change of servers or of nodes); a node that
        joined while the servers are paused is paused too."""
        async with self._lock:
            nodes = {n.url: n for n in self._nodes() if n.url}
            plan = plan_llm_assignment(sorted(nodes), list(self._servers))
            for url, node in nodes.items():
                want = set(plan.get(url, []))
                try:
                    for address in sorted(node.llm - want):
                        await node.client.remove_llm_server(address)
                        node.llm.discard(address)
                    for address in plan.get(url, []):
                        if address in node.llm and address != update:
                            continue
                        version, kind = self._servers[address]
                        await node.client.add_llm_server(address, weight_version=version, kind=kind)
                        node.llm.add(address)
                    if self.paused and not node.llm_paused:
                        await node.client.pause_llm()
                        node.llm_paused = True
                except NODE_FAILURES as exc:
                    log.warning("could not update the LLM servers of %s: %s", url, exc)

    async def pause(self) -> None:
        """Pause every node's generate calls (weight sync); returns once their in-flight calls finished."""
        self.paused = True
        await self._fan_out("pause_llm", True)

    async def resume(self) -> None:
        self.paused = False
        await self._fan_out("resume_llm", False)

    async def _fan_out(self, op: str, paused: bool) -> None:
        nodes = list(self._nodes())
        outcomes = await asyncio.gather(*(getattr(n.client, op)() for n in nodes), return_exceptions=True)
        for node, outcome in zip(nodes, outcomes, strict=True):
            if isinstance(outcome, NodeError):
                raise RaasError(f"{op} on {node.url}: {outcome.message}", kind=outcome.kind, stage="api")
            if isinstance(outcome, BaseException):
                log.warning("%s on %s failed: %s", op, node.url, outcome)
            else:
                node.llm_paused = paused
