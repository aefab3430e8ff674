"""AReaL 1.0.4 GRPO with raas as the rollout workflow: AReaL's own training script (as its
examples/math/gsm8k_rl.py), with raas's workflow passed where AReaL takes one. Needs AReaL's GPU
environment with raas installed in it (docs/trainers/areal.md) and a raas service.

    RAAS_URL=http://raas:8008 python examples/areal/raas_grpo.py --config <your AReaL GRPO yaml>
"""

from __future__ import annotations

import json
import os
import sys

from areal import PPOTrainer
from areal.api.cli_args import GRPOConfig, load_expr_config
from datasets import Dataset

from raas.tasks.datasets import load_dataset


def main(argv: list[str]) -> None:
    raas_url = os.environ.get("RAAS_URL", "http://127.0.0.1:8008")
    config, _ = load_expr_config(argv, GRPOConfig)
    rows = [{"raas_instance": json.dumps(inst)} for inst in load_dataset("builtin:lookup:512")]
    with PPOTrainer(config, train_dataset=Dataset.from_list(rows), valid_dataset=None) as trainer:
        trainer.train(
            workflow="raas.integrations.areal.RaasWorkflow",
            workflow_kwargs={
                "raas_url": raas_url,
                "sampling_params": {"temperature": 1.0},
                "max_resubmits": 2,
            },
        )


if __name__ == "__main__":
    main(sys.argv[1:])
