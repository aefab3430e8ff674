"""The sample record every trainer plugin builds its rows from (raas.integrations.samples), on hand-built
results: what is usable, what each refusal says, how missing logprobs and URLs are handled."""

from __future__ import annotations

import pytest

from raas.core.trajectory import TokenTrajectory
from raas.errors import RaasError
from raas.integrations.samples import RAAS_URL_ENV, normalize_address, rollout_from_result, urls_from
from raas.integrations.verl_data import instance_of, sampling_params_from, verl_rows
from tests.trainer.test_grpo import result

pytestmark = pytest.mark.unit


def test_a_usable_result_is_its_token_trajectory() -> None:
    r = result("j", 1.0, [1, 2], [([5, 6], "3"), ([7], "4")], obs=[9, 9])
    s = rollout_from_result(r)
    assert s.usable and s.reward == 1.0 and s.unusable_reason is None
    assert s.prompt_ids == [1, 2] and s.response_ids == [5, 6, 9, 9, 7]
    assert s.response_mask == [1, 1, 0, 0, 1] and s.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert s.weight_versions == ["3", "4"] and s.num_turns == 2 and s.stop_reason == "stop"


def test_a_filtered_result_is_unusable_and_carries_no_reward() -> None:
    r = result("j", None, [1, 2], [([5], "0")], status="failed", filtered=True)
    s = rollout_from_result(r)
    assert not s.usable and s.reward is None and s.response_ids == [] and s.response_mask == []
    assert s.unusable_reason is not None and s.unusable_reason.startswith("filtered")


def test_several_token_segments_are_refused_with_a_reason_never_cut_to_one() -> None:
    r = result("j", 1.0, [1, 2], [([5], "0")])
    r.segments = [TokenTrajectory(prompt_ids=[1], response_ids=[5], loss_mask=[1], logprobs=[-0.1])] * 2
    s = rollout_from_result(r)
    assert not s.usable and s.reward is None and "2 token segments" in str(s.unusable_reason)


def test_a_logprob_the_server_did_not_report_is_zero_and_flagged() -> None:
    r = result("j", 0.0, [1], [([5, 6], "0")])
    r.token_trajectory.logprobs[1] = None
    s = rollout_from_result(r)
    assert s.usable and s.logprobs == [-0.5, 0.0] and s.logprobs_missing


def test_urls_come_from_the_config_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RAAS_URL_ENV, raising=False)
    with pytest.raises(RaasError, match="no raas URL"):
        urls_from(None)
    monkeypatch.setenv(RAAS_URL_ENV, "http://a:1/, http://b:2")
    assert urls_from(None) == ["http://a:1", "http://b:2"]
    assert urls_from(["http://c:3"]) == ["http://c:3"]
    assert normalize_address("10.0.0.1:8000") == "http://10.0.0.1:8000"
    assert normalize_address("https://x:1/") == "https://x:1"


def test_verl_rows_carry_the_instance_and_select_the_raas_agent_loop() -> None:
    rows = verl_rows([{"instance_id": "i0", "data_source": "lookup", "answer": "42"}])
    assert rows[0]["agent_name"] == "raas" and rows[0]["data_source"] == "lookup"
    assert instance_of(rows[0]) == {"instance_id": "i0", "data_source": "lookup", "answer": "42"}
    with pytest.raises(RaasError, match="no raas instance"):
        instance_of({"extra_info": {}})
    assert sampling_params_from({"temperature": 0.7, "top_p": 1.0, "top_k": -1, "logprobs": True}) == {
        "temperature": 0.7,
        "top_p": 1.0,
    }
