"""raas as verl's agent loop: a verl 0.9.1 user keeps ``RayPPOTrainer`` and selects raas by configuration.

Three pieces, each through an extension point verl itself offers:

- :class:`RaasAgentLoop` (``@register("raas")``, or an ``agent_loop_config_path`` YAML entry): verl's
  ``AgentLoopWorker`` calls ``run()`` per sample; it runs the sample as a raas job (any raas task) and
  returns the token-exact ``AgentLoopOutput`` (``response_mask`` 1 only on sampled tokens, the sampling
  logprobs, the reward, raas's timings as metrics).
- :class:`RaasCheckpointEngineManager` (``actor_rollout_ref.rollout.checkpoint_manager_class``): verl's
  weight sync. raas holds new generate calls while verl's rollout servers sleep or load weights, registers
  the servers verl started (their ``server_address``) and stamps ``global_steps`` as the weight version.
- ``algorithm.adv_estimator=raas_grpo``: GRPO whose group baselines leave out samples raas filtered. verl's
  trainer needs every row of a step, so an unusable sample stays a row, fully masked, and this estimator
  keeps its placeholder reward out of its group's statistics.

verl and its agent-loop imports (hydra-core among them) must be importable; see docs/trainers/verl.md.
"""

from __future__ import annotations

import logging
import uuid
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from verl.checkpoint_engine import CheckpointEngineManager
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from verl.trainer.ppo.core_algos import register_adv_est
from verl.utils.ray_utils import auto_await

from raas.errors import RaasError
from raas.integrations.samples import RaasSampler, Rollout, normalize_address, shared_sampler, urls_from
from raas.integrations.verl_data import AGENT_NAME, instance_of, sampling_params_from
from raas.trainer.types import version_number

log = logging.getLogger(__name__)

ADV_ESTIMATOR = "raas_grpo"


def agent_loop_output(
    rollout: Rollout,
    *,
    prompt_length: int,
    response_length: int,
    fallback_prompt: list[int],
    num_messages: int | None = None,
) -> AgentLoopOutput:
    """The ``AgentLoopOutput`` verl pads and batches for one raas sample.

    An unusable sample (filtered, or several token segments) and one longer than verl's
    ``prompt_length``/``response_length`` stay a row with ``response_mask`` all 0: verl's step needs every
    row, and no token of it is trained on. The unusable one's ``reward_score`` is a placeholder 0.0 that
    ``raas_grpo`` keeps out of the group baseline."""
    prompt, response = list(rollout.prompt_ids), list(rollout.response_ids)
    mask, logprobs = list(rollout.response_mask), list(rollout.logprobs)
    overlong = len(prompt) > prompt_length or len(response) > response_length
    if overlong:
        prompt, response = prompt[-prompt_length:], response[:response_length]
        mask, logprobs = [0] * len(response), [0.0] * len(response)
    if not prompt:  # a job that failed before RUN: verl needs a prompt token, the row trains on nothing
        if rollout.usable:
            raise RaasError(f"raas job {rollout.job_id} has no prompt tokens", kind="bad_request")
        prompt = list(fallback_prompt)
    timing = rollout.timing
    steps = [n for n in map(version_number, rollout.weight_versions) if n is not None]
    extra: dict[str, Any] = {
        "raas_job_id": rollout.job_id,
        "raas_usable": rollout.usable,
        "raas_unusable_reason": rollout.unusable_reason,
        "raas_overlong": overlong,
        "raas_logprobs_missing": rollout.logprobs_missing,
        "raas_attempts": rollout.attempts,
        "raas_weight_versions": list(rollout.weight_versions),
    }
    if steps:
        extra["min_global_steps"], extra["max_global_steps"] = min(steps), max(steps)
    return AgentLoopOutput(
        prompt_ids=prompt,
        response_ids=response,
        response_mask=mask,
        response_logprobs=logprobs,
        reward_score=float(rollout.reward) if rollout.usable and rollout.reward is not None else 0.0,
        num_turns=num_messages if num_messages is not None else rollout.num_turns,
        metrics=AgentLoopMetrics(
            generate_sequences=float(timing.get("run_s", 0.0)),
            tool_calls=0.0,
            compute_score=float(timing.get("eval_s", 0.0)),
        ),
        extra_fields=extra,
    )


@register(AGENT_NAME)
class RaasAgentLoop(AgentLoopBase):
    """Runs each verl sample as a raas job. Options come from its ``agent_loop_config_path`` entry
    (hydra passes the entry's keys): ``raas_url`` (else ``$RAAS_URL``), ``max_resubmits`` (a filtered
    sample is run again this many times before it is masked), ``job_timeout_s``."""

    def __init__(
        self,
        *args: Any,
        raas_url: str | list[str] | None = None,
        max_resubmits: int = 2,
        job_timeout_s: float | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.pop("tools", None)  # verl's tool list: raas's tasks bring their own tools
        super().__init__(*args, **kwargs)
        self.raas_urls = tuple(urls_from(raas_url))
        self.max_resubmits = int(max_resubmits)
        self.job_timeout_s = job_timeout_s

    def _filler_token(self) -> int:
        tokenizer: Any = self.tokenizer
        for token in (tokenizer.pad_token_id, tokenizer.eos_token_id):
            if token is not None:
                return int(token)
        return 0

    def _sampler(self) -> RaasSampler:
        return shared_sampler(
            self.raas_urls, max_resubmits=self.max_resubmits, job_timeout_s=self.job_timeout_s
        )

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        instance = instance_of(kwargs)
        uid = str(kwargs.get("uid") or uuid.uuid4().hex)
        rollout = await self._sampler().run(
            instance,
            group_id=uid,
            trajectory_id=int(kwargs.get("raas_trajectory_id", 0)),
            job_id=f"{uid}.{uuid.uuid4().hex[:12]}",
            sampling_params=sampling_params_from(sampling_params),
        )
        if not rollout.usable:
            log.warning(
                "raas job %s is masked out of verl's batch: %s", rollout.job_id, rollout.unusable_reason
            )
        messages = len(rollout.result.messages) if rollout.result is not None else None
        return agent_loop_output(
            rollout,
            prompt_length=int(self.rollout_config.prompt_length),
            response_length=int(self.rollout_config.response_length),
            fallback_prompt=[self._filler_token()],
            num_messages=messages,
        )


class RaasCheckpointEngineManager(CheckpointEngineManager):
    """verl's weight sync with raas around it: raas holds new generate calls (waiting for those in flight)
    before verl puts its rollout servers to sleep or loads weights into them, then registers the servers'
    addresses with the version ``global_steps`` and lets generation go on. raas is found through
    ``$RAAS_URL`` in the trainer's process."""

    def _raas(self) -> RaasSampler:
        return RaasSampler(None)

    def _addresses(self) -> list[str]:
        return [normalize_address(str(r.server_address)) for r in self.replicas if r.server_address]

    @auto_await
    async def sleep_replicas(self) -> None:
        async with self._raas() as raas:
            await raas.pause()
        await super().sleep_replicas()

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> Any:
        async with self._raas() as raas:
            await raas.pause()
            try:
                out = await super().update_weights(global_steps)
                version = str(global_steps) if global_steps is not None else None
                await raas.set_servers(self._addresses(), weight_version=version)
            finally:
                await raas.resume()
        return out


@register_adv_est(ADV_ESTIMATOR)
def compute_raas_grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's GRPO outcome advantage, with group statistics over trainable rows only: a row whose
    ``response_mask`` is all 0 (a sample raas could not deliver) neither gets an advantage nor moves its
    group's mean and std. ``algorithm.norm_adv_by_std_in_grpo`` is honoured as in verl's GRPO."""
    norm = norm_adv_by_std_in_grpo
    if config is not None and getattr(config, "norm_adv_by_std_in_grpo", None) is not None:
        norm = bool(config.norm_adv_by_std_in_grpo)
    scores = token_level_rewards.sum(dim=-1)
    trainable = response_mask.sum(dim=-1) > 0
    groups: dict[Any, list[int]] = defaultdict(list)
    for i in range(scores.shape[0]):
        if bool(trainable[i]):
            groups[index[i]].append(i)
    out = torch.zeros_like(scores)
    with torch.no_grad():
        for rows in groups.values():
            group = scores[rows]
            if len(rows) == 1:
                mean, std = torch.tensor(0.0), torch.tensor(1.0)
            else:
                mean, std = group.mean(), group.std()
            out[rows] = (group - mean) / (std + epsilon) if norm else group - mean
    adv = out.unsqueeze(-1) * response_mask
    return adv, adv
