"""The built-in ``math`` task: solve a word problem with Python/bash in a sandbox and ``finish(answer)``.

The reward is 1.0 when math-verify finds the submitted answer equal to the ground truth and 0.0 otherwise,
including when the policy never submits one (a policy failure). Failures of the infrastructure raise typed
errors instead, so the pipeline filters the trajectory rather than rewarding it 0.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from raas.agent.loop import run_agent
from raas.agent.tools import ToolSet
from raas.core.trajectory import EvalOutput, RunOutput
from raas.errors import RaasError
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler
from raas.tasks.verify import verify_call

SYSTEM_PROMPT = (
    "You are a careful math assistant working in a sandbox. Solve the user's problem step by step. "
    "You may run Python with the ipython tool or shell commands with the bash tool to compute. "
    "When you know the answer, call the finish tool with the final answer only (a number or expression); "
    "if you cannot call tools, end your reply with the answer as \\boxed{answer}."
)
MAX_ANSWER_CHARS = 2000
"""Longer submissions are not parsed (sympy time grows fast with input size); they score 0."""
VERIFY_TIMEOUT_S = 20.0

_BOXED = re.compile(r"\\boxed\{")


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


MATH_VERIFY = "raas.tasks.mathverify:verify_answer"
"""The verifier target run in a worker process (see :mod:`raas.tasks.verify`)."""


async def score_answer(
    answer: str | None, truth: str, *, timeout_s: float = VERIFY_TIMEOUT_S
) -> tuple[float, dict[str, Any]]:
    """Reward of ``answer`` against ``truth`` by math-verify (1.0 or 0.0) and what was parsed.

    math-verify runs in a killable worker process: one that takes longer than ``timeout_s`` is killed and
    the job fails with ``verifier_timeout`` (filtered, never a reward of 0)."""
    if answer is None or not answer.strip():
        return 0.0, {"reason": "no answer submitted"}
    if len(answer) > MAX_ANSWER_CHARS:
        return 0.0, {"reason": f"answer longer than {MAX_ANSWER_CHARS} characters"}
    try:
        ok, details = await verify_call(MATH_VERIFY, answer, truth, timeout_s=timeout_s)
    except RaasError as exc:
        exc.stage = exc.stage or "eval"
        raise
    return (1.0 if ok else 0.0), dict(details)


class MathHandler(TaskHandler):
    """Instances: ``{"data_source": "math", "problem": str, "answer": str}`` (the DeepScaleR shape)."""

    name: ClassVar[str] = "math"
    needs_tokenizer: ClassVar[bool] = True
    tools: ClassVar[list[str]] = ["ipython", "bash", "finish"]
    verify_timeout_s: ClassVar[float] = VERIFY_TIMEOUT_S

    def validate_instance(self, instance: dict[str, Any]) -> None:
        problem, answer = instance.get("problem"), instance.get("answer")
        if not isinstance(problem, str) or not problem.strip():
            raise RaasError("math instance needs a non-empty string 'problem'", kind="bad_request")
        if not isinstance(answer, str | int | float) or isinstance(answer, bool) or not str(answer).strip():
            raise RaasError("math instance needs a non-empty 'answer' (string or number)", kind="bad_request")

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        self.validate_instance(job.instance)
        if job.external_rollout:  # its agent runs outside raas: no sandbox for it (EVAL opens its own)
            return Env(job=job, sandboxes=sandboxes)
        sandbox = await sandboxes.open()
        return Env(job=job, sandboxes=sandboxes, sandbox=sandbox)

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        if env.sandbox is None:
            raise RaasError("math run stage has no sandbox", kind="handler_error", stage="run")
        system = llm.agent.system_prompt or SYSTEM_PROMPT
        out = await run_agent(
            job,
            env.sandbox,
            llm,
            ToolSet(self.tools),
            llm.agent,
            system_prompt=system,
            user_prompt=str(job.instance["problem"]),
        )
        if out.answer is None:
            # A policy that writes the answer in LaTeX instead of calling finish still gets scored.
            for msg in reversed(out.messages):
                if msg.role == "assistant":
                    boxed = last_boxed(msg.content)
                    if boxed is not None:
                        out.answer = boxed
                        out.artifacts["answer_source"] = "boxed"
                    break
        return out

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        run = env.run_output
        if run is None:
            raise RaasError("math eval stage has no run output", kind="handler_error", stage="eval")
        truth = str(job.instance["answer"])
        reward, details = await score_answer(run.answer, truth, timeout_s=self.verify_timeout_s)
        details.update(answer=run.answer, ground_truth=truth)
        return EvalOutput(reward=reward, resolved=reward == 1.0, details=details)
