"""A job's agent settings: the job's own, then the operator's, then its task handler's defaults.

Over HTTP, a SWE job that names no budget must get the SWE handler's (its prompt alone is ~1,100 tokens),
as ``raas run`` gives it; an operator's explicit service setting still wins over the handler's."""

from __future__ import annotations

from typing import Any, cast

import pytest

from raas.agent.config import AgentConfig
from raas.core.jobs import Job
from raas.errors import RaasError
from raas.llm.balancer import LLMBalancer
from raas.pipeline.config import ServiceConfig, agent_config_for
from raas.pipeline.wiring import Layers
from raas.tasks.swe.config import AGENT_DEFAULTS

pytestmark = pytest.mark.unit

SWE = {"max_turns": 30, "max_tokens_per_turn": 1024, "context_budget": 8192}


def test_handler_defaults_fill_what_nobody_chose() -> None:
    got = agent_config_for(AgentConfig(), {}, {"max_turns": 30, "context_budget": 16384})
    assert (got.max_turns, got.context_budget, got.max_tokens_per_turn) == (30, 16384, 512)


def test_the_job_and_the_operator_win_over_the_handler() -> None:
    operator = AgentConfig(max_turns=12)
    got = agent_config_for(operator, {"max_tokens_per_turn": 64}, SWE)
    assert got.max_turns == 12  # the operator's
    assert got.max_tokens_per_turn == 64  # the job's
    assert got.context_budget == 8192  # the handler's (also AgentConfig's default)
    # a configuration that went through JSON (a cluster node's) keeps the same meaning
    again = AgentConfig.model_validate_json(operator.model_dump_json())
    assert agent_config_for(again, {}, SWE).max_turns == 12


def test_invalid_job_settings_are_a_bad_request() -> None:
    with pytest.raises(RaasError) as err:
        agent_config_for(AgentConfig(), {"max_turns": 0}, SWE)
    assert err.value.kind == "bad_request"


@pytest.mark.parametrize(
    ("instance", "expected"),
    [
        ({"data_source": "swebench", "instance_id": "x"}, AGENT_DEFAULTS),
        ({"data_source": "math", "problem": "1+1", "answer": "2"}, {}),
    ],
)
def test_the_service_applies_the_jobs_handler_defaults(
    instance: dict[str, Any], expected: dict[str, int]
) -> None:
    # The balancer is never called here: llm_context only hands it on.
    layers = Layers(ServiceConfig(), balancer=cast(LLMBalancer, object()))
    agent = layers.llm_context(Job(job_id="j", instance=instance, trajectory_id="0")).agent
    want = AgentConfig.model_validate({**AgentConfig().model_dump(), **expected})
    assert agent == want
    if expected:
        assert agent.max_turns == AGENT_DEFAULTS["max_turns"] != AgentConfig().max_turns
