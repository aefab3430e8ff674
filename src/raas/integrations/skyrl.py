"""raas as SkyRL's generator (``skyrl-train`` 0.3.1): a SkyRL user starts training with this module as the
entrypoint instead of ``skyrl_train.entrypoints.main_base``, with SkyRL's own config plus raas's URL:

    python -m raas.integrations.skyrl generator.run_engines_locally=false \\
        generator.remote_inference_engine_urls='["host:8001"]' +generator.raas_url=http://raas:8008 ...

:class:`RaasGenerator` implements SkyRL's ``GeneratorInterface``: ``generate`` runs every sample of the batch
as a raas job (any raas task; the instance rides in the dataset's ``raas_instance`` column, which SkyRL
passes as ``env_extras``) on the inference servers SkyRL was given, stamped with the batch's
``global_step``, and returns the ``GeneratorOutput`` SkyRL trains on: token-exact prompts and responses,
loss masks 1 only on sampled tokens, the sampling logprobs, per-sample rewards, stop reasons.

SkyRL's trainer needs one response per prompt it sent, so a sample raas could not deliver (filtered, or
several token segments) stays a row with ``loss_mask`` all 0 (SkyRL's own way to take a row out of the
loss, as for its padding rows). Its placeholder reward is the mean of its group's usable rewards, so the
group's GRPO baseline is the usable samples' mean (exact for ``grpo_norm_by_std=false``; with the std
normalization the group's std counts the extra sample).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import defaultdict
from typing import Any

from skyrl_train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput

from raas.errors import RaasError
from raas.integrations.samples import RaasSampler, Rollout, shared_sampler

log = logging.getLogger(__name__)


def engine_addresses(cfg: Any, inference_engine_client: Any) -> list[str]:
    """The inference servers SkyRL was given: its remote engines' URLs (``generator.remote_inference_
    engine_urls``), or its OpenAI-compatible HTTP endpoint when SkyRL runs the engines itself."""
    engines = getattr(inference_engine_client, "engines", None) or []
    urls = [str(e.url) for e in engines if getattr(e, "url", None)]
    if urls:
        return urls
    gen = cfg.generator
    if gen.get("enable_http_endpoint"):
        return [f"{gen.http_endpoint_host}:{gen.http_endpoint_port}"]
    if not gen.get("run_engines_locally", True):
        return [str(u) for u in gen.remote_inference_engine_urls]
    raise RaasError(
        "raas needs the inference servers' addresses: set generator.run_engines_locally=false with "
        "generator.remote_inference_engine_urls, or generator.enable_http_endpoint=true",
        kind="bad_request",
    )


def sampling_params_from(params: dict[str, Any] | None) -> dict[str, Any]:
    """SkyRL's sampling params (``generator.sampling_params``) as raas's."""
    out: dict[str, Any] = {}
    for key in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if params and params.get(key) is not None:
            out[key] = float(params[key])
    if params and params.get("top_k") is not None and int(params["top_k"]) > 0:
        out["top_k"] = int(params["top_k"])
    return out


def instance_of(extras: dict[str, Any] | None) -> dict[str, Any]:
    value = (extras or {}).get("raas_instance")
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise RaasError("the SkyRL row has no raas_instance column (env_extras)", kind="bad_request")
    return value


def generator_output(rollouts: list[Rollout], group_ids: list[str], filler_token: int) -> GeneratorOutput:
    """SkyRL's ``GeneratorOutput`` for the batch, in input order."""
    usable: dict[str, list[float]] = defaultdict(list)
    for r, g in zip(rollouts, group_ids, strict=True):
        if r.usable and r.reward is not None:
            usable[g].append(float(r.reward))
    prompts, responses, rewards, masks, logprobs, stops = [], [], [], [], [], []
    for r, g in zip(rollouts, group_ids, strict=True):
        if r.usable:
            prompts.append(list(r.prompt_ids))
            responses.append(list(r.response_ids))
            masks.append(list(r.response_mask))
            logprobs.append(list(r.logprobs))
            rewards.append(float(r.reward or 0.0))
            stops.append(r.stop_reason)
        else:
            group = usable.get(g, [])
            prompts.append(list(r.prompt_ids) or [filler_token])
            responses.append([filler_token])  # SkyRL needs a response token; it is never trained on
            masks.append([0])
            logprobs.append([0.0])
            rewards.append(sum(group) / len(group) if group else 0.0)
            stops.append("raas_unusable")
    n = len(rollouts)
    metrics = {
        "raas/unusable": sum(not r.usable for r in rollouts),
        "raas/resubmitted": sum(r.attempts > 1 for r in rollouts),
        "raas/run_s_mean": sum(r.timing.get("run_s", 0.0) for r in rollouts) / max(n, 1),
        "raas/eval_s_mean": sum(r.timing.get("eval_s", 0.0) for r in rollouts) / max(n, 1),
        "raas/turns_mean": sum(r.num_turns for r in rollouts) / max(n, 1),
    }
    return {
        "prompt_token_ids": prompts,
        "response_ids": responses,
        "rewards": rewards,
        "loss_masks": masks,
        "stop_reasons": stops,
        "rollout_metrics": metrics,
        "rollout_logprobs": logprobs,
        "trajectory_ids": None,
        "is_last_step": None,
    }


class RaasGenerator(GeneratorInterface):
    """SkyRL's generator, backed by raas. Options from ``generator.*`` (add them with ``+``):
    ``raas_url`` (else ``$RAAS_URL``), ``raas_max_resubmits`` (a filtered sample is run again this many
    times), ``raas_job_timeout_s``."""

    def __init__(self, cfg: Any, tokenizer: Any, inference_engine_client: Any) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.inference_engine_client = inference_engine_client
        gen = cfg.generator
        self._options = {
            "urls": gen.get("raas_url"),
            "max_resubmits": int(gen.get("raas_max_resubmits", 2)),
            "job_timeout_s": gen.get("raas_job_timeout_s"),
        }
        self._registered: tuple[tuple[str, ...], str | None] | None = None
        self._nonce = uuid.uuid4().hex[:8]
        self.last_job_ids: list[str] = []
        """The raas job behind each row of the last batch (row order)."""

    def _filler_token(self) -> int:
        for token in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if token is not None:
                return int(token)
        return 0

    def _sampler(self) -> RaasSampler:
        """SkyRL runs each ``generate`` under its own ``asyncio.run``: one HTTP client per event loop."""
        return shared_sampler(
            self._options["urls"],
            max_resubmits=self._options["max_resubmits"],
            job_timeout_s=self._options["job_timeout_s"],
        )

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        sampler = self._sampler()
        meta = input_batch.get("batch_metadata")
        version = str(meta.global_step) if meta is not None else None
        servers = tuple(engine_addresses(self.cfg, self.inference_engine_client))
        if self._registered != (servers, version):
            # SkyRL's synchronous trainer syncs weights between generate calls: the servers now hold
            # the weights of this step, and every raas turn of it carries this version.
            await sampler.set_servers(list(servers), weight_version=version)
            self._registered = (servers, version)
        extras = input_batch.get("env_extras") or [None] * len(input_batch["prompts"])
        ids = input_batch.get("trajectory_ids")
        if ids is None:
            raise RaasError(
                "SkyRL gave no trajectory_ids: raas needs each sample's group", kind="bad_request"
            )
        sampling = sampling_params_from(input_batch.get("sampling_params"))
        group_ids = [str(t.instance_id) for t in ids]
        rollouts = await asyncio.gather(
            *(
                sampler.run(
                    instance_of(extra),
                    group_id=g,
                    trajectory_id=int(t.repetition_id),
                    job_id=f"{g}.{self._nonce}.{meta.global_step if meta else 0}.{t.repetition_id}",
                    sampling_params=sampling or None,
                )
                for extra, g, t in zip(extras, group_ids, ids, strict=True)
            )
        )
        for r in rollouts:
            if not r.usable:
                log.warning("raas job %s is masked out of SkyRL's batch: %s", r.job_id, r.unusable_reason)
        self.last_job_ids = [r.job_id for r in rollouts]
        out = generator_output(list(rollouts), group_ids, self._filler_token())
        out["trajectory_ids"] = list(ids)
        return out


def _experiment() -> type:
    from skyrl_train.entrypoints.main_base import BasePPOExp

    class RaasPPOExp(BasePPOExp):
        """SkyRL's PPO experiment with raas as its generator."""

        def get_generator(self, cfg: Any, tokenizer: Any, inference_engine_client: Any) -> GeneratorInterface:
            return RaasGenerator(cfg, tokenizer, inference_engine_client)

    return RaasPPOExp


def main() -> None:
    """SkyRL's ``main_base`` entrypoint (same hydra config and overrides) with raas's generator."""
    import hydra
    import ray
    from skyrl_train.entrypoints.main_base import config_dir
    from skyrl_train.utils import validate_cfg
    from skyrl_train.utils.utils import initialize_ray

    @ray.remote(num_cpus=1)
    def entrypoint(cfg: Any) -> None:
        _experiment()(cfg).run()

    @hydra.main(config_path=config_dir, config_name="ppo_base_config", version_base=None)
    def run(cfg: Any) -> None:
        validate_cfg(cfg)
        initialize_ray(cfg)
        ray.get(entrypoint.remote(cfg))

    run()


def __getattr__(name: str) -> Any:
    """``RaasPPOExp`` is built on first use: ``BasePPOExp`` imports SkyRL's whole trainer stack."""
    if name == "RaasPPOExp":
        return _experiment()
    raise AttributeError(name)


if __name__ == "__main__":
    main()
