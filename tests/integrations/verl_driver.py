"""The verl side of tests/integrations/test_trainer_plugins.py, run as its own process (verl's environment:
hydra-core and its antlr runtime, which raas's own environment cannot hold next to math-verify's).

It does what verl 0.9.1's ``RayPPOTrainer`` does with raas selected by configuration only: hydra composes
verl's ``ppo_trainer`` config with the overrides docs/trainers/verl.md gives, the weight sync goes through
the configured ``checkpoint_manager_class``, verl's ``RLHFDataset`` and ``collate_fn`` read a parquet made
by ``verl_rows``, the batch is repeated ``rollout.n`` times with a ``uid`` per prompt, verl's real
``AgentLoopWorker.generate_sequences`` runs the registered agent loop and builds the ``DataProto``, and
verl's ``compute_advantage`` runs with ``algorithm.adv_estimator``. Test doubles stand in only for what
needs GPUs: the actor worker group and the rollout replica (which names the embedded llama-server).

Writes every row of the batches (and what raas's status said during the sync) as JSON to argv[1].
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import numpy as np


class ActorWorkerGroupDouble:
    """verl's actor worker group (GPU workers that push weights): records raas's state while verl's
    weight sync runs."""

    def __init__(self, raas_url: str) -> None:
        self.raas_url = raas_url
        self.paused_during_sync: list[bool] = []

    def update_weights(self, global_steps: int | None = None, mode: str = "naive") -> list[Any]:
        status = httpx.get(f"{self.raas_url}/status", timeout=10).json()
        self.paused_during_sync.append(bool(status["llm_paused"]))
        return []


class ReplicaDouble:
    """A rollout replica as ``CheckpointEngineManager`` sees it: its server's address; sleep is a no-op."""

    def __init__(self, address: str) -> None:
        self._server_address = address

    @property
    def server_address(self) -> str:
        return self._server_address

    async def sleep(self) -> None:
        return None


def compose(model_dir: Path, loop_yaml: Path, data_file: Path, n: int, overrides: list[str]) -> Any:
    import verl.trainer.config as config_pkg
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = str(Path(config_pkg.__file__).parent)
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(
            config_name="ppo_trainer",
            overrides=[
                # the user's raas diff (docs/trainers/verl.md)
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loop_yaml}",
                "actor_rollout_ref.rollout.agent.default_agent_loop=raas",
                "+actor_rollout_ref.rollout.checkpoint_manager_class=raas.integrations.verl.RaasCheckpointEngineManager",
                "algorithm.adv_estimator=raas_grpo",
                # the rest of this small run
                f"actor_rollout_ref.model.path={model_dir}",
                f"actor_rollout_ref.rollout.n={n}",
                "actor_rollout_ref.rollout.name=vllm",
                "actor_rollout_ref.rollout.calculate_log_probs=true",
                "actor_rollout_ref.rollout.temperature=1.0",
                "data.max_prompt_length=1024",
                "data.max_response_length=1536",
                f"data.train_files={data_file}",
                f"data.val_files={data_file}",
                *overrides,
            ],
        )


def rows_of(batch: Any) -> list[dict[str, Any]]:
    b = batch.batch
    out = []
    for i in range(len(batch)):
        row = {
            k: b[k][i].tolist()
            for k in ("prompts", "responses", "response_mask", "attention_mask", "input_ids")
        }
        for k in ("rollout_log_probs", "rm_scores", "advantages"):
            if k in b.keys():
                row[k] = b[k][i].tolist()
        for k in (
            "uid",
            "raas_job_id",
            "raas_usable",
            "raas_unusable_reason",
            "raas_weight_versions",
            "agent_name",
        ):
            if k in batch.non_tensor_batch:
                v = batch.non_tensor_batch[k][i]
                row[k] = v.tolist() if isinstance(v, np.ndarray) else v
        out.append(row)
    return out


def main() -> None:
    out_path, model_dir, loop_yaml, data_file, llama_address = (Path(a) for a in sys.argv[1:6])
    n = int(os.environ.get("VERL_N", "2"))
    raas_url = os.environ["RAAS_URL"]

    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl import DataProto
    from verl.experimental.agent_loop import AgentLoopWorker
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.config import CheckpointEngineConfig
    from verl.workers.rollout.llm_server import LLMServerClient

    from tests.cluster.raycluster import LocalRayCluster

    config = compose(model_dir, loop_yaml, data_file, n, [])
    # verl's naive weight sync waits on the actor workers through ray.get: a one-node Ray of its own, on
    # its own loopback address and free ports (tests/cluster/raycluster.py), so it never meets another.
    with LocalRayCluster([1]):
        # verl's trainer: the checkpoint manager class named by its config.
        manager_cls = load_class_from_fqn(
            config.actor_rollout_ref.rollout.get("checkpoint_manager_class"), "CheckpointEngineManager"
        )
        actor = ActorWorkerGroupDouble(raas_url)
        manager = manager_cls(
            config=CheckpointEngineConfig(backend="naive"),
            actor_wg=actor,
            replicas=[ReplicaDouble(str(llama_address))],
        )
        manager.update_weights(0)  # what fit() does before its first step
        worker = AgentLoopWorker(config, LLMServerClient(config, None))
        tokenizer = worker.tokenizer
        dataset = RLHFDataset(
            data_files=[str(data_file)], tokenizer=tokenizer, processor=None, config=config.data
        )
        loader = StatefulDataLoader(dataset, batch_size=len(dataset), shuffle=False, collate_fn=collate_fn)

        def step_batch(batch_dict: dict[str, Any], steps: int) -> Any:
            batch = DataProto.from_single_dict(batch_dict)
            batch.non_tensor_batch["uid"] = np.array(
                [str(uuid.uuid4()) for _ in range(len(batch))], dtype=object
            )
            gen = batch.pop(
                batch_keys=[],
                non_tensor_batch_keys=[
                    k
                    for k in batch.non_tensor_batch
                    if k not in ("data_source", "reward_model", "extra_info", "uid")
                ],
            )
            gen.non_tensor_batch.update(batch.non_tensor_batch)
            gen.meta_info["global_steps"] = steps
            gen = gen.repeat(repeat_times=n, interleave=True)
            output = asyncio.run(worker.generate_sequences(gen))
            batch = batch.repeat(repeat_times=n, interleave=True).union(output)
            batch.batch["token_level_rewards"] = batch.batch["rm_scores"]
            return compute_advantage(
                batch,
                adv_estimator=config.algorithm.adv_estimator,
                num_repeat=n,
                norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo,
                config=config.algorithm,
            )

        batch_dict = next(iter(loader))
        first = step_batch(batch_dict, 1)
        # verl's step: sleep the rollout servers, train, sync weights (version 1), generate again.
        manager.sleep_replicas()
        paused_after_sleep = bool(httpx.get(f"{raas_url}/status", timeout=10).json()["llm_paused"])
        manager.update_weights(1)
        servers = httpx.get(f"{raas_url}/v1/llm/servers", timeout=10).json()
        one = {k: v[:1] for k, v in batch_dict.items()}
        second = step_batch(one, 2)
        out_path.write_text(
            json.dumps(
                {
                    "first": rows_of(first),
                    "second": rows_of(second),
                    "paused_during_sync": actor.paused_during_sync,
                    "paused_after_sleep": paused_after_sleep,
                    "servers_after_sync": servers,
                    "pad_token_id": tokenizer.pad_token_id,
                    "prompt_length": int(config.actor_rollout_ref.rollout.prompt_length),
                    "response_length": int(config.actor_rollout_ref.rollout.response_length),
                }
            )
        )


if __name__ == "__main__":
    main()
