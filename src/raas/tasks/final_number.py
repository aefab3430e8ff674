"""The ``math_final`` task: answer a short arithmetic question in plain text, graded on the final number.

Why a second math task: the built-in ``math`` task wants a tool call or a ``\\boxed{}`` answer, which a tiny
policy (the embedded SmolLM2-135M) almost never produces, so every group of its rollouts scores all 0 and
carries no learning signal. GSM8K-style graders read the *last number* of the reply instead; at
temperature 1 the tiny model often writes the right sum in text (``The answer is 15.``, ``1 + 8 = 9``), so
its rewards vary within a group and a trainer's group-relative advantages (GRPO, DAPO) have something to
work with. One turn, no tools, no sandbox.

Instances: ``{"data_source": "math_final", "problem": str, "answer": str | int}``; ``builtin:addition``
(:func:`raas.tasks.datasets.builtin_addition`) is a ready-made set.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, ClassVar

from raas.agent.config import agent_overrides
from raas.agent.loop import run_agent
from raas.agent.tools import ToolSet
from raas.core.trajectory import EvalOutput, RunOutput
from raas.errors import RaasError
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler

SYSTEM_PROMPT = "You are a helpful assistant."
MAX_TURNS = 1
MAX_TOKENS_PER_TURN = 32
"""One short reply (at most this many tokens, fewer if the service's agent config says so) unless the job's
``sampling_params`` set ``max_turns`` / ``max_tokens_per_turn`` themselves."""

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def final_number(text: str) -> str | None:
    """The last number in ``text`` (``1,234`` → ``1234``; ``-3``, ``2.5``, ``3/4`` kept), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return found[-1].replace(",", "").rstrip(".")


def _value(s: str) -> Fraction | None:
    try:
        return Fraction(s.strip())
    except (ValueError, ZeroDivisionError):
        return None


def grade(reply: str, truth: str) -> tuple[float, dict[str, Any]]:
    """1.0 when the reply's last number equals ``truth`` numerically, else 0.0 (a policy failure)."""
    got = final_number(reply)
    want = _value(truth)
    if want is None:
        raise RaasError(
            f"math_final ground truth {truth!r} is not a number", kind="bad_request", stage="eval"
        )
    ok = got is not None and _value(got) == want
    return (1.0 if ok else 0.0), {"final_number": got}


class FinalNumberHandler(TaskHandler):
    """A one-turn, tool-free math task graded on the last number of the reply."""

    name: ClassVar[str] = "math_final"

    def validate_instance(self, instance: dict[str, Any]) -> None:
        problem, answer = instance.get("problem"), instance.get("answer")
        if not isinstance(problem, str) or not problem.strip():
            raise RaasError("math_final instance needs a non-empty string 'problem'", kind="bad_request")
        if isinstance(answer, bool) or not isinstance(answer, str | int) or _value(str(answer)) is None:
            raise RaasError("math_final instance needs a numeric 'answer'", kind="bad_request")

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        self.validate_instance(job.instance)
        return Env(job=job, sandboxes=sandboxes)

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        chosen = agent_overrides(job.sampling_params)
        defaults = {
            "max_turns": MAX_TURNS,
            "max_tokens_per_turn": min(llm.agent.max_tokens_per_turn, MAX_TOKENS_PER_TURN),
        }
        agent = llm.agent.model_copy(update={k: v for k, v in defaults.items() if k not in chosen})
        # No tools are offered, so the loop never dispatches into a sandbox and none is opened.
        out = await run_agent(
            job,
            None,  # type: ignore[arg-type]
            llm,
            ToolSet([]),
            agent,
            system_prompt=agent.system_prompt or SYSTEM_PROMPT,
            user_prompt=str(job.instance["problem"]),
        )
        replies = [m.content for m in out.messages if m.role == "assistant"]
        out.answer = final_number(replies[-1]) if replies else None
        return out

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        run = env.run_output
        if run is None:
            raise RaasError("math_final eval stage has no run output", kind="handler_error", stage="eval")
        replies = [m.content for m in run.messages if m.role == "assistant"]
        truth = str(job.instance["answer"])
        reward, details = grade(replies[-1] if replies else "", truth)
        details.update(ground_truth=truth)
        return EvalOutput(reward=reward, resolved=reward == 1.0, details=details)
