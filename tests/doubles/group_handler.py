"""A multi-turn test-double task for trainer-side tests: rewards, failures and timing scripted per sample.

``GroupScriptHandler`` (data_source ``test.group``) runs ``turns`` real LLM calls through the service's
balancer (so every turn carries the weight version its server had), with ``obs`` observation tokens added
between turns (loss mask 0), exactly the shape of a multi-turn agent trajectory. The instance says, per
sample (``trajectory_id`` = the index in the group):

* ``rewards``: list indexed by trajectory id (cycled); default 1.0;
* ``turns`` (default 1), ``tokens`` (``max_tokens`` per turn, default 3), ``obs`` (default ``[7, 7]``),
  ``turn_sleep`` (seconds of "tool time" after each turn but the last), ``run_sleep`` (seconds before the
  first turn), ``prompt`` (default ``[1, 2, 3]``);
* ``sandbox``: open a sandbox in INIT (kept through RUN: cancel tests check it is closed);
* ``fail``: ``{"<index>": "<kind>"}`` — that sample's RUN raises ``RaasError(kind)`` on every attempt;
* ``fail_once``: indices whose first attempt (per process) fails with ``sandbox_dead``.

Registered in a service subprocess with ``--handler test.group=tests.doubles.group_handler:GroupScriptHandler``.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from raas.core.trajectory import EvalOutput, RunOutput, TokenTrajectory, Turn
from raas.errors import RaasError
from raas.llm import SamplingParams
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler


class GroupScriptHandler(TaskHandler):
    name: ClassVar[str] = "test.group"
    attempts: ClassVar[dict[tuple[str, int], int]] = {}

    @staticmethod
    def index(job: Job) -> int:
        return int(job.trajectory_id)

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        env = Env(job=job, sandboxes=sandboxes)
        if job.instance.get("sandbox"):
            env.sandbox = await sandboxes.open()
        return env

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        inst = job.instance
        i = self.index(job)
        key = (str(inst.get("instance_id", "")), i)
        self.attempts[key] = self.attempts.get(key, 0) + 1
        if str(i) in (inst.get("fail") or {}):
            raise RaasError(f"scripted failure of sample {i}", kind=str(inst["fail"][str(i)]), stage="run")
        if i in (inst.get("fail_once") or []) and self.attempts[key] == 1:
            raise RaasError(f"scripted first-attempt failure of sample {i}", kind="sandbox_dead", stage="run")
        if inst.get("run_sleep"):
            await asyncio.sleep(float(inst["run_sleep"]))
        prompt = [int(t) for t in inst.get("prompt", [1, 2, 3])]
        obs = [int(t) for t in inst.get("obs", [7, 7])]
        n_turns = int(inst.get("turns", 1))
        sampling = SamplingParams(max_tokens=int(inst.get("tokens", 3)))
        seq = list(prompt)
        pending = list(prompt)
        turns: list[Turn] = []
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float | None] = []
        try:
            for t in range(n_turns):
                res = await llm.balancer.generate(seq, sampling, trajectory_id=job.job_id)
                turns.append(
                    Turn(
                        index=t,
                        prompt_ids=pending,
                        prompt_is_delta=t > 0,
                        prompt_len=len(seq),
                        output_ids=list(res.output_ids),
                        logprobs=list(res.logprobs),
                        finish_reason=str(res.finish_reason),
                        weight_version=res.weight_version,
                        server=res.server,
                        latency_s=res.latency_s,
                    )
                )
                seq += res.output_ids
                response += res.output_ids
                mask += [1] * len(res.output_ids)
                logprobs += list(res.logprobs)
                if t + 1 < n_turns:
                    if inst.get("turn_sleep"):
                        await asyncio.sleep(float(inst["turn_sleep"]))
                    seq += obs
                    response += obs
                    mask += [0] * len(obs)
                    logprobs += [0.0] * len(obs)
                    pending = list(obs)
        finally:
            llm.balancer.release(job.job_id)
        return RunOutput(
            turns=turns,
            token_trajectory=TokenTrajectory(
                prompt_ids=prompt, response_ids=response, loss_mask=mask, logprobs=logprobs
            ),
            finish_reason="finish_tool",
        )

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        rewards = job.instance.get("rewards") or [1.0]
        reward = float(rewards[self.index(job) % len(rewards)])
        return EvalOutput(reward=reward, resolved=reward > 0)
