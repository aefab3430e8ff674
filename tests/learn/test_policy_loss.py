"""The DAPO loss and the trainer's log-probs, on a tiny random llama (built from a config: no weights are
downloaded): the loss trains exactly the sampled tokens, clip-higher is asymmetric, micro-batches add up
to the whole batch, and the response log-probs of a padded batch equal a plain forward pass's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from raas.trainer.grpo import Batch
from raas.trainer.policy_loss import LossConfig, TorchBatch, dapo_loss, response_logprobs

pytestmark = pytest.mark.unit


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def make_batch(rollout_logprobs: np.ndarray | None = None) -> Batch:
    """Two rows: P=4 (left-padded), R=5 (right-padded); row 0 has a tool observation at columns 2-3."""
    pad = 0
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    responses = [[12, 13, 40, 41, 14], [15, 16]]
    masks = [[1, 1, 0, 0, 1], [1, 1]]
    P, R = 4, 5
    input_ids = np.full((2, P + R), pad, dtype=np.int64)
    attention = np.zeros((2, P + R), dtype=np.int64)
    loss_mask = np.zeros((2, R), dtype=np.int64)
    for b, (p, r, m) in enumerate(zip(prompts, responses, masks, strict=True)):
        input_ids[b, P - len(p) : P] = p
        attention[b, P - len(p) : P] = 1
        input_ids[b, P : P + len(r)] = r
        attention[b, P : P + len(r)] = 1
        loss_mask[b, : len(m)] = m
    lp = rollout_logprobs if rollout_logprobs is not None else np.full((2, R), -1.0, dtype=np.float32)
    advantages = np.array([[1.0] * R, [-1.0] * R], dtype=np.float32) * loss_mask
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=np.clip(np.cumsum(attention, axis=1) - 1, 0, None),
        loss_mask=loss_mask,
        rollout_logprobs=(lp * loss_mask).astype(np.float32),
        advantages=advantages,
        rewards=np.array([1.0, 0.0], dtype=np.float32),
        logprobs_missing=np.zeros((2, R), dtype=bool),
        overlong=np.zeros(2, dtype=bool),
        group_index=np.zeros(2, dtype=np.int64),
        prompt_len=P,
        response_len=R,
    )


def test_response_logprobs_equal_an_unpadded_forward_pass() -> None:
    model = tiny_llama()
    tb = TorchBatch.from_batch(make_batch())
    with torch.no_grad():
        got = response_logprobs(model, tb)
        for b, (p, r) in enumerate([([5, 6, 7], [12, 13, 40, 41, 14]), ([8, 9, 10, 11], [15, 16])]):
            ids = torch.tensor([p + r])
            logits = model(input_ids=ids).logits[0]
            want = torch.log_softmax(logits, -1)[len(p) - 1 : -1].gather(-1, torch.tensor(r)[:, None])[:, 0]
            torch.testing.assert_close(got[b, : len(r)], want, atol=1e-5, rtol=1e-5)


def test_on_policy_loss_is_minus_the_token_mean_advantage_and_trains_only_sampled_tokens() -> None:
    model = tiny_llama()
    tb0 = TorchBatch.from_batch(make_batch())
    with torch.no_grad():
        lp = response_logprobs(model, tb0)
    tb = TorchBatch.from_batch(make_batch(lp.numpy()))
    logprobs = lp.clone().requires_grad_(True)
    loss, stats = dapo_loss(logprobs, tb, LossConfig())
    n = float(tb.loss_mask.sum())
    assert loss.item() == pytest.approx(-(tb.advantages * tb.loss_mask).sum().item() / n, abs=1e-6)
    assert stats["ratio_mean"] == pytest.approx(1.0) and stats["clip_fraction"] == 0.0
    loss.backward()
    assert logprobs.grad is not None
    assert torch.all(logprobs.grad[tb.loss_mask == 0] == 0)
    assert torch.all(logprobs.grad[tb.loss_mask == 1] != 0)


def test_masked_positions_do_not_change_the_loss() -> None:
    tb = TorchBatch.from_batch(make_batch())
    base = tb.rollout_logprobs.clone()
    loss1, _ = dapo_loss(base.clone(), tb, LossConfig())
    perturbed = base.clone()
    perturbed[tb.loss_mask == 0] += 5.0
    loss2, _ = dapo_loss(perturbed, tb, LossConfig())
    assert loss1.item() == loss2.item()
    perturbed[0, 0] += 0.1  # a sampled token
    loss3, _ = dapo_loss(perturbed, tb, LossConfig())
    assert loss3.item() != loss1.item()


def test_clip_higher_is_asymmetric() -> None:
    """Positive advantage: a ratio of 1.25 is inside [1-0.2, 1+0.28] (still pushed up); 1.35 is clipped."""
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    tb = TorchBatch.from_batch(make_batch())
    for ratio, has_grad in ((1.25, True), (1.35, False)):
        lp = (tb.rollout_logprobs + np.log(ratio)).clone().requires_grad_(True)
        loss, stats = dapo_loss(lp, tb, cfg)
        loss.backward()
        assert lp.grad is not None
        assert bool(lp.grad[0, 0] != 0) is has_grad, ratio  # row 0: advantage +1
        assert stats["clip_fraction"] == (0.0 if has_grad else 1.0)
    # Negative advantage: a ratio of 0.7 is below 1-0.2 and clipped; 0.85 is not.
    for ratio, has_grad in ((0.85, True), (0.7, False)):
        lp = (tb.rollout_logprobs + np.log(ratio)).clone().requires_grad_(True)
        loss, _ = dapo_loss(lp, tb, cfg)
        loss.backward()
        assert lp.grad is not None
        assert bool(lp.grad[1, 0] != 0) is has_grad, ratio  # row 1: advantage -1


def test_micro_batches_add_up_to_the_whole_batch() -> None:
    model = tiny_llama()
    tb = TorchBatch.from_batch(make_batch())
    total = float(tb.loss_mask.sum())
    whole, _ = dapo_loss(response_logprobs(model, tb), tb, LossConfig())
    parts = sum(
        dapo_loss(
            response_logprobs(model, tb.rows(slice(i, i + 1))),
            tb.rows(slice(i, i + 1)),
            LossConfig(),
            total_tokens=total,
        )[0]
        for i in range(2)
    )
    assert float(parts.detach()) == pytest.approx(float(whole.detach()), abs=1e-6)


def test_tokens_without_a_rollout_logprob_are_not_trained() -> None:
    batch = make_batch()
    batch.logprobs_missing[0, 1] = True
    tb = TorchBatch.from_batch(batch)
    assert tb.loss_mask[0, 1] == 0 and tb.loss_mask[0, 0] == 1


def test_kl_penalty_is_zero_at_the_reference_and_positive_away_from_it() -> None:
    tb = TorchBatch.from_batch(make_batch())
    cfg = LossConfig(kl_coef=0.5)
    lp = tb.rollout_logprobs.clone()
    at_ref, _ = dapo_loss(lp, tb, cfg, ref_logprobs=lp.clone())
    no_kl, _ = dapo_loss(lp, tb, LossConfig())
    assert at_ref.item() == pytest.approx(no_kl.item())
    away, _ = dapo_loss(lp, tb, cfg, ref_logprobs=lp - 0.5)
    assert away.item() > at_ref.item()


def test_columns_that_are_padding_in_every_row_are_trimmed_without_changing_the_logprobs() -> None:
    model = tiny_llama()
    narrow = make_batch()
    wide = make_batch()
    extra_p, extra_r = 3, 4
    for name in ("input_ids", "attention_mask", "position_ids"):
        a = getattr(narrow, name)
        setattr(wide, name, np.pad(a, ((0, 0), (extra_p, extra_r))))
    for name in ("loss_mask", "rollout_logprobs", "advantages", "logprobs_missing"):
        setattr(wide, name, np.pad(getattr(narrow, name), ((0, 0), (0, extra_r))))
    wide.prompt_len, wide.response_len = narrow.prompt_len + extra_p, narrow.response_len + extra_r
    tw, tn = TorchBatch.from_batch(wide), TorchBatch.from_batch(narrow)
    assert tw.input_ids.shape == tn.input_ids.shape and tw.prompt_len == tn.prompt_len
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(model, tw), response_logprobs(model, tn))


def test_logprobs_of_only_the_trained_tokens_equal_the_full_computation() -> None:
    model = tiny_llama()
    tb = TorchBatch.from_batch(make_batch())
    full = response_logprobs(model, tb)
    only = tb.loss_mask.bool()
    picked = response_logprobs(model, tb, only=only)
    assert torch.allclose(picked[only], full[only], atol=1e-6) and (picked[~only] == 0).all()
    # The loss and its gradient are the same either way: only sampled tokens enter it.
    a, _ = dapo_loss(full, tb, LossConfig())
    b, _ = dapo_loss(picked, tb, LossConfig())
    assert torch.allclose(a, b, atol=1e-6)


def test_activation_checkpointing_changes_neither_the_loss_nor_its_gradient() -> None:
    from raas.learn.memory import set_checkpointing

    tb = TorchBatch.from_batch(make_batch())
    grads = []
    for on in (False, True):
        model = tiny_llama().train()
        set_checkpointing(model, on)
        assert model.is_activation_checkpointing == on
        loss, _ = dapo_loss(response_logprobs(model, tb, only=tb.loss_mask.bool()), tb, LossConfig())
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
