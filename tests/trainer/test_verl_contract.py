"""``to_verl`` against verl's own code (verl 0.9.1, installed with ``--no-deps``; see the Makefile).

Nothing here re-implements verl: every check runs the function verl's PPO/GRPO trainer runs on the batch its
agent loop returns, on the ``DataProto`` that ``to_verl`` builds from a raas ``Batch``:

* the driver (``verl/trainer/ppo/ray_trainer.py``, ``RayPPOTrainer.fit``): ``extract_reward``
  (``verl/trainer/ppo/reward.py``) → ``token_level_scores``/``token_level_rewards`` → ``compute_advantage``
  (GRPO: ``core_algos.compute_grpo_outcome_advantage``; RLOO: ``core_algos.compute_rloo_outcome_advantage``,
  grouped by ``non_tensor_batch["uid"]``), ``apply_bypass_mode`` (``rollout_corr_helper.py``:
  ``old_log_probs = rollout_log_probs``), ``compute_response_mask``, ``metric_utils.compute_data_metrics``;
* the actor (``verl/workers/utils/padding.py``, ``verl/workers/utils/losses.py``): ``DataProto.to_tensordict``
  → ``left_right_2_no_padding`` (what every engine receives) → model log-probs in verl's unpadded layout →
  ``ppo_loss`` (``no_padding_2_padding`` + the registered ``"vanilla"`` policy loss + ``agg_loss``), with the
  token count the FSDP engine uses (``loss_mask.sum()``, ``workers/engine/fsdp/transformer_impl.py``).

The batch is a realistic one: multi-turn rows with tool observations between turns (``loss_mask`` 0), a turn
sampled by stale weights (masked with ``mask_turns_before``), an overlong row (truncated, ``loss_mask`` 0, still
in its group's baseline), an empty response, a filtered sample (in no row and no baseline), a group without
reward variance, left/right padding.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

if importlib.util.find_spec("verl") is None:
    if os.environ.get("RAAS_CI"):  # the Makefile installs verl: in CI its absence is a failure
        pytest.fail("verl is not installed (make install puts verl==0.9.1 in .venv)", pytrace=False)
    pytest.skip("verl is not installed (see the Makefile's verl line)", allow_module_level=True)

import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo.core_algos import AdvantageEstimator
from verl.trainer.ppo.metric_utils import compute_data_metrics
from verl.trainer.ppo.ray_trainer import compute_advantage, compute_response_mask
from verl.trainer.ppo.reward import extract_reward
from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode
from verl.utils import tensordict_utils as tu
from verl.utils.model import compute_position_id_with_mask
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from raas.trainer.adapters import to_verl
from raas.trainer.grpo import Batch, assemble_batch
from tests.trainer.test_grpo import group, result

pytestmark = pytest.mark.integration

P, R = 6, 10
PROMPT = [101, 102, 103]


def raas_batch(*, std_normalize: bool = False, leave_one_out: bool = False) -> Batch:
    """Three groups; ``result`` joins turns with the observation ``[9, 9]`` (loss_mask 0)."""
    g0 = [
        # two turns around a tool observation: response 201 202 203 | 9 9 | 204 205
        result("a", 1.0, PROMPT, [([201, 202, 203], "1"), ([204, 205], "1")]),
        result("b", 0.0, PROMPT, [([211], "1")]),
        # three turns, the first sampled by weights "0": masked by mask_turns_before=1
        result("c", 1.0, PROMPT, [([221, 222], "0"), ([223, 224], "1"), ([225], "1")]),
        # 6 + 2 + 4 = 12 response tokens > R: truncated, loss_mask all 0, still in g0's baseline
        result("d", 0.5, PROMPT, [([231, 232, 233, 234, 235, 236], "1"), ([237, 238, 239, 240], "1")]),
    ]
    g1 = [
        result("e", 0.25, [111, 112, 113, 114, 115], [([241, 242], "1")]),
        result("f", 0.75, [111, 112, 113, 114, 115], [([251, 252, 253, 254], "1"), ([255], "1")]),
        result("g", 0.5, [111, 112, 113, 114, 115], []),  # an empty response: its reward still counts
        result("h", None, [111, 112, 113, 114, 115], [([261], "1")], status="failed", filtered=True),
    ]
    g2 = [result("i", 0.0, [121], [([271, 272], "1")]), result("j", 0.0, [121], [([281], "1")])]
    return assemble_batch(
        [group("g0", g0), group("g1", g1), group("g2", g2)],
        pad_id=0,
        max_prompt_len=P,
        max_response_len=R,
        std_normalize=std_normalize,
        leave_one_out=leave_one_out,
        mask_turns_before=1,
    )


def row(batch: Batch, job_id: str) -> int:
    return batch.job_ids.index(job_id)


def test_the_batch_is_what_the_checks_below_claim() -> None:
    b = raas_batch()
    assert b.job_ids == ["a", "b", "c", "d", "e", "f", "g", "i", "j"]  # "h" (filtered) is in no row
    assert b.loss_mask[row(b, "a")].tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0]
    assert b.loss_mask[row(b, "c")].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 1, 0]  # stale turn, observations
    assert b.overlong.tolist() == [False, False, False, True, False, False, False, False, False]
    assert not b.loss_mask[row(b, "d")].any() and not b.response_attention_mask[row(b, "g")].any()


def test_to_verl_is_a_dataproto_with_the_fields_verls_trainer_reads() -> None:
    b = raas_batch()
    data = to_verl(b, meta_info={"step": 7})
    assert isinstance(data, DataProto)
    data.check_consistency()
    B = b.size
    # What verl's agent loop returns from generate_sequences (experimental/agent_loop/agent_loop.py,
    # AgentLoopWorker._postprocess) and fit then reads, with its shapes and dtypes.
    expected = {
        "prompts": ((B, P), torch.int64),
        "responses": ((B, R), torch.int64),
        "response_mask": ((B, R), torch.int64),
        "input_ids": ((B, P + R), torch.int64),
        "attention_mask": ((B, P + R), torch.int64),
        "position_ids": ((B, P + R), torch.int64),
        "rollout_log_probs": ((B, R), torch.float32),
        "rm_scores": ((B, R), torch.float32),
    }
    for key, (shape, dtype) in expected.items():
        assert tuple(data.batch[key].shape) == shape and data.batch[key].dtype == dtype, key
    assert torch.equal(
        data.batch["input_ids"], torch.cat([data.batch["prompts"], data.batch["responses"]], 1)
    )
    assert torch.equal(
        data.batch["position_ids"], compute_position_id_with_mask(data.batch["attention_mask"])
    )
    # verl's own response mask (the attention tail) covers raas's loss mask and adds the observations
    attention_tail = compute_response_mask(data)
    assert bool(((data.batch["response_mask"] == 1) <= (attention_tail == 1)).all())
    assert (
        int(attention_tail[row(b, "a")].sum()) == 7
        and int(data.batch["response_mask"][row(b, "a")].sum()) == 5
    )
    # non_tensor_batch: uid (GRPO groups), multi_modal_inputs (fit iterates it: ray_trainer.py, fit)
    assert data.non_tensor_batch["uid"].tolist() == ["g0"] * 4 + ["g1"] * 3 + ["g2"] * 2
    assert [m for m in data.non_tensor_batch["multi_modal_inputs"]] == [{}] * B
    assert data.meta_info["step"] == 7
    # the reward manager's output, which fit turns into token_level_scores
    scores, extra = extract_reward(data)
    assert scores.sum(-1).tolist() == pytest.approx(b.rewards.tolist()) and extra == {}
    # verl's step metrics read the same keys (they count an empty response as aborted and leave it out of
    # the score statistics; its reward still enters its group's baseline, see the advantage tests)
    metrics = compute_data_metrics(data, use_critic=False)
    answered = b.response_attention_mask.any(axis=1)
    assert metrics["critic/score/mean"] == pytest.approx(float(b.rewards[answered].mean()))
    assert metrics["response/aborted_ratio"] == pytest.approx(1 / B)
    assert metrics["response_length/mean"] == pytest.approx(float(b.response_attention_mask.sum(1).mean()))
    # the DataProto survives what the driver does between steps (concat, reorder, tensordict)
    both = DataProto.concat([data, to_verl(raas_batch())])
    assert len(both) == 2 * B
    both.reorder(torch.arange(2 * B - 1, -1, -1))
    assert both.non_tensor_batch["uid"][0] == "g2"
    assert set(both.to_tensordict().keys()) >= set(expected)


ADVANTAGE_CASES = [
    # (raas assemble_batch options, verl estimator, verl's norm_adv_by_std_in_grpo)
    ({"std_normalize": False}, AdvantageEstimator.GRPO, False),  # Dr. GRPO: r - mean(r)
    ({"std_normalize": True}, AdvantageEstimator.GRPO, True),  # GRPO: (r - mean) / (std(ddof=1) + 1e-6)
    ({"leave_one_out": True}, AdvantageEstimator.RLOO, True),  # RLOO: r_i - mean of the others
]


@pytest.mark.parametrize(("raas_options", "estimator", "norm_by_std"), ADVANTAGE_CASES)
def test_verls_advantage_from_to_verl_output_equals_raas_advantages(
    raas_options: dict[str, bool], estimator: AdvantageEstimator, norm_by_std: bool
) -> None:
    b = raas_batch(**raas_options)
    data = to_verl(b)
    raas_adv = data.batch["advantages"].clone()
    # fit's "adv" section: scores from the reward, no KL in reward, then compute_advantage on the driver
    data.batch["token_level_scores"], _ = extract_reward(data)
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    data = compute_advantage(data, adv_estimator=estimator, norm_adv_by_std_in_grpo=norm_by_std)
    torch.testing.assert_close(data.batch["advantages"], raas_adv, rtol=0, atol=1e-5)
    torch.testing.assert_close(data.batch["returns"], raas_adv, rtol=0, atol=1e-5)
    # not vacuous: group g0 and g1 carry signal; observations, the stale turn and the overlong row none
    a, c = row(b, "a"), row(b, "c")
    assert float(raas_adv[a, 0]) > 0 and float(raas_adv[row(b, "e"), 0]) < 0
    assert float(raas_adv[a, 3]) == 0 and float(raas_adv[c, 0]) == 0 and not raas_adv[row(b, "d")].any()


def test_the_normalization_setting_must_match() -> None:
    """raas's default (``std_normalize=False``) is verl's ``norm_adv_by_std_in_grpo=False``, not verl's default
    (True): recomputing with verl's default config changes the advantages."""
    data = to_verl(raas_batch())
    raas_adv = data.batch["advantages"].clone()
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    data = compute_advantage(data, adv_estimator=AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=True)
    assert not torch.allclose(data.batch["advantages"], raas_adv, atol=1e-3)


def test_a_group_of_one_is_where_raas_and_verl_differ() -> None:
    """A group with one usable sample: raas gives advantage 0 (no baseline, no signal); verl's GRPO uses mean 0
    and std 1 for it, so its advantage is the raw reward. Use raas's advantages (skip compute_advantage) or
    keep ``FailurePolicy.min_group_size`` >= 2 (the default) so such groups never reach a batch."""
    b = assemble_batch(
        [group("solo", [result("s", 0.7, PROMPT, [([301, 302], "1")])])],
        pad_id=0,
        max_prompt_len=P,
        max_response_len=R,
        std_normalize=True,
    )
    data = to_verl(b)
    assert not data.batch["advantages"].any()
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    data = compute_advantage(data, adv_estimator=AdvantageEstimator.GRPO, norm_adv_by_std_in_grpo=True)
    assert data.batch["advantages"][0, :2].tolist() == pytest.approx([0.7, 0.7], abs=1e-5)


def actor_config() -> ActorConfig:
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1)


def current_log_probs(b: Batch) -> torch.Tensor:
    """``[B, R]`` the "current policy" log-probs of the response tokens: within 2% of the rollout's (inside
    verl's clip range, so the vanilla loss is ``-A * ratio`` on every token), different per column."""
    delta = 0.01 * (torch.arange(R, dtype=torch.float32) % 5 - 2)
    return (torch.from_numpy(b.rollout_logprobs) + delta) * torch.from_numpy(b.response_attention_mask)


def verl_actor_loss(data: DataProto, b: Batch, current: torch.Tensor) -> tuple[float, torch.Tensor]:
    """verl's actor path on ``data``: the engine's input (``left_right_2_no_padding``), model log-probs in its
    unpadded layout (position t holds the log-prob of token t+1), ``ppo_loss``. Also returns the log-probs as
    ``no_padding_2_padding`` hands them back in the response layout."""
    td = left_right_2_no_padding(data.to_tensordict())
    # raas's view of each row: prompt tokens, then response column j at sequence position prompt_len + j
    per_row = []
    for i in range(b.size):
        plen = int(b.attention_mask[i, :P].sum())
        rlen = int(b.response_attention_mask[i].sum())
        values = torch.full((plen + rlen,), -7.0)
        values[plen - 1 : plen - 1 + rlen] = current[i, :rlen]
        per_row.append(values)
    log_probs = torch.nested.as_nested_tensor(per_row, layout=torch.jagged)
    assert torch.equal(log_probs.offsets(), td["input_ids"].offsets())  # same token count per row as verl's
    back = no_padding_2_padding(log_probs, td)
    # what FSDPEngine.forward_backward_batch assigns before calling the loss (one data-parallel rank)
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(td["loss_mask"].sum()), global_batch_size=b.size)
    loss, _ = ppo_loss(actor_config(), {"log_probs": log_probs}, td)
    return float(loss), back


def test_verls_actor_loss_trains_exactly_on_raas_loss_mask() -> None:
    b = raas_batch()
    data = to_verl(b)
    # bypass mode: the rollout's log-probs (raas's token-exact logprobs) are the old policy
    apply_bypass_mode(data, None, OmegaConf.create({"loss_mode": "vanilla"}))
    assert torch.equal(data.batch["old_log_probs"], data.batch["rollout_log_probs"])
    current = current_log_probs(b)
    loss, back = verl_actor_loss(data, b, current)
    # verl slices the model output back into exactly raas's response columns
    attention = torch.from_numpy(b.response_attention_mask).bool()
    assert torch.equal(back[attention], current[attention]) and not back[~attention].any()
    # vanilla PPO inside the clip range, token-mean over verl's token count: -sum(A * ratio * mask) / sum(mask)
    mask = torch.from_numpy(b.loss_mask).float()
    ratio = torch.exp(current - torch.from_numpy(b.rollout_logprobs))
    expected = -(torch.from_numpy(b.advantages) * ratio * mask).sum() / mask.sum()
    assert loss == pytest.approx(float(expected), abs=1e-6)
    assert loss != 0

    def loss_with(job_id: str, column: int, bump: float) -> float:
        changed = current.clone()
        changed[row(b, job_id), column] += bump
        return verl_actor_loss(data, b, changed)[0]

    # masked out by raas: a tool observation, the stale turn, the overlong row's sampled token
    assert loss_with("a", 3, 0.5) == loss
    assert loss_with("c", 0, 0.5) == loss
    assert loss_with("d", 0, 0.5) == loss
    # sampled and trained: the loss moves by exactly that token's term
    a = row(b, "a")
    adv, old = float(b.advantages[a, 0]), float(b.rollout_logprobs[a, 0])
    step = (
        -adv
        * (np.exp(float(current[a, 0]) + 0.05 - old) - np.exp(float(current[a, 0]) - old))
        / float(mask.sum())
    )
    assert loss_with("a", 0, 0.05) - loss == pytest.approx(step, abs=1e-6)


def test_without_verl_the_plain_dict_has_the_dataprotos_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback of ``to_verl`` (verl not importable) carries the same fields as the real DataProto."""
    import raas.trainer.adapters as adapters

    real = to_verl(raas_batch(), meta_info={"step": 1})
    monkeypatch.setattr(adapters, "_installed", lambda module: module != "verl")
    plain = adapters.to_verl(raas_batch(), meta_info={"step": 1})
    assert isinstance(plain, dict) and set(plain) == {"batch", "non_tensor_batch", "meta_info"}
    assert set(plain["batch"]) == set(real.batch.keys())
    assert set(plain["non_tensor_batch"]) == set(real.non_tensor_batch)
    assert plain["meta_info"] == real.meta_info
    for key, value in plain["batch"].items():
        assert np.array_equal(value, real.batch[key].numpy()), key
