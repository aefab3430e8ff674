"""The SkyRL side of tests/integrations/test_skyrl_plugin.py, run as its own process (skyrl-train 0.3.1's
environment: it and its small imports sit in an overlay on PYTHONPATH).

It does what ``python -m raas.integrations.skyrl`` sets up and what SkyRL's ``RayPPOTrainer.train`` does
per step, with SkyRL's own code: hydra composes SkyRL's ``ppo_base_config`` with the raas overrides,
``RaasPPOExp`` (SkyRL's ``BasePPOExp`` with raas's ``get_generator``) loads the tokenizer and SkyRL's
``PromptDataset`` from a parquet, the real remote inference engines and ``InferenceEngineClient`` are made
from the config (the embedded llama-server stands in for the trainer's server), then
``prepare_generator_input`` → ``RayPPOTrainer.generate`` (which validates the output) →
``postprocess_generator_output`` → ``convert_to_training_input`` → ``compute_advantages_and_returns``.
The trainer object holds only what those methods read (no Ray workers: a test double says the policy's
data-parallel size). Then the next step (new ``global_step``), then a step whose jobs raas filters.

Writes the training inputs as JSON to argv[1].
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def ray_compat() -> None:
    """skyrl-train 0.3.1 pins ray 2.51.1 and imports ``PlacementGroupSchedulingStrategy`` from
    ``ray.util.placement_group``; ray 2.60 (this environment's) keeps it only in
    ``ray.util.scheduling_strategies``."""
    pg = importlib.import_module("ray.util.placement_group")
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not hasattr(pg, "PlacementGroupSchedulingStrategy"):
        pg.PlacementGroupSchedulingStrategy = PlacementGroupSchedulingStrategy  # type: ignore[attr-defined]


def compose(model_dir: Path, data: Path, llama_address: str, n: int, extra: list[str]) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from skyrl_train.entrypoints.main_base import config_dir

    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(
            config_name="ppo_base_config",
            overrides=[
                # the user's raas diff (docs/trainers/skyrl.md)
                "generator.run_engines_locally=false",
                f"generator.remote_inference_engine_urls=['{llama_address}']",
                # the rest of this small run
                f"trainer.policy.model.path={model_dir}",
                f"data.train_data=['{data}']",
                "data.val_data=[]",
                "trainer.eval_interval=-1",
                "trainer.placement.colocate_all=false",
                "trainer.train_batch_size=2",
                "trainer.algorithm.advantage_estimator=grpo",
                f"generator.n_samples_per_prompt={n}",
                *extra,
            ],
        )


def as_lists(ti: Any) -> dict[str, Any]:
    out = {}
    for key in (
        "sequences",
        "attention_mask",
        "response_mask",
        "loss_mask",
        "rollout_logprobs",
        "advantages",
    ):
        value = ti[key]
        out[key] = value.tolist() if value is not None else None
    out["uids"] = list(ti.metadata["uids"])
    out["response_length"] = int(ti.metadata["response_length"])
    return out


def main() -> None:
    out_path, model_dir, data, llama_address = (
        Path(sys.argv[1]),
        Path(sys.argv[2]),
        Path(sys.argv[3]),
        sys.argv[4],
    )
    n = 2
    ray_compat()
    from skyrl_train.entrypoints.main_base import create_remote_inference_engines_from_config
    from skyrl_train.generators.utils import prepare_generator_input
    from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient
    from skyrl_train.inference_engines.utils import get_sampling_params_for_backend
    from skyrl_train.trainer import RayPPOTrainer

    from raas.integrations.skyrl import RaasPPOExp

    cfg = compose(model_dir, data, llama_address, n, [])
    exp = RaasPPOExp(cfg)
    tokenizer = exp.tokenizer
    client = InferenceEngineClient(
        create_remote_inference_engines_from_config(cfg, tokenizer), tokenizer, cfg
    )

    def trainer_for(generator: Any) -> Any:
        trainer = RayPPOTrainer.__new__(RayPPOTrainer)
        trainer.cfg, trainer.tokenizer, trainer.generator = cfg, tokenizer, generator
        trainer.all_metrics, trainer.all_timings, trainer.critic_model, trainer.ref_model = {}, {}, None, None
        trainer.policy_model = SimpleNamespace(actor_infos=[SimpleNamespace(rank=SimpleNamespace(dp_size=2))])
        return trainer

    def step(trainer: Any, prompts: list[Any], global_step: int) -> tuple[dict[str, Any], list[str], Any]:
        trainer.global_step = global_step
        generator_input, uids = prepare_generator_input(
            prompts,
            cfg.generator.n_samples_per_prompt,
            get_sampling_params_for_backend(cfg.generator.backend, cfg.generator.sampling_params),
            cfg.environment.env_class,
            "train",
            global_step,
        )
        output = asyncio.run(trainer.generate(generator_input))
        raw = {
            k: output[k]
            for k in ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons")
        }
        raw["rollout_metrics"] = output["rollout_metrics"]
        output = trainer.postprocess_generator_output(output, uids)
        ti = trainer.convert_to_training_input(output, uids)
        ti["values"] = None
        ti = trainer.compute_advantages_and_returns(ti)
        return {**as_lists(ti), "generator_output": raw}, list(trainer.generator.last_job_ids), ti

    rows = [exp.train_dataset[i] for i in range(len(exp.train_dataset))]
    prompts = [{"prompt": m, "env_class": e, "env_extras": x, "uid": u} for m, e, x, u in rows]
    train = [p for p in prompts if "tight" not in p["env_extras"].get("raas_case", "")]
    tight = [p for p in prompts if p["env_extras"].get("raas_case") == "tight"]

    generator = exp.get_generator(cfg, tokenizer, client)
    trainer = trainer_for(generator)
    first, first_jobs, _ = step(trainer, train, 1)
    second, second_jobs, _ = step(trainer, train[:1], 2)
    servers = generator._registered
    # raas filters these jobs (no time to run): rows with nothing to train on
    tight_cfg = compose(
        model_dir,
        data,
        llama_address,
        n,
        ["+generator.raas_job_timeout_s=0.001", "+generator.raas_max_resubmits=1"],
    )
    tight_trainer = trainer_for(exp.get_generator(tight_cfg, tokenizer, client))
    third, third_jobs, _ = step(tight_trainer, tight, 3)
    # A group with a filtered sample, through SkyRL's own batch path with grpo_norm_by_std=false: the
    # placeholder reward is the group's usable mean, so the usable samples' advantages are r - mean(usable).
    from raas.integrations.samples import Rollout
    from raas.integrations.skyrl import generator_output

    def sample(job: str, reward: float | None) -> Rollout:
        usable = reward is not None
        return Rollout(
            job_id=job,
            prompt_ids=[1, 2],
            response_ids=[5, 6] if usable else [],
            response_mask=[1, 1] if usable else [],
            logprobs=[-0.5, -0.5] if usable else [],
            reward=reward,
            usable=usable,
            unusable_reason=None if usable else "filtered",
        )

    dr_cfg = compose(model_dir, data, llama_address, 3, ["trainer.algorithm.grpo_norm_by_std=false"])
    mixed_trainer = trainer_for(None)
    mixed_trainer.cfg = dr_cfg
    uids = ["m", "m", "m"]
    mixed_out = generator_output([sample("a", 1.0), sample("b", 0.0), sample("c", None)], uids, 2)
    mixed_out = mixed_trainer.postprocess_generator_output(mixed_out, uids)
    mixed_ti = mixed_trainer.convert_to_training_input(mixed_out, uids)
    mixed_ti["values"] = None
    mixed_ti = mixed_trainer.compute_advantages_and_returns(mixed_ti)
    out_path.write_text(
        json.dumps(
            {
                "steps": [
                    {**first, "jobs": first_jobs, "version": "1"},
                    {**second, "jobs": second_jobs, "version": "2"},
                    {**third, "jobs": third_jobs, "version": "3"},
                ],
                "registered": [list(servers[0]), servers[1]] if servers else None,
                "mixed": as_lists(mixed_ti),
                "pad_token_id": tokenizer.pad_token_id,
            }
        )
    )


if __name__ == "__main__":
    main()
