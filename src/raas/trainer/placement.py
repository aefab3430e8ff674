"""Node-aware placement of inference servers (lives in :mod:`raas.core.placement`, which the cluster
router shares); re-exported here for the trainer side."""

from __future__ import annotations

from raas.core.placement import host_of, plan_llm_assignment

__all__ = ["host_of", "plan_llm_assignment"]
