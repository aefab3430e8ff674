"""The AReaL side of tests/integrations/test_areal_plugin.py, run as its own process (AReaL 1.0.4's
environment: its import-time dependencies sit in an overlay on PYTHONPATH).

It does what AReaL's ``PPOTrainer`` does with ``workflow="raas.integrations.areal.RaasWorkflow"``: the
real ``RemoteSGLangEngine`` is initialized with the inference server's address (the embedded llama-server
stands in for SGLang; the engine only checks its ``/health``), ``rollout_batch`` runs the workflow through
AReaL's ``WorkflowExecutor`` and ``GroupedRolloutWorkflow`` (``group_size`` samples per prompt), the
trainer side concatenates the trajectories with ``concat_batch``; then the weight update's version bump
(``set_version``) and another batch; then a batch whose jobs raas filters.

Writes the batches as JSON to argv[1].
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def as_lists(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v.tolist() if hasattr(v, "tolist") else v for k, v in batch.items()}


def main() -> None:
    out_path, data_path = Path(sys.argv[1]), Path(sys.argv[2])
    llama_address = sys.argv[3]
    group_size = int(os.environ.get("AREAL_GROUP_SIZE", "2"))
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.utils.data import concat_batch

    from raas.integrations.areal import _state

    items = json.loads(data_path.read_text())
    workflow = "raas.integrations.areal.RaasWorkflow"
    kwargs = {"sampling_params": {"temperature": 1.0}}
    engine = RemoteSGLangEngine(
        InferenceEngineConfig(
            backend="sglang:d1",
            consumer_batch_size=len(items["train"]) * group_size,
            max_concurrent_rollouts=8,
            max_head_offpolicyness=1,
            setup_timeout=60,
            request_timeout=600,
        )
    )
    engine.initialize(addr=[llama_address], train_data_parallel_size=1)
    try:
        engine.set_version(0)
        first = engine.rollout_batch(
            items["train"], workflow=workflow, workflow_kwargs=kwargs, group_size=group_size
        )
        batch0, meta0 = concat_batch(first)
        # after the weight update AReaL stamps the new version on the rollout engine
        engine.pause()
        engine.set_version(1)
        engine.resume()
        second = engine.rollout_batch(
            items["train"][:1], workflow=workflow, workflow_kwargs=kwargs, group_size=1
        )
        batch1, _ = concat_batch(second)
        # jobs that raas filters (no time to run): every sample rejected, none in the batch
        tight = {**kwargs, "job_timeout_s": 0.001, "max_resubmits": 1}
        engine.set_version(2)
        rejected = engine.rollout_batch(
            items["filtered"], workflow=workflow, workflow_kwargs=tight, group_size=1
        )
        out_path.write_text(
            json.dumps(
                {
                    "first": as_lists(batch0),
                    "first_groups": [len(t["input_ids"]) for t in first],
                    "meta": {"n_trajs": meta0.n_trajs, "traj_group_sizes": list(meta0.traj_group_sizes)},
                    "second": as_lists(batch1),
                    "rejected_batch": len(rejected),
                    "jobs": [j for regs in _state.values() for reg in regs.values() for j in reg.recent_jobs],
                }
            )
        )
    finally:
        engine.destroy()


if __name__ == "__main__":
    main()
