"""The math task end to end in-process: a scripted policy (vLLM wire protocol) computes in a real sandbox
with the real tools and submits; math-verify scores the submission. Proves reward plumbing independently of
any model's skill: a correct answer scores 1.0, a wrong one 0.0."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from tests.agent.scripted import scripted_policy, tool_call

from raas.agent.config import AgentConfig
from raas.llm.tokenizer import ChatTokenizer
from raas.sandbox import SandboxConfig, SandboxManager
from raas.tasks.base import Job, JobSandboxes
from raas.tasks.math import MathHandler

pytestmark = pytest.mark.integration

PROBLEM = {
    "data_source": "math",
    "instance_id": "p1",
    "problem": "A tank holds 3/4 of 96 liters. How many liters is that?",
    "answer": "72",
}


@pytest.fixture(params=["local", "bwrap"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def job_sandboxes(
    sandbox_manager: SandboxManager,
    sandbox_config: SandboxConfig,
) -> AsyncIterator[JobSandboxes]:
    js = JobSandboxes(sandbox_manager, sandbox_config, owner="math-job")
    try:
        yield js
    finally:
        await js.close_all()


@pytest.mark.parametrize(
    ("texts", "reward"),
    [
        ([tool_call("ipython", code="x = 96 * 3 / 4\nprint(int(x))"), tool_call("finish", answer="72")], 1.0),
        ([tool_call("bash", command="echo $((96*3/4))"), tool_call("finish", answer="\\frac{144}{2}")], 1.0),
        ([tool_call("ipython", code="print(96 * 3 // 5)"), tool_call("finish", answer="57")], 0.0),
        (["I think it is \\boxed{72}."], 1.0),  # no finish call: the boxed answer is scored
        (["I do not know."], 0.0),
    ],
)
async def test_scripted_policy_reward(
    tokenizer: ChatTokenizer, job_sandboxes: JobSandboxes, texts: list[str], reward: float
) -> None:
    handler = MathHandler()
    job = Job(job_id="math-job", instance=PROBLEM, trajectory_id="t")
    env = await handler.init(job, job_sandboxes)
    async with scripted_policy(tokenizer, texts, AgentConfig(max_turns=3)) as (server, llm, _):
        out = await handler.run(job, env, llm)
    await job_sandboxes.close_all()
    env.run_output = out
    result = await handler.eval(job, env)
    assert result.reward == reward, (out.answer, result.details)
    assert result.resolved is (reward == 1.0)
    assert len(server.requests) == len(out.turns)
    if out.turns and len(out.turns) > 1:
        observation = out.messages[3].content
        assert "72" in observation or "57" in observation, observation
