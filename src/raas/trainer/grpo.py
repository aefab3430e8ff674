"""GRPO advantages and padded training batches from finished groups, as numpy arrays.

The batch layout is the one verl and most PPO/GRPO trainers use: ``input_ids = prompt ⧺ response`` with the
prompt **left**-padded to ``max_prompt_len`` and the response **right**-padded to ``max_response_len``, so
every row's response starts at the same column. ``loss_mask`` (response columns only) is 1 exactly on the
tokens the policy sampled — the service's ``token_trajectory.loss_mask`` — and 0 on everything the
environment or the chat template added between turns (tool observations, role headers), and on padding.

Only usable results (:func:`raas.trainer.types.is_valid`) ever enter a batch: a filtered result (infrastructure
failure) is neither a row nor part of its group's baseline.

A result with several token segments (an agent behind the gateway rewrote its history: ``JobResult.segments``)
gives one row per segment, each token-exact on its own, so every sampled token reaches the trainer; the rows
share the sample's reward and advantage (the group baseline counts the sample once) and
``Batch.sample_index`` / ``Batch.segment_index`` tell them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from raas.errors import RaasError
from raas.trainer.types import Group, JobResult, TokenTrajectory, is_valid, version_number

Overlong = Literal["mask", "drop"]


def group_advantages(
    rewards: Sequence[float],
    *,
    std_normalize: bool = False,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> np.ndarray:
    """Group-relative advantages of one group's rewards.

    * default: ``r_i - mean(r)`` (mean-centred);
    * ``leave_one_out``: ``r_i - mean(r_j, j != i)`` (RLOO; 0 for a group of one);
    * ``std_normalize``: the above divided by ``std(r) + eps`` with the sample standard deviation
      (``ddof=1``, as ``torch.std`` in verl's GRPO), 0 for a group of one.
    """
    r = np.asarray(rewards, dtype=np.float64)
    n = r.size
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    if leave_one_out:
        adv = (r - (r.sum() - r) / (n - 1)) if n > 1 else np.zeros_like(r)
    else:
        adv = r - r.mean()
    if std_normalize:
        std = float(r.std(ddof=1)) if n > 1 else 0.0
        adv = adv / (std + eps)
    return adv.astype(np.float32)


@dataclass
class Batch:
    """A padded training batch; ``B`` rows, ``P = max_prompt_len``, ``R = max_response_len``."""

    input_ids: np.ndarray
    """``[B, P+R]`` int64: left-padded prompt, then right-padded response."""
    attention_mask: np.ndarray
    """``[B, P+R]`` int64: 1 on real tokens."""
    position_ids: np.ndarray
    """``[B, P+R]`` int64: ``cumsum(attention_mask) - 1``, clipped at 0."""
    loss_mask: np.ndarray
    """``[B, R]`` int64: 1 on sampled tokens that are trained on."""
    rollout_logprobs: np.ndarray
    """``[B, R]`` float32: the sampling logprob of each response token (0 where unknown or not sampled)."""
    advantages: np.ndarray
    """``[B, R]`` float32: the row's group-relative advantage on its ``loss_mask`` tokens, else 0."""
    rewards: np.ndarray
    """``[B]`` float32."""
    logprobs_missing: np.ndarray
    """``[B, R]`` bool: sampled tokens whose logprob the inference server did not report (recompute them)."""
    overlong: np.ndarray
    """``[B]`` bool: rows truncated to fit (their ``loss_mask`` is all 0)."""
    group_index: np.ndarray
    """``[B]`` int64: which group (index into ``group_ids``) each row belongs to."""
    prompt_len: int
    response_len: int
    sample_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """``[B]`` int64: which sample (usable result, numbered 0.. in batch order) each row comes from. Rows of
    one result with several token segments share it, and with it their reward and advantage."""
    segment_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """``[B]`` int64: which of its result's token segments (:func:`token_segments`) the row holds; 0 for a
    one-sequence result."""
    group_ids: list[str] = field(default_factory=list)
    job_ids: list[str] = field(default_factory=list)
    """Per row: the job it comes from (repeated for the rows of a segmented result)."""
    segments: list[list[tuple[int, int, str]]] = field(default_factory=list)
    """Per row: ``(start, end, role)`` runs of the response columns, ``assistant`` for sampled tokens and
    ``environment`` for tokens added between turns (what NeMo RL's message log needs). Not to be confused
    with a result's token segments (``segment_index``)."""
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """A batch built by hand without them has one row per sample, each its sample's only segment."""
        if len(self.sample_index) != self.size:
            self.sample_index = np.arange(self.size, dtype=np.int64)
        if len(self.segment_index) != self.size:
            self.segment_index = np.zeros(self.size, dtype=np.int64)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompts(self) -> np.ndarray:
        return self.input_ids[:, : self.prompt_len]

    @property
    def responses(self) -> np.ndarray:
        return self.input_ids[:, self.prompt_len :]

    @property
    def response_attention_mask(self) -> np.ndarray:
        return self.attention_mask[:, self.prompt_len :]


def token_segments(result: JobResult) -> list[TokenTrajectory]:
    """Every token sequence of ``result`` in order: its ``segments`` when the agent rewrote its history
    (``token_trajectory`` is then only one of them), else ``token_trajectory`` alone."""
    return list(result.segments) if result.segments else [result.token_trajectory]


def segment_turns(result: JobResult) -> list[list[int]]:
    """Per token segment, the turns (indices into ``result.turns``) whose sampled tokens it holds, in order.

    A one-sequence result holds all its turns. A segmented one maps its segments, in order, to the distinct
    ``Turn.segment`` values in ascending order (the gateway numbers segments as it opens them); a result
    whose turns name a different number of segments is refused (``bad_request``)."""
    segs = token_segments(result)
    if len(segs) == 1:
        return [list(range(len(result.turns)))]
    ids = sorted({t.segment for t in result.turns})
    if len(ids) != len(segs):
        raise RaasError(
            f"job {result.job_id}: {len(segs)} token segments but its turns name {len(ids)}",
            kind="bad_request",
        )
    where = {s: k for k, s in enumerate(ids)}
    out: list[list[int]] = [[] for _ in segs]
    for i, t in enumerate(result.turns):
        out[where[t.segment]].append(i)
    return out


def sampled_turn_of_tokens(result: JobResult, segment: int | None = None) -> list[int]:
    """For every response token of a token segment, the index of the turn that sampled it (-1 for tokens
    not sampled). ``segment``: an index into :func:`token_segments`; None is ``token_trajectory``.

    A segment's sampled tokens appear in turn order, so the k-th run of mask-1 tokens is the k-th of its
    turns' ``output_ids`` (:func:`segment_turns`); a trajectory where the two disagree is refused
    (``bad_request``)."""
    segs = token_segments(result)
    if segment is None and len(segs) == 1:
        segment = 0
    elif segment is None:
        found = [k for k, s in enumerate(segs) if s == result.token_trajectory]
        if not found:
            raise RaasError(
                f"job {result.job_id}: token_trajectory is none of its segments", kind="bad_request"
            )
        segment = found[-1]
    if not 0 <= segment < len(segs):
        raise RaasError(
            f"job {result.job_id}: no token segment {segment} (it has {len(segs)})", kind="bad_request"
        )
    where = "token_trajectory" if len(segs) == 1 else f"token segment {segment}"
    traj, turn_ids = segs[segment], segment_turns(result)[segment]
    owners: list[int] = []
    k, used = 0, 0
    lengths = [len(result.turns[i].output_ids) for i in turn_ids]
    for token, m in zip(traj.response_ids, traj.loss_mask, strict=True):
        if not m:
            owners.append(-1)
            continue
        while k < len(lengths) and used >= lengths[k]:
            k, used = k + 1, 0
        if k >= len(lengths) or result.turns[turn_ids[k]].output_ids[used] != token:
            raise RaasError(
                f"job {result.job_id}: the sampled tokens of {where} do not match its turns",
                kind="bad_request",
            )
        owners.append(turn_ids[k])
        used += 1
    if sum(lengths) != sum(1 for o in owners if o >= 0):
        raise RaasError(
            f"job {result.job_id}: {where} has fewer sampled tokens than its turns",
            kind="bad_request",
        )
    return owners


def _segments(mask: Sequence[int]) -> list[tuple[int, int, str]]:
    out: list[tuple[int, int, str]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or bool(mask[i]) != bool(mask[start]):
            out.append((start, i, "assistant" if mask[start] else "environment"))
            start = i
    return out


def assemble_batch(
    groups: Sequence[Group],
    pad_id: int,
    max_prompt_len: int,
    max_response_len: int,
    *,
    std_normalize: bool = False,
    leave_one_out: bool = False,
    overlong: Overlong = "mask",
    mask_turns_before: int | None = None,
    eps: float = 1e-6,
) -> Batch:
    """Training arrays for ``groups`` (each group's usable samples, in order).

    ``overlong``: a row whose prompt or response does not fit is either kept truncated (prompt keeps its
    last ``max_prompt_len`` tokens, response its first ``max_response_len``) with its whole ``loss_mask``
    set to 0 (``"mask"``: it still counts in its group's baseline, DAPO's overlong filtering), or left out
    (``"drop"``). ``mask_turns_before=v``: tokens of turns sampled by a policy older than ``v`` (their
    ``weight_version``) get ``loss_mask`` 0 — for trajectories carried across a weight update.

    A result with several token segments gives one row per segment (:func:`token_segments`), each with the
    sample's reward and advantage; the baseline is still computed over samples, not rows. ``overlong`` and
    stale masking apply per row (a dropped segment leaves the sample's other rows in).
    """
    if max_prompt_len < 1 or max_response_len < 1:
        raise RaasError("max_prompt_len and max_response_len must be >= 1", kind="bad_request")
    if overlong not in ("mask", "drop"):
        raise RaasError(f"overlong must be 'mask' or 'drop', got {overlong!r}", kind="bad_request")
    P, R = max_prompt_len, max_response_len
    rows: list[dict[str, Any]] = []
    stats = {"groups": 0, "skipped_groups": 0, "excluded_results": 0, "overlong": 0, "dropped_overlong": 0}
    stats["masked_stale_tokens"] = 0
    group_ids: list[str] = []
    next_sample = 0
    for group in groups:
        if group.dropped or group.cancelled:
            stats["skipped_groups"] += 1
            continue
        samples = [r for r in group.samples if is_valid(r)]
        stats["excluded_results"] += len(group.samples) - len(samples)
        if not samples:
            stats["skipped_groups"] += 1
            continue
        adv = group_advantages(
            [float(r.reward) for r in samples],  # type: ignore[arg-type]
            std_normalize=std_normalize,
            leave_one_out=leave_one_out,
            eps=eps,
        )
        gi = len(group_ids)
        group_ids.append(group.group_id)
        stats["groups"] += 1
        for result, a in zip(samples, adv, strict=True):
            kept: list[dict[str, Any]] = []
            for k, traj in enumerate(token_segments(result)):
                row = _row(result, k, traj, float(a), gi, P, R, overlong, mask_turns_before, stats)
                if row is not None:
                    kept.append(row)
            for row in kept:
                row["sample"] = next_sample
            next_sample += 1 if kept else 0
            rows.extend(kept)
    return _stack(rows, pad_id, P, R, group_ids, stats)


def _row(
    result: JobResult,
    segment: int,
    traj: TokenTrajectory,
    adv: float,
    gi: int,
    P: int,
    R: int,
    overlong: Overlong,
    mask_turns_before: int | None,
    stats: dict[str, int],
) -> dict[str, Any] | None:
    """One row: token segment ``segment`` (``traj``) of ``result``."""
    n = len(traj.response_ids)
    if len(traj.loss_mask) != n or len(traj.logprobs) != n:
        where = f" (token segment {segment})" if result.segments else ""
        raise RaasError(
            f"job {result.job_id}: response_ids, loss_mask and logprobs differ in length{where}",
            kind="bad_request",
        )
    prompt = list(traj.prompt_ids)
    response = list(traj.response_ids)
    sampled = [1 if m else 0 for m in traj.loss_mask]
    mask = list(sampled)
    if mask_turns_before is not None and result.turns:
        owners = sampled_turn_of_tokens(result, segment)
        old = {
            i
            for i, t in enumerate(result.turns)
            if (v := version_number(t.weight_version)) is not None and v < mask_turns_before
        }
        for i, o in enumerate(owners):
            if o in old and mask[i]:
                mask[i] = 0
                stats["masked_stale_tokens"] += 1
    logprobs = list(traj.logprobs)
    too_long = len(prompt) > P or n > R
    if too_long:
        stats["overlong"] += 1
        if overlong == "drop":
            stats["dropped_overlong"] += 1
            return None
        prompt, response = prompt[-P:] if P else [], response[:R]
        mask = [0] * len(response)
        sampled, logprobs = sampled[:R], logprobs[:R]
    return {
        "prompt": prompt,
        "response": response,
        "mask": mask,
        "sampled": sampled,
        "logprobs": logprobs,
        "adv": adv,
        "reward": float(result.reward),  # type: ignore[arg-type]
        "overlong": too_long,
        "group": gi,
        "segment": segment,
        "job_id": result.job_id,
    }


def _stack(
    rows: list[dict[str, Any]], pad_id: int, P: int, R: int, group_ids: list[str], stats: dict[str, int]
) -> Batch:
    B = len(rows)
    input_ids = np.full((B, P + R), pad_id, dtype=np.int64)
    attention = np.zeros((B, P + R), dtype=np.int64)
    loss_mask = np.zeros((B, R), dtype=np.int64)
    logprobs = np.zeros((B, R), dtype=np.float32)
    missing = np.zeros((B, R), dtype=bool)
    advantages = np.zeros((B, R), dtype=np.float32)
    rewards = np.zeros(B, dtype=np.float32)
    overlong = np.zeros(B, dtype=bool)
    group_index = np.zeros(B, dtype=np.int64)
    sample_index = np.zeros(B, dtype=np.int64)
    segment_index = np.zeros(B, dtype=np.int64)
    segments: list[list[tuple[int, int, str]]] = []
    for b, row in enumerate(rows):
        prompt, response = row["prompt"], row["response"]
        if prompt:
            input_ids[b, P - len(prompt) : P] = prompt
            attention[b, P - len(prompt) : P] = 1
        if response:
            input_ids[b, P : P + len(response)] = response
            attention[b, P : P + len(response)] = 1
        mask = np.asarray(row["mask"], dtype=np.int64)
        loss_mask[b, : len(mask)] = mask
        for i, lp in enumerate(row["logprobs"]):
            if lp is None:
                missing[b, i] = bool(row["sampled"][i])
            else:
                logprobs[b, i] = lp
        advantages[b, : len(mask)] = row["adv"] * mask
        rewards[b] = row["reward"]
        overlong[b] = row["overlong"]
        group_index[b] = row["group"]
        sample_index[b] = row["sample"]
        segment_index[b] = row["segment"]
        segments.append(_segments(row["sampled"]))
    position_ids = np.clip(np.cumsum(attention, axis=1) - 1, 0, None).astype(np.int64)
    stats["rows"] = B
    return Batch(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=position_ids,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        advantages=advantages,
        rewards=rewards,
        logprobs_missing=missing,
        overlong=overlong,
        group_index=group_index,
        prompt_len=P,
        response_len=R,
        sample_index=sample_index,
        segment_index=segment_index,
        group_ids=group_ids,
        job_ids=[r["job_id"] for r in rows],
        segments=segments,
        stats=stats,
    )
