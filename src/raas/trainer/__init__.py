"""raas.trainer: the trainer side of raas.

* :class:`~raas.trainer.client.RaasClient`: the plain async HTTP client of one service;
* :class:`~raas.trainer.rollout.RolloutClient` (and the blocking :class:`~raas.trainer.sync.SyncRolloutClient`):
  sample groups over one or many services, with failure policy, failover and weight syncs;
* :mod:`raas.trainer.grpo`: group-relative advantages and padded numpy training batches;
* :class:`~raas.trainer.dapo.DynamicSampler`: DAPO dynamic sampling with asynchronous refill and carry-over;
* :mod:`raas.trainer.adapters`: ``to_verl`` and ``to_nemo_rl``.

Imports are lazy so ``raas run`` does not pay for numpy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RaasClient": "raas.trainer.client",
    "RolloutClient": "raas.trainer.rollout",
    "FailurePolicy": "raas.trainer.rollout",
    "ClientStats": "raas.trainer.rollout",
    "SyncRolloutClient": "raas.trainer.sync",
    "Group": "raas.trainer.types",
    "JobResult": "raas.trainer.types",
    "is_valid": "raas.trainer.types",
    "Batch": "raas.trainer.grpo",
    "assemble_batch": "raas.trainer.grpo",
    "group_advantages": "raas.trainer.grpo",
    "DynamicSampler": "raas.trainer.dapo",
    "StepStats": "raas.trainer.dapo",
    "to_verl": "raas.trainer.adapters",
    "to_nemo_rl": "raas.trainer.adapters",
    "plan_llm_assignment": "raas.trainer.placement",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'raas.trainer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
