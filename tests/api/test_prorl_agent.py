"""The ProRL routes with the real agent: the built-in math handler runs a scripted policy (vLLM wire
protocol) through the real balancer, the real SmolLM2 chat tokenizer and a real local sandbox.

Checks the fields a ProRL trainer reads from the agent itself: ``tools`` (the schemas the policy was shown,
which the trainer needs to re-render the prompt) and ``sampling_params.max_iterations`` (ProRL's name for
the turn limit).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from raas.agent.config import AgentConfig
from raas.agent.tools import ToolSet
from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer
from raas.tasks.math import MathHandler
from tests.agent.scripted import completions, tool_call
from tests.api.conftest import APIFactory, LiveAPI
from tests.doubles.scripted_llm import ScriptedLLM, replay

pytestmark = pytest.mark.integration

INSTANCE = {
    "data_source": "math",
    "instance_id": "m-1",
    "trajectory_id": "t-1",
    "problem": "What is 6 times 7?",
    "answer": "42",
}


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(prepare_tokenizer())


async def _process(api: LiveAPI, llm: ScriptedLLM, sampling_params: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api.url, timeout=120) as http:
        assert (await http.post("/add_llm_server", json={"address": llm.url + "/v1"})).status_code == 200
        assert (await http.post("/start")).status_code == 200
        r = await http.post("/process", json={"instance": INSTANCE, "sampling_params": sampling_params})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def test_process_reports_the_tool_schemas_the_policy_was_shown(
    make_api: APIFactory, tokenizer: ChatTokenizer
) -> None:
    api = await make_api(tokenizer_dir=prepare_tokenizer(), agent=AgentConfig(max_turns=4))
    texts = [tool_call("bash", command="echo $((6*7))"), tool_call("finish", answer="42")]
    async with ScriptedLLM(replay(completions(tokenizer, texts))) as llm:
        res = await _process(api, llm, {"temperature": 1.0})
        first_prompt = tokenizer.decode(llm.requests[0].prompt_ids)
    assert res["status"] == "completed" and res["reward"] == 1.0, res
    want = ToolSet(MathHandler.tools).schemas
    assert res["tools"] == want
    assert [t["function"]["name"] for t in res["tools"]] == ["ipython", "bash", "finish"]
    assert res["artifacts"]["tools"] == want  # the native result carries them too
    # They are the schemas rendered into the prompt (SmolLM2's template gets them as a Hermes block).
    for schema in want:
        assert f'"name": "{schema["function"]["name"]}"' in first_prompt


@pytest.mark.parametrize(
    ("sampling_params", "turns"),
    [
        ({}, 3),  # the service's own limit (4) lets the script run to its finish call
        ({"max_iterations": 1}, 1),  # ProRL's name for the turn limit
        ({"max_iterations": 1, "max_turns": 2}, 2),  # raas's own name wins when both are sent
    ],
)
async def test_max_iterations_limits_the_agent_turns(
    make_api: APIFactory, tokenizer: ChatTokenizer, sampling_params: dict[str, Any], turns: int
) -> None:
    api = await make_api(tokenizer_dir=prepare_tokenizer(), agent=AgentConfig(max_turns=4))
    texts = [
        tool_call("bash", command="echo 6"),
        tool_call("bash", command="echo 7"),
        tool_call("finish", answer="42"),
    ]
    async with ScriptedLLM(replay(completions(tokenizer, texts))) as llm:
        res = await _process(api, llm, {"temperature": 1.0, **sampling_params})
        requests = len(llm.requests)
    assert requests == turns
    assert len(res["turns"]) == turns
    finished = turns == 3
    assert res["artifacts"]["finish_reason"] == ("finish_tool" if finished else "max_turns")
    assert res["finish"] is finished
    assert res["reward"] == (1.0 if finished else 0.0)
