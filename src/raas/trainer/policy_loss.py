"""The policy-gradient side of the reference trainer, in torch: token log-probs of a batch under the
trainer's model, and the DAPO loss.

The importance ratio is taken against the **rollout** log-probs raas returns (the probabilities the
inference server actually sampled with), not against a recomputation by the trainer: with one optimizer
step per batch the two differ only by the inference engine's numerics (and quantization), and that
difference is exactly what the reference trainer reports as the log-prob mismatch. A ratio against the sampler is also what
keeps carried-over (stale) samples honest: their ratio moves away from 1 and the clip bounds the update.

Loss (DAPO): ``-min(r·A, clip(r, 1-ε_low, 1+ε_high)·A)`` per sampled token with ``ε_high > ε_low``
("clip-higher"), averaged over every sampled token of the batch ("token-level" aggregation, so long
answers weigh per token, not per sample); optionally ``+ β·KL(π‖π_ref)`` with the k3 estimator (DAPO
runs KL-free: ``β = 0``, no reference model kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from raas.trainer.grpo import Batch


@dataclass
class TorchBatch:
    """The tensors of a :class:`~raas.trainer.grpo.Batch` the loss needs, on one device."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    """``[B, R]`` float: 1 on sampled tokens trained on."""
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    prompt_len: int

    @classmethod
    def from_batch(cls, batch: Batch, device: torch.device | str = "cpu") -> TorchBatch:
        """The batch's tensors without the columns that are padding in every row: a batch is laid out for
        the longest prompt and response allowed, a forward pass needs only the longest present."""
        P = batch.prompt_len
        real: np.ndarray = np.asarray(batch.attention_mask.any(axis=0))
        first = int(np.argmax(real[:P])) if real[:P].any() else P - 1
        first = min(first, P - 1)  # the last prompt column predicts the first response token
        r_used = int(np.nonzero(real[P:])[0].max()) + 1 if real[P:].any() else 1
        cols = slice(first, P + r_used)
        rcols = slice(0, r_used)

        def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

        return cls(
            input_ids=t(batch.input_ids[:, cols], torch.long),
            attention_mask=t(batch.attention_mask[:, cols], torch.long),
            position_ids=t(batch.position_ids[:, cols], torch.long),
            # Tokens the server gave no logprob for cannot get an importance ratio: not trained on.
            loss_mask=t((batch.loss_mask * ~batch.logprobs_missing)[:, rcols], torch.float32),
            rollout_logprobs=t(batch.rollout_logprobs[:, rcols], torch.float32),
            advantages=t(batch.advantages[:, rcols], torch.float32),
            prompt_len=P - first,
        )

    def rows(self, index: slice) -> TorchBatch:
        """Rows ``index``, without the columns that are padding in all of them (a micro-batch of short
        rows does not pay for the batch's longest)."""
        ids, mask = self.input_ids[index], self.attention_mask[index]
        P = self.prompt_len
        real = mask.any(dim=0)
        first = min(int(real[:P].nonzero().min()) if real[:P].any() else P - 1, P - 1)
        r_used = int(real[P:].nonzero().max()) + 1 if real[P:].any() else 1
        cols, rcols = slice(first, P + r_used), slice(0, r_used)
        return TorchBatch(
            ids[:, cols],
            mask[:, cols],
            self.position_ids[index][:, cols],
            self.loss_mask[index][:, rcols],
            self.rollout_logprobs[index][:, rcols],
            self.advantages[index][:, rcols],
            P - first,
        )

    @property
    def tokens(self) -> int:
        """Token positions a forward pass over this batch computes (rows x columns)."""
        return int(self.input_ids.shape[0] * self.input_ids.shape[1])


def response_logprobs(
    model: Any, batch: TorchBatch, temperature: float = 1.0, *, only: torch.Tensor | None = None
) -> torch.Tensor:
    """``[B, R]`` log-probability of each response token under ``model`` (at the sampling temperature).

    Only the positions that predict response tokens go through the LM head, and with ``only`` (a ``[B, R]``
    bool mask, e.g. the loss mask) only those: a multi-turn row's tool observations are most of its
    response, and the head's ``[tokens, vocab]`` logits are most of a forward pass's memory. Positions left
    out are 0."""
    P = batch.prompt_len
    out = model.model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    hidden = out.last_hidden_state[:, P - 1 : -1, :]  # position t predicts token t+1
    targets = batch.input_ids[:, P:]
    if only is not None:
        picked = only.bool()
        logits = model.lm_head(hidden[picked]).float()
        if temperature != 1.0:
            logits = logits / temperature
        chosen = torch.log_softmax(logits, dim=-1).gather(-1, targets[picked].unsqueeze(-1)).squeeze(-1)
        full = torch.zeros(targets.shape, dtype=chosen.dtype, device=chosen.device)
        return full.masked_scatter(picked, chosen)
    logits = model.lm_head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@dataclass
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    """DAPO's clip-higher: room for low-probability tokens to gain mass (ε_high > ε_low)."""
    kl_coef: float = 0.0
    """β of the k3 KL penalty against the reference policy; 0 is DAPO's KL-free setting."""


def dapo_loss(
    logprobs: torch.Tensor,
    batch: TorchBatch,
    config: LossConfig,
    *,
    ref_logprobs: torch.Tensor | None = None,
    total_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy-gradient loss over the sampled tokens of ``batch`` (see the module docstring).

    ``total_tokens``: the number of sampled tokens in the whole batch when ``batch`` is one micro-batch of
    it, so that the sum over micro-batches is the token mean of the whole batch."""
    mask = batch.loss_mask
    n = float(total_tokens if total_tokens is not None else mask.sum().item())
    n = max(n, 1.0)
    log_ratio = (logprobs - batch.rollout_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = batch.advantages
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if config.kl_coef and ref_logprobs is not None:
        d = ref_logprobs - logprobs
        per_token = per_token + config.kl_coef * (torch.exp(d) - d - 1.0)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        sampled = mask.bool()
        r = ratio[sampled]
        clip_frac = ((r < 1.0 - config.clip_low) | (r > 1.0 + config.clip_high)).float()
        stats = {
            "ratio_mean": float(r.mean()) if r.numel() else 1.0,
            "ratio_max": float(r.max()) if r.numel() else 1.0,
            "clip_fraction": float(clip_frac.mean()) if r.numel() else 0.0,
            "approx_kl": float((-log_ratio[sampled]).mean()) if r.numel() else 0.0,
        }
    return loss, stats
