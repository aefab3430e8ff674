"""Test-double task handlers whose behaviour per stage is scripted by the instance itself.

``StageScriptHandler`` (data_source ``test.script``) reads ``instance[stage]`` for ``init``, ``run`` and
``eval``, each a dict of optional steps executed in order:

* ``sleep``: seconds to ``asyncio.sleep`` (lets tests hold a job inside a stage);
* ``sandbox``: true to open a sandbox through ``JobSandboxes`` (``env.sandbox``) and ``bash`` to run in it;
* ``bash``: a command run in ``env.sandbox`` (RUN/EVAL) — a long one lets a test kill the sandbox mid-stage;
* ``generate``: a list of prompt token ids sent through ``llm.balancer.generate`` (RUN only); with
  ``turns: n``, ``n`` calls, each prompt extending the previous one by its output and :data:`OBSERVATION`;
* ``raise``: a message; raised as ``RaasError(kind=instance[stage]["kind"])`` if ``kind`` is set, else as
  ``RuntimeError``;
* ``reward`` / ``resolved`` (EVAL): what to score.

Because the script travels in the instance, the same handler works in-process and in a service
subprocess (registered through ``ServiceConfig.extra_handlers``). Hook calls are appended to
``StageScriptHandler.hook_calls`` (in-process tests read it).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from raas.core.trajectory import EvalOutput, Message, RunOutput, TokenTrajectory, Turn
from raas.errors import RaasError
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler
from raas.tasks.registry import HandlerRegistry


class StageScriptHandler(TaskHandler):
    name: ClassVar[str] = "test.script"
    hook_calls: ClassVar[list[tuple[str, str, str]]] = []

    def validate_instance(self, instance: dict[str, Any]) -> None:
        for stage in ("init", "run", "eval"):
            if stage in instance and not isinstance(instance[stage], dict):
                raise RaasError(f"instance.{stage} must be an object", kind="bad_request")

    async def _steps(self, stage: str, job: Job, env: Env | None) -> dict[str, Any]:
        script: dict[str, Any] = job.instance.get(stage) or {}
        if script.get("sleep"):
            await asyncio.sleep(float(script["sleep"]))
        if script.get("bash") and env is not None and env.sandbox is not None:
            await env.sandbox.tools.bash(script["bash"], timeout=float(script.get("bash_timeout", 60)))
        if "raise" in script:
            if script.get("kind"):
                raise RaasError(str(script["raise"]), kind=str(script["kind"]))
            raise RuntimeError(str(script["raise"]))
        return script

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        env = Env(job=job, sandboxes=sandboxes)
        if (job.instance.get("init") or {}).get("sandbox"):
            env.sandbox = await sandboxes.open()
            env.data["sandbox_pid"] = getattr(env.sandbox, "pid", None)
        await self._steps("init", job, env)
        return env

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        script = job.instance.get("run") or {}
        if script.get("sandbox"):
            env.sandbox = await env.sandboxes.open()
        turns: list[Turn] = []
        if "generate" in script:
            from raas.llm import SamplingParams

            prompt = [int(t) for t in script["generate"]]
            chosen = {k: v for k, v in job.sampling_params.items() if k in SamplingParams.model_fields}
            sampling = SamplingParams(**{**chosen, "max_tokens": int(script.get("max_tokens", 4))})
            seq, delta = list(prompt), list(prompt)
            for k in range(int(script.get("turns", 1))):  # later turns: the output, then an "observation"
                res = await llm.balancer.generate(seq, sampling, trajectory_id=job.trajectory_id)
                turns.append(
                    Turn(
                        index=k,
                        prompt_ids=delta,
                        prompt_is_delta=k > 0,
                        prompt_len=len(seq),
                        output_ids=list(res.output_ids),
                        logprobs=list(res.logprobs),
                        finish_reason=str(res.finish_reason),
                        latency_s=res.latency_s,
                        server=res.server,
                        weight_version=res.weight_version,  # stamped as the agent loop stamps it
                    )
                )
                delta = list(OBSERVATION)
                seq += list(res.output_ids) + delta
        if len(turns) > 1:
            await self._steps("run", job, env)
            return _multi_turn(prompt, turns, str(script.get("answer", "42")))
        await self._steps("run", job, env)
        response = turns[0].output_ids if turns else [7, 8]
        return RunOutput(
            messages=[
                Message(role="user", content="q", input_ids=[1, 2, 3]),
                Message(role="assistant", content="a", output_ids=response, logprobs=[-0.5] * len(response)),
            ],
            turns=turns,
            token_trajectory=TokenTrajectory(
                prompt_ids=[1, 2, 3],
                response_ids=response,
                loss_mask=[1] * len(response),
                logprobs=[-0.5] * len(response),
            ),
            finish_reason="finish_tool",
            answer=str(script.get("answer", "42")),
            artifacts={"patch": "diff --git a/x b/x"},
        )

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        script = job.instance.get("eval") or {}
        if script.get("sandbox"):
            env.sandbox = await env.sandboxes.open()
        await self._steps("eval", job, env)
        reward = script.get("reward", 1.0)
        return EvalOutput(
            reward=None if reward is None else float(reward), resolved=script.get("resolved", True)
        )

    async def on_error(self, stage: str, job: Job, env: Env | None, exc: BaseException) -> None:
        self.hook_calls.append((job.job_id, stage, type(exc).__name__))


OBSERVATION = (9, 9)
"""What the environment adds between two turns of a multi-turn ``generate`` script."""


def _multi_turn(prompt: list[int], turns: list[Turn], answer: str) -> RunOutput:
    """The token record of ``turns`` as an agent loop builds it: outputs sampled, observations masked."""
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float | None] = []
    for turn in turns:
        if turn.index:
            response += turn.prompt_ids
            mask += [0] * len(turn.prompt_ids)
            logprobs += [0.0] * len(turn.prompt_ids)
        response += turn.output_ids
        mask += [1] * len(turn.output_ids)
        logprobs += list(turn.logprobs)
    return RunOutput(
        turns=turns,
        token_trajectory=TokenTrajectory(
            prompt_ids=prompt, response_ids=response, loss_mask=mask, logprobs=logprobs
        ),
        finish_reason="finish_tool",
        answer=answer,
    )


def script_registry() -> HandlerRegistry:
    """A service's handler registry with the built-ins and :class:`StageScriptHandler`."""
    handlers = HandlerRegistry()
    handlers.register(StageScriptHandler, replace=True)
    return handlers
