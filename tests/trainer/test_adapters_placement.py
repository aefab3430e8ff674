"""The verl and NeMo RL adapters (without either installed: the plain-container path), and node-aware
placement of inference servers."""

from __future__ import annotations

import numpy as np
import pytest

from raas.trainer.adapters import nemo_rl_message_logs, to_nemo_rl, verl_arrays
from raas.trainer.grpo import assemble_batch
from raas.trainer.placement import plan_llm_assignment
from tests.trainer.test_grpo import group, result

pytestmark = pytest.mark.unit


def batch():  # type: ignore[no-untyped-def]
    a = result("a", 1.0, [11, 12], [([21, 22], "0"), ([23], "0")])
    b = result("b", 0.0, [13], [([24], "0")])
    return assemble_batch([group("g0", [a, b])], pad_id=0, max_prompt_len=3, max_response_len=6)


def test_verl_fields() -> None:
    tensors, non_tensors = verl_arrays(batch())
    assert tensors["responses"].tolist() == [[21, 22, 9, 9, 23, 0], [24, 0, 0, 0, 0, 0]]
    assert tensors["prompts"].tolist() == [[0, 11, 12], [0, 0, 13]]
    assert tensors["response_mask"].tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]]
    # the reward sits on the last real response token (verl's token-level score layout)
    assert tensors["token_level_scores"].tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0]]
    assert tensors["advantages"][0].tolist() == [0.5, 0.5, 0, 0, 0.5, 0]
    assert non_tensors["uid"].tolist() == ["g0", "g0"] and non_tensors["uid"].dtype == object
    for v in tensors.values():
        assert v.shape[0] == 2


def test_to_verl_without_verl_is_a_plain_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    import raas.trainer.adapters as adapters

    monkeypatch.setattr(adapters, "_installed", lambda module: module != "verl")  # as if verl were absent
    out = adapters.to_verl(batch(), meta_info={"step": 3})
    assert set(out) == {"batch", "non_tensor_batch", "meta_info"}
    assert out["meta_info"]["step"] == 3 and out["meta_info"]["raas"]["rows"] == 2


def test_nemo_rl_message_logs_reproduce_the_sequence() -> None:
    b = batch()
    logs = nemo_rl_message_logs(b)
    assert [m["role"] for m in logs[0]] == ["user", "assistant", "environment", "assistant"]
    seq = np.concatenate([m["token_ids"] for m in logs[0]]).tolist()
    assert seq == [11, 12, 21, 22, 9, 9, 23]
    sampled = np.concatenate([m["token_ids"][m["token_loss_mask"] == 1] for m in logs[0]]).tolist()
    assert sampled == [21, 22, 23]
    assert logs[0][1]["generation_logprobs"].tolist() == [-0.5, -0.5]
    assert "generation_logprobs" not in logs[0][2]
    assert logs[1][1]["advantages"].tolist() == [-0.5]
    data = to_nemo_rl(b)
    assert [float(x) for x in data["total_reward"]] == [1.0, 0.0]
    assert [int(x) for x in data["length"]] == [7, 2]
    assert [float(x) for x in data["loss_multiplier"]] == [1.0, 1.0]


def test_placement_prefers_the_same_node_then_spreads() -> None:
    services = ["http://node-a:8008", "http://node-b:8008", "http://node-c:8008"]
    llms = ["http://node-a:8000", "http://node-a:8001", "http://node-b:8000", "http://node-d:8000"]
    plan = plan_llm_assignment(services, llms)
    assert plan["http://node-a:8008"] == ["http://node-a:8000", "http://node-a:8001"]
    assert plan["http://node-b:8008"] == ["http://node-b:8000"]
    assert plan["http://node-c:8008"] == ["http://node-d:8000"]  # the remote one goes to the emptiest


def test_placement_shares_when_servers_are_fewer_than_services() -> None:
    services = ["http://a:1", "http://b:1", "http://c:1"]
    plan = plan_llm_assignment(services, ["http://a:9"])
    assert plan == {"http://a:1": ["http://a:9"], "http://b:1": ["http://a:9"], "http://c:1": ["http://a:9"]}
    # explicit node names win over the URL (services behind a proxy)
    plan = plan_llm_assignment(
        ["http://lb:1/s1", "http://lb:2/s2"], ["http://10.0.0.2:8000"], hosts={"http://lb:2/s2": "10.0.0.2"}
    )
    assert plan["http://lb:2/s2"] == ["http://10.0.0.2:8000"]
    assert plan_llm_assignment([], ["http://x:1"]) == {}
    assert plan_llm_assignment(["http://127.0.0.1:1"], ["http://localhost:2"]) == {
        "http://127.0.0.1:1": ["http://localhost:2"]
    }
