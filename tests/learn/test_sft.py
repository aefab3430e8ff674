"""The fine-tune's rows and loss on a tiny random llama: only the policy's own sampled tokens are targets
(never the prompt, a tool observation or the template), a result that did not resolve is not a row, and
the loss is the plain cross-entropy of exactly those tokens; partial training freezes what it says."""

from __future__ import annotations

import pytest
import torch

from raas.core.jobs import JobResult
from raas.core.trajectory import TokenTrajectory
from raas.errors import RaasError
from raas.learn.memory import activation_budget, set_trainable_layers
from raas.learn.sft import Row, _loss_sum, _micro_batches, rows_of
from tests.learn.test_policy_loss import tiny_llama

pytestmark = pytest.mark.unit


def result(reward: float | None, mask: list[int], status: str = "completed") -> JobResult:
    return JobResult(
        job_id=f"j{reward}",
        status=status,  # type: ignore[arg-type]
        reward=reward,
        filter=False,
        token_trajectory=TokenTrajectory(
            prompt_ids=[5, 6, 7],
            response_ids=[10, 11, 12, 13, 14],
            loss_mask=mask,
            logprobs=[0.0] * len(mask),
        ),
    )


def test_rows_keep_only_resolved_results_and_target_only_sampled_tokens() -> None:
    mask = [1, 1, 0, 0, 1]  # two sampled tokens, an observation of two, one sampled
    rows = rows_of(
        [result(1.0, mask), result(0.0, mask), result(None, mask), result(1.0, mask, status="failed")], 1.0
    )
    assert len(rows) == 1
    assert rows[0].ids == [5, 6, 7, 10, 11, 12, 13, 14]
    assert rows[0].targets == [False, False, False, True, True, False, False, True]
    assert rows_of([result(0.5, mask)], 0.5) and not rows_of([result(1.0, [0] * 5)], 1.0)
    with pytest.raises(RaasError) as e:
        rows_of([result(1.0, [1, 1])], 1.0)
    assert e.value.kind == "bad_request"


def test_the_loss_is_the_cross_entropy_of_the_targets_alone() -> None:
    model = tiny_llama()
    row = Row([5, 6, 7, 10, 11, 12, 13, 14], [False, False, False, True, True, False, False, True])
    short = Row([8, 9, 20, 21], [False, False, True, True])
    loss, count = _loss_sum(model, [row, short], torch.device("cpu"))
    assert count == 5
    expected = 0.0
    for r in (row, short):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([r.ids])).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        expected -= sum(float(logp[t - 1, r.ids[t]]) for t in range(1, len(r.ids)) if r.targets[t])
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-5)
    # Changing a token that is not a target's own (an observation) changes the loss only through context.
    obs_changed = Row([5, 6, 7, 10, 11, 40, 41, 14], row.targets)
    assert _loss_sum(model, [obs_changed], torch.device("cpu"))[1] == 3


def test_micro_batches_respect_both_budgets() -> None:
    rows = [Row(list(range(n)), [True] * n) for n in (10, 12, 30, 31, 200)]
    batches = _micro_batches(rows, cells=10_000, tokens=64)
    assert [len(r.ids) for b in batches for r in b] == [10, 12, 30, 31, 200]
    for b in batches:
        width = max(len(r.ids) for r in b)
        assert len(b) == 1 or (len(b) * width**2 <= 10_000 and len(b) * width <= 64)


def test_partial_training_freezes_the_layers_below_and_the_embedding() -> None:
    model = tiny_llama()
    total = sum(p.numel() for p in model.parameters())
    top = set_trainable_layers(model, 1)
    assert 0 < top < total
    assert not model.model.embed_tokens.weight.requires_grad and not model.lm_head.weight.requires_grad
    assert all(not p.requires_grad for p in model.model.layers[0].parameters())
    assert all(p.requires_grad for p in model.model.layers[1].parameters())
    assert activation_budget(model, 600, 1) == 1200 and activation_budget(model, 600, None) == 600
    assert set_trainable_layers(model, None) == total
    with pytest.raises(RaasError):
        set_trainable_layers(model, 3)
