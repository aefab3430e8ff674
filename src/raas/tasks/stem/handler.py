"""The built-in ``stem`` task: answer a science question (multiple choice or short answer) with Python and
bash at hand, then ``finish(answer)``.

The reward is 1.0 when the answer matches the record's (rules in :mod:`raas.tasks.stem.answers`) and 0.0
otherwise, including when the policy gives none. math-verify, for expressions, runs in the killable
verifier pool: a verifier that hangs fails the job as ``verifier_timeout`` (filtered), never a 0.
"""

from __future__ import annotations

from typing import Any, ClassVar

from raas.agent.loop import run_agent
from raas.agent.tools import ToolSet
from raas.core.policy import StagePolicy, StageTimeouts
from raas.core.trajectory import EvalOutput, RunOutput
from raas.errors import RaasError
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler
from raas.tasks.math import VERIFY_TIMEOUT_S
from raas.tasks.stem.answers import (
    LETTERS,
    MAX_ANSWER_CHARS,
    StemSpec,
    choice_letter,
    extract_answer,
    normalize_text,
    numbers_match,
    parse,
    parse_number,
)
from raas.tasks.verify import verify_call

SYSTEM_PROMPT = (
    "You are a careful science assistant working in a sandbox. Reason step by step; you may run Python "
    "with the ipython tool or shell commands with the bash tool to compute. When you know the answer, call "
    "the finish tool with the final answer only; if you cannot call tools, end your reply with "
    "'Answer: <your answer>'."
)
VERIFY_EXPRESSION = "raas.tasks.mathverify:verify_expression"
NUMERIC_VALUE = "raas.tasks.mathverify:numeric_value"
"""Verifier targets run in the killable worker pool (see :mod:`raas.tasks.verify`)."""
CHOICE_INSTRUCTION = "Answer with the letter of the correct choice."
SHORT_INSTRUCTION = "Give the final answer only: a number (with its unit), an expression, or a short phrase."


def user_prompt(spec: StemSpec) -> str:
    if spec.answer_type == "choice":
        options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(spec.choices))
        return f"{spec.question}\n\n{options}\n\n{CHOICE_INSTRUCTION}"
    return f"{spec.question}\n\n{SHORT_INSTRUCTION}"


async def score(spec: StemSpec, answer: str | None, *, timeout_s: float) -> tuple[float, dict[str, Any]]:
    """The reward of ``answer`` (1.0 or 0.0) and how it was judged."""
    details: dict[str, Any] = {"answer_type": spec.answer_type, "ground_truth": spec.gold}
    if answer is None or not answer.strip():
        return 0.0, {**details, "reason": "no answer given"}
    if len(answer) > MAX_ANSWER_CHARS:
        return 0.0, {**details, "reason": f"answer longer than {MAX_ANSWER_CHARS} characters"}
    if spec.answer_type == "choice":
        letter = choice_letter(answer, spec.choices)
        return float(letter == spec.gold), {**details, "parsed_answer": letter}
    if spec.answer_type == "text":
        same = normalize_text(answer, case_sensitive=spec.case_sensitive) == normalize_text(
            spec.gold, case_sensitive=spec.case_sensitive
        )
        return float(same), {**details, "matched_by": "text" if same else None}
    if spec.answer_type == "numeric":
        gold, pred = parse_number(spec.gold), parse_number(answer)
        how = "number"
        if pred is None:  # a closed form such as "\\sqrt{2}" or "2\\pi": sympy evaluates it
            pred, how = await _verify(NUMERIC_VALUE, answer, timeout_s=timeout_s), "math-verify"
        if gold is None or not isinstance(pred, int | float):
            return 0.0, {**details, "reason": "the answer is not a number"}
        ok = numbers_match(float(pred), gold, spec.tolerance)
        return float(ok), {**details, "parsed_answer": pred, "tolerance": spec.tolerance, "matched_by": how}
    if normalize_text(answer, case_sensitive=True) == normalize_text(spec.gold, case_sensitive=True):
        return 1.0, {**details, "matched_by": "text"}
    ok, verified = await _verify(VERIFY_EXPRESSION, answer, spec.gold, timeout_s=timeout_s)
    return (1.0 if ok else 0.0), {**details, **dict(verified), "matched_by": "math-verify" if ok else None}


async def _verify(target: str, *args: Any, timeout_s: float) -> Any:
    """``target(*args)`` in the verifier pool; its failures are the EVAL stage's (typed, filtered)."""
    try:
        return await verify_call(target, *args, timeout_s=timeout_s)
    except RaasError as exc:
        exc.stage = exc.stage or "eval"
        raise


class StemHandler(TaskHandler):
    """Instances: ``question`` (or ``problem``), ``answer``, optional ``choices``/``options``,
    ``answer_type``, ``tolerance``, ``case_sensitive``; see :mod:`raas.tasks.stem.answers`."""

    name: ClassVar[str] = "stem"
    needs_tokenizer: ClassVar[bool] = True
    policy: ClassVar[StagePolicy] = StagePolicy(stage_timeouts=StageTimeouts(init=180, eval=120))
    tools: ClassVar[list[str]] = ["ipython", "bash", "finish"]
    verify_timeout_s: ClassVar[float] = VERIFY_TIMEOUT_S

    def validate_instance(self, instance: dict[str, Any]) -> None:
        parse(instance)

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        parse(job.instance)
        if job.external_rollout:  # its agent runs outside raas: no sandbox for it (EVAL opens its own)
            return Env(job=job, sandboxes=sandboxes)
        sandbox = await sandboxes.open()
        return Env(job=job, sandboxes=sandboxes, sandbox=sandbox)

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        if env.sandbox is None:
            raise RaasError("stem run stage has no sandbox", kind="handler_error", stage="run")
        spec = parse(job.instance)
        out = await run_agent(
            job,
            env.sandbox,
            llm,
            ToolSet(self.tools),
            llm.agent,
            system_prompt=llm.agent.system_prompt or SYSTEM_PROMPT,
            user_prompt=user_prompt(spec),
        )
        last = next((m.content for m in reversed(out.messages) if m.role == "assistant"), None)
        answer, source = extract_answer(out.answer, last)
        out.answer = answer
        out.artifacts["answer_source"] = source
        return out

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        run = env.run_output
        if run is None:
            raise RaasError("stem eval stage has no run output", kind="handler_error", stage="eval")
        spec = parse(job.instance)
        reward, details = await score(spec, run.answer, timeout_s=self.verify_timeout_s)
        details["answer"] = run.answer
        return EvalOutput(reward=reward, resolved=reward == 1.0, details=details)
