"""raas as an AReaL 1.0.4 rollout workflow: an AReaL user passes ``"raas.integrations.areal.RaasWorkflow"``
as the ``workflow`` of ``PPOTrainer.train`` (or of ``rollout_batch``/``prepare_batch``), with its options
in ``workflow_kwargs``; nothing else in AReaL changes.

AReaL's workflow executor calls :meth:`RaasWorkflow.arun_episode` once per sample (``GroupedRolloutWorkflow``
runs it ``gconfig.n_samples`` times per prompt). Each call is one raas job on the inference servers the
AReaL engine was given (``engine.addresses``), stamped with the engine's weight version; it returns the
trajectory in the layout AReaL's own workflows produce (``input_ids``, ``loss_mask``, ``logprobs``,
``versions``, ``attention_mask``, ``rewards``; ``[1, L]``), or ``None`` for a sample raas filtered, which
is AReaL's own way to reject a sample: the executor drops it and never trains on it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
import weakref
from collections import deque
from typing import Any

import torch
from areal.api.workflow_api import RolloutWorkflow

from raas.errors import RaasError
from raas.integrations.samples import RaasSampler, Rollout, urls_from
from raas.trainer.types import version_number

log = logging.getLogger(__name__)

# One sampler and one registration state per event loop and raas (AReaL's executor runs episodes on a loop
# of its own); dropped with their loop.
_state: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, ...], _Registration]] = (
    weakref.WeakKeyDictionary()
)


class _Registration:
    """What this process last told raas: the servers and the weight version."""

    def __init__(self, sampler: RaasSampler) -> None:
        self.sampler = sampler
        self.servers: tuple[str, ...] = ()
        self.version: int | None = None
        self.lock = asyncio.Lock()
        self.samples_of: dict[str, int] = {}
        """How many samples of each group this process has started (the ``n`` of a GRPO group)."""
        self.nonce = uuid.uuid4().hex[:8]
        """In every job id: a data item seen again (next epoch, another process) never reuses a job."""
        self.recent_jobs: deque[str] = deque(maxlen=100_000)
        """The raas job of each episode this process ran, newest last (to find a sample's job)."""

    def next_index(self, group_id: str) -> int:
        if len(self.samples_of) > 100_000:
            self.samples_of.clear()
        index = self.samples_of.get(group_id, 0)
        self.samples_of[group_id] = index + 1
        return index


def _digest(instance: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(instance, sort_keys=True, default=str).encode()).hexdigest()[:16]


def token_versions(rollout: Rollout) -> list[int]:
    """AReaL's ``versions`` for the response: each sampled token carries the weight version of the turn
    that sampled it, every other token -1."""
    result = rollout.result
    if result is None:
        return [-1] * len(rollout.response_ids)
    out: list[int] = []
    for k, turn in enumerate(result.turns):
        if k > 0:
            out += [-1] * len(turn.prompt_ids)
        version = version_number(turn.weight_version)
        out += [-1 if version is None else version] * len(turn.output_ids)
    if len(out) != len(rollout.response_ids):
        raise RaasError(
            f"raas job {rollout.job_id}: its turns do not add up to its response", kind="internal"
        )
    return [v if m else -1 for v, m in zip(out, rollout.response_mask, strict=True)]


def trajectory(rollout: Rollout) -> dict[str, torch.Tensor]:
    """One sample as AReaL's workflows return it: 1-row tensors over prompt + response."""
    p, r = len(rollout.prompt_ids), len(rollout.response_ids)
    ids = rollout.prompt_ids + rollout.response_ids
    return {
        "input_ids": torch.tensor([ids], dtype=torch.int32),
        "loss_mask": torch.tensor([[0] * p + rollout.response_mask], dtype=torch.int32),
        "logprobs": torch.tensor([[0.0] * p + rollout.logprobs], dtype=torch.float32),
        "versions": torch.tensor([[-1] * p + token_versions(rollout)], dtype=torch.int32),
        "attention_mask": torch.ones((1, p + r), dtype=torch.bool),
        "rewards": torch.tensor([float(rollout.reward or 0.0)], dtype=torch.float32),
    }


class RaasWorkflow(RolloutWorkflow):
    """Each episode is a raas job. ``workflow_kwargs``: ``raas_url`` (else ``$RAAS_URL``),
    ``sampling_params`` (raas's: temperature, top_p, ...), ``max_resubmits`` (a filtered sample is run
    again this many times before it is rejected), ``job_timeout_s``. The data item carries the raas
    instance as ``raas_instance`` (a dict or its JSON); ``raas_group_id`` names its GRPO group (else the
    instance's digest does: the samples AReaL runs for one data item form one group)."""

    def __init__(
        self,
        raas_url: str | list[str] | None = None,
        sampling_params: dict[str, Any] | None = None,
        max_resubmits: int = 2,
        job_timeout_s: float | None = None,
    ) -> None:
        self.raas_url = raas_url
        self.sampling_params = dict(sampling_params or {})
        self.max_resubmits = int(max_resubmits)
        self.job_timeout_s = job_timeout_s
        self.rejected = 0

    def _registration(self) -> _Registration:
        urls = tuple(urls_from(self.raas_url))
        registrations = _state.setdefault(asyncio.get_running_loop(), {})
        reg = registrations.get(urls)
        if reg is None:
            reg = registrations[urls] = _Registration(RaasSampler(list(urls)))
        return reg

    async def _sync_servers(self, reg: _Registration, engine: Any) -> None:
        """Tell raas the engine's servers and weight version when either changed since the last episode
        (AReaL bumps the version with ``set_version`` after each weight update)."""
        servers = tuple(str(a) for a in getattr(engine, "addresses", []) or [])
        version = int(engine.get_version())
        if servers == reg.servers and version == reg.version:
            return
        async with reg.lock:
            if servers != reg.servers or version != reg.version:
                await reg.sampler.set_servers(list(servers), weight_version=str(version))
                reg.servers, reg.version = servers, version

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        instance = data.get("raas_instance")
        if isinstance(instance, str):
            instance = json.loads(instance)
        if not isinstance(instance, dict):
            raise RaasError("the AReaL data item has no raas_instance", kind="bad_request")
        reg = self._registration()
        await self._sync_servers(reg, engine)
        # GroupedRolloutWorkflow runs one data item n times: its samples share a group, named by the item
        group_id = str(data.get("raas_group_id") or f"areal-{reg.nonce}-{_digest(instance)}")
        index = reg.next_index(group_id)
        rollout = await reg.sampler.run(
            instance,
            group_id=group_id,
            trajectory_id=index,
            job_id=f"{group_id}.{reg.nonce}.{index}",
            sampling_params=self.sampling_params or None,
            max_resubmits=self.max_resubmits,
            job_timeout_s=self.job_timeout_s,
        )
        reg.recent_jobs.append(rollout.job_id)
        if not rollout.usable:
            self.rejected += 1
            log.warning("raas job %s rejected for AReaL: %s", rollout.job_id, rollout.unusable_reason)
            return None
        return trajectory(rollout)
