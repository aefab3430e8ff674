"""The ``math_final`` task: the final-number grader, its instances and dataset, and the handler with a
scripted policy (real tokenizer, real balancer, vLLM wire protocol) — a right final number scores 1."""

from __future__ import annotations

import pytest
from tests.agent.scripted import scripted_policy

from raas.agent.config import AgentConfig
from raas.errors import RaasError
from raas.llm.tokenizer import ChatTokenizer
from raas.tasks.base import Job, JobSandboxes
from raas.tasks.datasets import ADDITION_CANDIDATES, ADDITION_PAIRS, builtin_addition, load_dataset
from raas.tasks.final_number import FinalNumberHandler, final_number, grade
from raas.tasks.registry import HandlerRegistry


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The answer is 15.", "15"),
        ("1 + 8 = 9", "9"),
        ("3 + 5 = 8, so 3 + 5 = 8.\n\nHere", "8"),
        ("it is 1,234 apples", "1234"),
        ("-3", "-3"),
        ("about 2.5 or 3/4", "3/4"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_final_number(text: str, number: str | None) -> None:
    assert final_number(text) == number


@pytest.mark.unit
def test_grade() -> None:
    assert grade("3 + 5 = 8", "8")[0] == 1.0
    assert grade("3 + 5 = 8. Also 9", "8") == (0.0, {"final_number": "9"})  # the *final* number counts
    assert grade("eight", "8")[0] == 0.0
    assert grade("0.50", "1/2")[0] == 1.0
    with pytest.raises(RaasError):
        grade("8", "eight")


@pytest.mark.unit
def test_instances_and_dataset() -> None:
    h = FinalNumberHandler()
    for bad in ({"problem": "x"}, {"problem": "", "answer": "1"}, {"problem": "x", "answer": "one"},
                {"problem": "x", "answer": True}):  # fmt: skip
        with pytest.raises(RaasError) as e:
            h.validate_instance(bad)
        assert e.value.kind == "bad_request"
    h.validate_instance({"problem": "What is 1 + 2?", "answer": 3})
    assert HandlerRegistry().get("math_final").name == "math_final"
    assert len(ADDITION_CANDIDATES) == 81 and set(ADDITION_PAIRS) <= set(ADDITION_CANDIDATES)
    data = load_dataset("builtin:addition")
    assert len(data) == len(ADDITION_PAIRS) and load_dataset("builtin:addition:3") == data[:3]
    assert all(d["data_source"] == "math_final" and int(d["answer"]) < 19 for d in data)
    assert len(builtin_addition(candidates=True)) == 81
    for bad in ("builtin:addition:0", f"builtin:addition:{len(ADDITION_PAIRS) + 1}", "builtin:addition:x"):
        with pytest.raises(RaasError):
            load_dataset(bad)
    # The reference trainer's split: 61 training sums, 20 held out, together all 81, never overlapping.
    train, test = load_dataset("builtin:addition:train"), load_dataset("builtin:addition:test")
    assert (len(train), len(test)) == (61, 20) and load_dataset("builtin:addition:test:5") == test[:5]
    ids = [d["instance_id"] for d in train], [d["instance_id"] for d in test]
    assert not set(ids[0]) & set(ids[1]) and len(set(ids[0]) | set(ids[1])) == 81
    with pytest.raises(RaasError):
        builtin_addition(split="validation")


@pytest.mark.integration
@pytest.mark.parametrize(
    ("reply", "reward"), [("3 + 5 = 8", 1.0), ("The answer is 8.", 1.0), ("8 + 1 = 9", 0.0), ("Eight.", 0.0)]
)
async def test_handler_with_a_scripted_policy(tokenizer: ChatTokenizer, reply: str, reward: float) -> None:
    handler = FinalNumberHandler()
    job = Job(job_id="j", instance={"data_source": "math_final", "problem": "What is 3 + 5?", "answer": "8"},
              trajectory_id="0")  # fmt: skip
    env = await handler.init(job, JobSandboxes(None, None, owner="j"))  # type: ignore[arg-type]
    async with scripted_policy(tokenizer, [reply], AgentConfig(max_turns=8, max_tokens_per_turn=512)) as (
        server,
        llm,
        _,
    ):
        out = await handler.run(job, env, llm)
    # one turn, no tools, at most 32 tokens asked for, no sandbox ever opened
    assert len(out.turns) == 1 and len(server.requests) == 1
    assert server.requests[0].max_tokens == 32
    assert out.artifacts["tools"] == []
    env.run_output = out
    result = await handler.eval(job, env)
    assert result.reward == reward and result.resolved is (reward == 1.0)
