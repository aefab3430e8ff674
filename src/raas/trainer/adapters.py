"""Hand a :class:`~raas.trainer.grpo.Batch` to a trainer in the shape it consumes.

Neither trainer is a dependency of raas: each adapter imports it only if it is installed, and otherwise
returns plain containers with the same keys, so the conversion is usable (and testable) anywhere.

* :func:`to_verl`: the keys verl's PPO/GRPO trainer reads from ``DataProto.batch`` — ``prompts``,
  ``responses``, ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask`` (verl's name for the
  loss mask of multi-turn rollouts), ``rollout_log_probs``, ``token_level_scores`` / ``token_level_rewards``
  / ``rm_scores`` (the reward on the last response token), ``advantages`` and ``returns`` — and
  ``non_tensor_batch["uid"]`` (the group id, which verl's GRPO groups by) and
  ``non_tensor_batch["multi_modal_inputs"]`` (empty dicts: verl's fit loop reads it for every batch).
  tests/trainer/test_verl_contract.py runs verl's own code on this output.
* :func:`to_nemo_rl`: NeMo RL's message-log form: per sample a list of messages, each with its own
  ``token_ids`` (the prompt, then alternating ``assistant`` runs of sampled tokens, with
  ``generation_logprobs``, and ``environment`` runs of tokens added between turns), ``token_loss_mask``
  and ``advantages``; plus ``total_reward``, ``loss_multiplier`` and ``length`` per sample.

A result with several token segments is several rows (:func:`raas.trainer.grpo.assemble_batch`) that share
its group id, reward and advantage; ``raas_sample_index`` / ``raas_segment_index`` (verl's non-tensor batch)
and ``sample_index`` / ``segment_index`` (NeMo RL) tell them apart. A trainer that recomputes group baselines
from rows (verl's ``compute_advantage`` grouped by ``uid``, NeMo RL's baseline over ``total_reward``) would
count each segment row as a sample: for such batches use the advantages raas computed (once per sample).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

from raas.trainer.grpo import Batch


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _last_token_scores(batch: Batch) -> np.ndarray:
    """``[B, R]``: each row's reward on its last response token (verl's token-level score layout).

    A row with an empty response keeps its reward too, in the last column: verl's agent loop writes
    ``rm_scores[b, response_length - 1]``, which is index -1 there. Every outcome estimator of verl sums a
    row's ``token_level_rewards``, so a reward left out would leave that row out of its group's baseline."""
    scores = np.zeros(batch.loss_mask.shape, dtype=np.float32)
    lengths = batch.response_attention_mask.sum(axis=1)
    for b, n in enumerate(lengths):
        scores[b, int(n) - 1 if n > 0 else -1] = batch.rewards[b]
    return scores


def verl_arrays(batch: Batch) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The tensor and non-tensor fields of :func:`to_verl` as numpy arrays."""
    scores = _last_token_scores(batch)
    tensors = {
        "prompts": batch.prompts.copy(),
        "responses": batch.responses.copy(),
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
        "response_mask": batch.loss_mask,
        "rollout_log_probs": batch.rollout_logprobs,
        "token_level_scores": scores,
        "token_level_rewards": scores.copy(),
        "rm_scores": scores.copy(),
        "advantages": batch.advantages,
        "returns": batch.advantages.copy(),
    }
    groups = np.array([batch.group_ids[g] for g in batch.group_index], dtype=object)
    # verl's fit loop reads non_tensor_batch["multi_modal_inputs"] unconditionally (one dict per row, empty
    # for text; its agent loop always sets it): without the key the step fails with a KeyError.
    multi_modal = np.empty(batch.size, dtype=object)
    multi_modal[:] = [{} for _ in range(batch.size)]
    non_tensors = {
        "uid": groups,
        "raas_job_id": np.array(batch.job_ids, dtype=object),
        "raas_sample_index": np.asarray(batch.sample_index, dtype=np.int64),
        "raas_segment_index": np.asarray(batch.segment_index, dtype=np.int64),
        "multi_modal_inputs": multi_modal,
    }
    return tensors, non_tensors


def to_verl(batch: Batch, meta_info: dict[str, Any] | None = None) -> Any:
    """A ``verl.DataProto`` when verl is importable; otherwise ``{"batch": {...numpy}, "non_tensor_batch":
    {...}, "meta_info": {...}}`` with the same keys."""
    tensors, non_tensors = verl_arrays(batch)
    meta = {"raas": dict(batch.stats), **(meta_info or {})}
    if _installed("verl") and _installed("torch"):
        import torch
        from verl import DataProto

        return DataProto.from_dict(
            tensors={k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
            non_tensors=non_tensors,
            meta_info=meta,
        )
    return {"batch": tensors, "non_tensor_batch": non_tensors, "meta_info": meta}


def nemo_rl_message_logs(batch: Batch) -> list[list[dict[str, Any]]]:
    """Per sample, its messages with numpy ``token_ids`` (see the module docstring)."""
    logs: list[list[dict[str, Any]]] = []
    P = batch.prompt_len
    for b in range(batch.size):
        attention = batch.attention_mask[b]
        prompt = batch.input_ids[b, :P][attention[:P] == 1]
        adv = float(batch.advantages[b][batch.loss_mask[b] == 1][0]) if batch.loss_mask[b].any() else 0.0
        messages: list[dict[str, Any]] = [
            {
                "role": "user",
                "content": "",
                "token_ids": prompt.astype(np.int64),
                "token_loss_mask": np.zeros(len(prompt), dtype=np.int64),
                "advantages": np.full(len(prompt), adv, dtype=np.float32),
            }
        ]
        for start, end, role in batch.segments[b]:
            ids = batch.input_ids[b, P + start : P + end].astype(np.int64)
            msg: dict[str, Any] = {
                "role": role,
                "content": "",
                "token_ids": ids,
                "token_loss_mask": batch.loss_mask[b, start:end].astype(np.int64),
                "advantages": np.full(len(ids), adv, dtype=np.float32),
            }
            if role == "assistant":
                msg["generation_logprobs"] = batch.rollout_logprobs[b, start:end].astype(np.float32)
            messages.append(msg)
        logs.append(messages)
    return logs


def to_nemo_rl(batch: Batch) -> Any:
    """NeMo RL's batch of message logs: torch tensors when torch is importable (numpy otherwise), wrapped
    in ``nemo_rl``'s ``BatchedDataDict`` when NeMo RL is installed (a plain dict otherwise)."""
    logs = nemo_rl_message_logs(batch)
    lengths = batch.attention_mask.sum(axis=1).astype(np.int64)
    data: dict[str, Any] = {
        "message_log": logs,
        "total_reward": batch.rewards.astype(np.float32),
        "loss_multiplier": (~batch.overlong).astype(np.float32),
        "length": lengths,
        "uid": [batch.group_ids[g] for g in batch.group_index],
        "sample_index": np.asarray(batch.sample_index, dtype=np.int64),
        "segment_index": np.asarray(batch.segment_index, dtype=np.int64),
    }
    if _installed("torch"):
        import torch

        for messages in logs:
            for m in messages:
                for key in ("token_ids", "token_loss_mask", "advantages", "generation_logprobs"):
                    if key in m:
                        m[key] = torch.from_numpy(np.ascontiguousarray(m[key]))
        for key in ("total_reward", "loss_multiplier", "length", "sample_index", "segment_index"):
            data[key] = torch.from_numpy(data[key])
    # The module itself, not the package: PyPI's only `nemo-rl` (0.0.0) is an empty placeholder package.
    if _installed("nemo_rl.distributed.batched_data_dict"):
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        return BatchedDataDict(data)
    return data
