"""Inference-server control over every raas service at once: pause/resume, weight versions, weight syncs
and node-aware placement (mixed into :class:`~raas.trainer.rollout.RolloutClient`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from raas.errors import RaasError
from raas.trainer.placement import plan_llm_assignment
from raas.trainer.records import ServiceState

log = logging.getLogger(__name__)


class LLMControl:
    """Needs ``self._services`` (a list of :class:`ServiceState`) and ``self.weight_version``."""

    _services: list[ServiceState]
    weight_version: str | None

    async def _each(self, what: str, fn: Callable[[ServiceState], Awaitable[Any]]) -> list[Any]:
        """Run ``fn`` on every service not known dead, concurrently. A service that cannot be reached is
        skipped (the health check takes it out, and it gets the current weight version when it is back);
        any other error is raised."""
        targets = [s for s in self._services if not s.dead]
        outcomes = await asyncio.gather(*(fn(s) for s in targets), return_exceptions=True)
        for service, outcome in zip(targets, outcomes, strict=True):
            if isinstance(outcome, RaasError) and outcome.kind in ("unavailable", "timeout"):
                log.warning("raas service %s unreachable during %s: %s", service.url, what, outcome)
                service.healthy = False
            elif isinstance(outcome, BaseException):
                raise outcome
        return list(outcomes)

    async def pause(self) -> None:
        """``POST /v1/llm:pause`` on every service: returns once no generate call is in flight anywhere
        (running turns finish; none is aborted)."""
        await self._each("pause", lambda s: s.client.pause())

    async def resume(self) -> None:
        await self._each("resume", lambda s: s.client.resume())

    async def _set_version_on(self, service: ServiceState, version: str) -> None:
        body = await service.client.servers()
        for server in (body or {}).get("servers", []):
            await service.client.add_server(str(server["address"]), weight_version=version)

    async def set_weight_version(self, version: str) -> None:
        """Stamp ``version`` on every inference server of every service (call it while paused)."""
        self.weight_version = version
        await self._each("set_weight_version", lambda s: self._set_version_on(s, version))

    async def weight_sync(self, version: str, sync: Callable[[], Awaitable[Any]] | None = None) -> None:
        """Pause every service, run ``sync`` (load the new weights into the inference servers), stamp
        ``version``, resume. Turns that were generating finish with the old weights and keep the old
        version; every turn after the resume carries the new one."""
        await self.pause()
        try:
            if sync is not None:
                await sync()
            await self.set_weight_version(version)
        finally:
            await self.resume()

    async def assign_llm_servers(
        self,
        llm_servers: Sequence[str],
        *,
        hosts: dict[str, str] | None = None,
        weight_version: str | None = None,
        replace: bool = True,
    ) -> dict[str, list[str]]:
        """Attach inference servers node-aware (:func:`plan_llm_assignment`) through each service's
        ``/v1/llm/servers``; ``replace`` removes servers a service had that the plan does not give it."""
        plan = plan_llm_assignment([s.url for s in self._services], llm_servers, hosts=hosts)
        version = weight_version if weight_version is not None else self.weight_version

        async def apply(service: ServiceState) -> None:
            wanted = plan.get(service.url, [])
            if replace:
                current = (await service.client.servers() or {}).get("servers", [])
                for server in current:
                    if str(server["address"]).rstrip("/") not in {w.rstrip("/") for w in wanted}:
                        await service.client.remove_server(str(server["address"]))
            for address in wanted:
                await service.client.add_server(address, weight_version=version)

        await self._each("assign_llm_servers", apply)
        return plan
