"""Scoring of submitted answers by math-verify."""

from __future__ import annotations

import pytest

from raas.core.trajectory import Message, RunOutput
from raas.errors import RaasError
from raas.tasks.base import Env, Job
from raas.tasks.math import MathHandler, last_boxed, score_answer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("answer", "truth", "reward"),
    [
        ("42", "42", 1.0),
        ("\\boxed{42}", "42", 1.0),
        ("0.75", "3/4", 1.0),
        ("$\\frac{3}{4}$", "3/4", 1.0),
        ("29.4", "147/5", 1.0),
        ("41", "42", 0.0),
        ("forty-two", "42", 0.0),
        ("", "42", 0.0),
        (None, "42", 0.0),
        ("x" * 5000, "42", 0.0),
    ],
)
async def test_score_answer(answer: str | None, truth: str, reward: float) -> None:
    got, details = await score_answer(answer, truth)
    assert got == reward, details


def test_last_boxed() -> None:
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{unclosed") is None


def _env(answer: str | None, truth: str = "12") -> tuple[Job, Env]:
    job = Job(
        job_id="j", instance={"data_source": "math", "problem": "p", "answer": truth}, trajectory_id="t"
    )
    env = Env(job=job, sandboxes=None)  # type: ignore[arg-type]  # eval of math opens no sandbox
    env.run_output = RunOutput(
        messages=[Message(role="assistant", content="...")], answer=answer, finish_reason="finish_tool"
    )
    return job, env


async def test_eval_rewards() -> None:
    h = MathHandler()
    job, env = _env("12")
    out = await h.eval(job, env)
    assert out.reward == 1.0 and out.resolved is True
    job, env = _env("13")
    out = await h.eval(job, env)
    assert out.reward == 0.0 and out.resolved is False
    job, env = _env(None)
    out = await h.eval(job, env)
    assert out.reward == 0.0


async def test_eval_without_run_output_is_a_handler_error() -> None:
    h = MathHandler()
    job, env = _env("1")
    env.run_output = None
    with pytest.raises(RaasError) as e:
        await h.eval(job, env)
    assert e.value.kind == "handler_error"


@pytest.mark.parametrize(
    "instance",
    [
        {"data_source": "math"},
        {"data_source": "math", "problem": "", "answer": "1"},
        {"data_source": "math", "problem": "p"},
        {"data_source": "math", "problem": "p", "answer": True},
        {"data_source": "math", "problem": 3, "answer": "1"},
    ],
)
def test_validate_instance_rejects(instance: dict) -> None:
    with pytest.raises(RaasError) as e:
        MathHandler().validate_instance(instance)
    assert e.value.kind == "bad_request"


def test_validate_instance_accepts_numbers() -> None:
    MathHandler().validate_instance({"data_source": "math", "problem": "p", "answer": 7})
