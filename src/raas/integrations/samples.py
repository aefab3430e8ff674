"""One trainer sample is one raas job: submit it, wait for it, and turn the result into the flat token
record every trainer's batch is built from.

Shared by the trainer plugins so that they agree on what a sample is: the token-exact prompt and response,
a mask that is 1 only on sampled tokens, the sampling logprobs, the reward, and whether the sample may be
trained on at all. A filtered result (an infrastructure failure, a timeout, a cancel) is resubmitted a few
times and otherwise comes back ``usable=False`` with no reward: each plugin then drops or masks it in its
trainer's own way.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raas.core.jobs import JobResult
from raas.errors import RaasError
from raas.trainer.client import RaasClient

log = logging.getLogger(__name__)

RAAS_URL_ENV = "RAAS_URL"
"""Where the plugins find raas when their trainer's configuration does not say: one URL, or several
separated by commas (one raas service per node)."""


def urls_from(value: str | Sequence[str] | None) -> list[str]:
    """The raas URLs from a config value, else from ``$RAAS_URL``; a clear error when neither is set."""
    if value is None or value == "" or value == []:
        value = os.environ.get(RAAS_URL_ENV, "")
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value]
    urls = [u.strip().rstrip("/") for u in items if u.strip()]
    if not urls:
        raise RaasError(
            f"no raas URL: set it in the trainer's configuration or in ${RAAS_URL_ENV}", kind="bad_request"
        )
    return urls


@dataclass
class Rollout:
    """One sample as a trainer needs it. ``response_mask`` is 1 exactly on the tokens the policy sampled
    (tool observations and chat-template tokens between turns are 0); ``logprobs`` holds the sampling
    logprob of each response token (0.0 where the mask is 0 or the server reported none:
    ``logprobs_missing``)."""

    job_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    reward: float | None
    usable: bool
    """False when the sample must not be trained on: filtered by raas (never a reward), or a result this
    trainer's rows cannot hold (``unusable_reason`` says which)."""
    unusable_reason: str | None = None
    logprobs_missing: bool = False
    num_turns: int = 0
    finish_reason: str | None = None
    weight_versions: list[str] = field(default_factory=list)
    timing: dict[str, float] = field(default_factory=dict)
    attempts: int = 1
    result: JobResult | None = None

    @property
    def stop_reason(self) -> str:
        """``length`` when the last turn was cut by its token budget, else ``stop``."""
        return "length" if self.finish_reason in ("length", "context_budget") else "stop"


def rollout_from_result(result: JobResult, *, attempts: int = 1) -> Rollout:
    """The sample a finished job gives. A result with several token segments (an agent that rewrote its
    history) does not fit one row: it comes back unusable with a reason saying so, never cut to one
    segment (that would train on a sequence the policy never saw as one)."""
    tt = result.token_trajectory
    versions = [t.weight_version for t in result.turns if t.weight_version is not None]
    finish = next((str(t.finish_reason) for t in reversed(result.turns) if t.finish_reason), None)
    common: dict[str, Any] = {
        "job_id": result.job_id,
        "num_turns": len(result.turns),
        "finish_reason": finish,
        "weight_versions": versions,
        "timing": result.timing.model_dump(),
        "attempts": attempts,
        "result": result,
    }
    reason: str | None = None
    if result.filter or result.reward is None:
        kind = result.error.kind if result.error else "no_reward"
        reason = f"filtered ({result.status}, {kind})"
    elif len(result.segments) > 1:
        reason = f"{len(result.segments)} token segments (the agent rewrote its history): one row holds one"
    elif not tt.prompt_ids:
        reason = "empty prompt"
    elif not (len(tt.response_ids) == len(tt.loss_mask) == len(tt.logprobs)):
        reason = "response, mask and logprobs differ in length"
    if reason is not None:
        return Rollout(
            prompt_ids=list(tt.prompt_ids),
            response_ids=[],
            response_mask=[],
            logprobs=[],
            reward=None,
            usable=False,
            unusable_reason=reason,
            **common,
        )
    missing = any(lp is None and m for lp, m in zip(tt.logprobs, tt.loss_mask, strict=True))
    return Rollout(
        prompt_ids=list(tt.prompt_ids),
        response_ids=list(tt.response_ids),
        response_mask=[int(m) for m in tt.loss_mask],
        logprobs=[
            float(lp) if lp is not None and m else 0.0
            for lp, m in zip(tt.logprobs, tt.loss_mask, strict=True)
        ],
        reward=float(result.reward) if result.reward is not None else None,
        usable=True,
        logprobs_missing=missing,
        **common,
    )


class RaasSampler:
    """Runs samples as raas jobs over one or more raas services (a group stays on one service, chosen by
    its id, so a GRPO group's samples share their service's balancer and its sticky servers).

    ``max_resubmits``: how many times a filtered sample is run again (as a new job) before it is given
    up as unusable; ``job_timeout_s`` is each job's own deadline on the service."""

    def __init__(
        self,
        urls: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        max_resubmits: int = 2,
        job_timeout_s: float | None = None,
        wait_timeout_s: float | None = None,
        priority: int | None = None,
    ) -> None:
        self.urls = urls_from(urls)
        self.max_resubmits = max_resubmits
        self.job_timeout_s = job_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.priority = priority
        self._clients = [RaasClient(u, token=token) for u in self.urls]

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self._clients), return_exceptions=True)

    async def __aenter__(self) -> RaasSampler:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def client_for(self, group_id: str) -> RaasClient:
        digest = hashlib.sha256(group_id.encode()).digest()
        return self._clients[int.from_bytes(digest[:4], "big") % len(self._clients)]

    @property
    def clients(self) -> list[RaasClient]:
        return list(self._clients)

    async def run(
        self,
        instance: dict[str, Any],
        *,
        group_id: str,
        trajectory_id: int,
        sampling_params: dict[str, Any] | None = None,
        job_id: str | None = None,
        max_resubmits: int | None = None,
        job_timeout_s: float | None = None,
    ) -> Rollout:
        """Run one sample to the end; resubmits a filtered one up to ``max_resubmits`` times (the
        sampler's unless given). Job ids are ``<job_id or group.trajectory>.<attempt>``, so a retried
        trainer call finds its job again."""
        client = self.client_for(group_id)
        base = job_id or f"{group_id}.{trajectory_id}"
        body_instance = {**instance, "group_id": group_id, "trajectory_id": trajectory_id}
        resubmits = self.max_resubmits if max_resubmits is None else max_resubmits
        rollout: Rollout | None = None
        for attempt in range(resubmits + 1):
            jid = f"{base}.{attempt}"
            await client.submit(
                body_instance,
                sampling_params=sampling_params,
                job_id=jid,
                timeout_s=job_timeout_s if job_timeout_s is not None else self.job_timeout_s,
                priority=self.priority,
            )
            raw = await client.wait(jid, timeout_s=self.wait_timeout_s)
            rollout = rollout_from_result(JobResult.model_validate(raw), attempts=attempt + 1)
            if rollout.usable or not (rollout.result and rollout.result.filter):
                return rollout
            log.warning(
                "raas job %s %s; %s",
                jid,
                rollout.unusable_reason,
                "resubmitting" if attempt < resubmits else "giving the sample up",
            )
        assert rollout is not None
        return rollout

    async def pause(self) -> None:
        """Hold new generate calls on every service (returns once none is in flight)."""
        await asyncio.gather(*(c.pause() for c in self._clients))

    async def resume(self) -> None:
        await asyncio.gather(*(c.resume() for c in self._clients))

    async def set_servers(self, addresses: Sequence[str], weight_version: str | None = None) -> None:
        """Make ``addresses`` the inference servers of every service (added or re-stamped with
        ``weight_version``; servers not listed are removed)."""
        wanted = [normalize_address(a) for a in addresses]

        async def one(client: RaasClient) -> None:
            body = await client.servers()
            have = {str(s["address"]) for s in (body or {}).get("servers", [])}
            for address in wanted:
                await client.add_server(address, weight_version=weight_version)
            for address in have - set(wanted):
                await client.remove_server(address)

        await asyncio.gather(*(one(c) for c in self._clients))

    async def set_weight_version(self, version: str) -> None:
        """Stamp ``version`` on every inference server of every service (call it while paused)."""

        async def one(client: RaasClient) -> None:
            body = await client.servers()
            for server in (body or {}).get("servers", []):
                await client.add_server(str(server["address"]), weight_version=version)

        await asyncio.gather(*(one(c) for c in self._clients))


def normalize_address(address: str) -> str:
    """``host:port`` (how verl and SkyRL name their servers) as the URL raas registers."""
    address = address.strip().rstrip("/")
    return address if "://" in address else f"http://{address}"


_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[Any, ...], RaasSampler]] = (
    weakref.WeakKeyDictionary()
)


def shared_sampler(
    urls: str | Sequence[str] | None, *, max_resubmits: int = 2, job_timeout_s: float | None = None
) -> RaasSampler:
    """The sampler for these settings on the running event loop. Trainers build a plugin object per sample
    (verl's agent loops) or run each batch under a fresh ``asyncio.run`` (SkyRL), and an HTTP client
    belongs to one loop: one sampler per loop and settings, dropped with its loop."""
    loop = asyncio.get_running_loop()
    samplers = _per_loop.setdefault(loop, {})
    key = (tuple(urls_from(urls)), max_resubmits, job_timeout_s)
    sampler = samplers.get(key)
    if sampler is None:
        sampler = RaasSampler(list(key[0]), max_resubmits=max_resubmits, job_timeout_s=job_timeout_s)
        samplers[key] = sampler
    return sampler
