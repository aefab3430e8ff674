"""raas as the generator of TRL's ``GRPOTrainer(rollout_func=...)`` (checked against TRL 1.16.0).

Why: TRL then trains on exactly the tokens raas's sandboxes and inference servers produced (multi-turn, tool
observations masked out) and on raas's verifier rewards, instead of generating and scoring itself.

TRL 1.16's contract (``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._generate``): ``rollout_func(prompts,
trainer)`` gets the process's generation batch, in which the ``RepeatSampler`` already put every prompt
``num_generations`` times in a row, and returns one row per entry of ``prompts``, in that order, under
``prompt_ids``, ``completion_ids``, ``logprobs``; ``env_mask`` (1 = sampled by the model) becomes TRL's
``tool_mask``; every other key reaches the reward functions as a keyword argument, one value per row.

A sample raas filtered (an infrastructure failure, a timeout: :func:`~raas.trainer.types.is_valid` false) is
never a reward: the client's :class:`~raas.trainer.records.FailurePolicy` resubmits it first; a sample
still missing then raises (``on_missing="raise"``) or becomes a fully masked row whose ``raas_reward`` is
``None``, which TRL turns into NaN, leaves out of its group's baseline and gives advantage 0 (``"mask"``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from raas.errors import RaasError
from raas.trainer.rollout import RolloutClient
from raas.trainer.sync import SyncRolloutClient
from raas.trainer.types import Group, JobResult, is_valid

__all__ = [
    "RaasRolloutFunc",
    "RaasWeightSyncCallback",
    "groups_to_trl",
    "instance_index",
    "prompt_key",
    "raas_reward",
    "sampling_params_from",
]

OnMissing = Literal["raise", "mask"]


class TrainerLike(Protocol):
    """What the rollout function reads from TRL's ``GRPOTrainer`` (kept structural: TRL stays optional)."""

    num_generations: int
    num_generations_eval: int
    model: Any
    args: Any
    processing_class: Any


def prompt_key(prompt: Any) -> str:
    """The lookup key of a TRL prompt: the text itself, or the messages as canonical JSON (TRL passes
    conversational prompts as lists of dicts)."""
    if isinstance(prompt, str):
        return prompt
    try:
        return json.dumps(prompt, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise RaasError(
            f"prompt of type {type(prompt).__name__} has no JSON key", kind="bad_request"
        ) from exc


def instance_index(
    rows: Iterable[Mapping[str, Any]],
    to_instance: Callable[[Mapping[str, Any]], dict[str, Any]],
    prompt_column: str = "prompt",
) -> dict[str, dict[str, Any]]:
    """``prompt key → raas instance`` for a dataset's rows. TRL hands ``rollout_func`` only the prompts, so
    this index is how the other columns (answer, tests, ...) reach raas. Two rows with the same prompt but
    different instances are refused: the rollout could not tell which one it was asked for."""
    index: dict[str, dict[str, Any]] = {}
    for n, row in enumerate(rows):
        if prompt_column not in row:
            raise RaasError(f"dataset row {n} has no {prompt_column!r} column", kind="bad_request")
        key = prompt_key(row[prompt_column])
        instance = to_instance(row)
        if not isinstance(instance, dict) or not isinstance(instance.get("data_source"), str):
            raise RaasError(f"row {n}: to_instance must return a dict with a data_source", kind="bad_request")
        if key in index and index[key] != instance:
            raise RaasError(
                f"row {n}: prompt {key[:80]!r} maps to two different instances", kind="bad_request"
            )
        index[key] = instance
    return index


def sampling_params_from(args: Any) -> dict[str, Any]:
    """raas sampling params mirroring TRL's ``GRPOConfig``: the trainer rescales logits by ``temperature``
    when it recomputes logprobs, so raas must sample at the same temperature (TRL's ``top_k=0`` and
    ``min_p=None`` mean "off", raas's ``-1`` and ``0``). ``generation_kwargs`` are not translated."""
    params: dict[str, Any] = {
        "temperature": float(args.temperature),
        "top_p": float(args.top_p),
        "top_k": int(args.top_k) if args.top_k else -1,
        "min_p": float(args.min_p or 0.0),
        "repetition_penalty": float(args.repetition_penalty),
    }
    if args.max_completion_length is not None:
        params["max_tokens"] = int(args.max_completion_length)
    return params


def _row(result: JobResult) -> dict[str, Any]:
    """One TRL row from one usable result; refuses what TRL could not train on faithfully."""
    if len(result.segments) > 1:
        raise RaasError(
            f"job {result.job_id} has {len(result.segments)} token segments (the agent rewrote its history); "
            "a TRL row is one sequence",
            kind="bad_request",
        )
    tt = result.token_trajectory
    if not (len(tt.response_ids) == len(tt.loss_mask) == len(tt.logprobs)):
        raise RaasError(
            f"job {result.job_id}: response, mask and logprobs differ in length", kind="bad_request"
        )
    if not tt.prompt_ids:
        raise RaasError(f"job {result.job_id}: empty prompt_ids", kind="bad_request")
    versions = [t.weight_version for t in result.turns if t.weight_version is not None]
    return {
        "prompt_ids": list(tt.prompt_ids),
        "completion_ids": list(tt.response_ids),
        # None (no logprob reported) is what TRL maps to NaN: no importance-sampling correction there.
        "logprobs": list(tt.logprobs),
        "env_mask": [int(m) for m in tt.loss_mask],
        "raas_reward": float(result.reward) if result.reward is not None else None,
        "raas_job_id": result.job_id,
        "raas_weight_version": versions[0] if versions else None,
    }


def _filler(prompt_ids: list[int], pad_id: int, reward: float | None, job_id: str | None) -> dict[str, Any]:
    """A row with nothing to learn from: one pad token, mask 0 (TRL's ``ids[-1]`` needs a token)."""
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": [pad_id],
        "logprobs": [0.0],
        "env_mask": [0],
        "raas_reward": reward,
        "raas_job_id": job_id,
        "raas_weight_version": None,
    }


def groups_to_trl(
    groups: Sequence[Group], n: int, *, pad_id: int, on_missing: OnMissing = "raise"
) -> dict[str, list[Any]]:
    """TRL's rollout output for ``groups`` (in order), ``n`` rows each: the first ``n`` usable samples by
    trajectory index (refills included). A usable sample with an empty response keeps its reward (it is a
    real member of its group's baseline) on a masked pad token. Missing samples: see the module doc."""
    if on_missing not in ("raise", "mask"):
        raise RaasError(f"on_missing must be 'raise' or 'mask', got {on_missing!r}", kind="bad_request")
    rows: list[dict[str, Any]] = []
    for g in groups:
        samples = [r for r in g.samples if is_valid(r)][:n]  # defensive: the client keeps only these
        if len(samples) < n and on_missing == "raise":
            kinds = sorted({f.error.kind for f in g.failures if f.error is not None}) or ["unknown"]
            raise RaasError(
                f"group {g.group_id}: {len(samples)} of {n} samples usable after resubmits "
                f"({len(g.failures)} filtered: {', '.join(kinds)}); on_missing='mask' trains on the rest",
                kind="unavailable",
            )
        for r in samples:
            row = _row(r)
            if not row["completion_ids"]:
                row = _filler(row["prompt_ids"], pad_id, row["raas_reward"], r.job_id)
            rows.append(row)
        prompt = samples[0].token_trajectory.prompt_ids if samples else [pad_id]
        rows.extend(_filler(list(prompt), pad_id, None, None) for _ in range(n - len(samples)))
    keys = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "raas_reward", "raas_job_id")
    out = {k: [row[k] for row in rows] for k in keys}
    out["raas_weight_version"] = [row["raas_weight_version"] for row in rows]
    return out


def raas_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """TRL reward function returning raas's verifier reward of every row (``None`` for a masked missing
    sample: TRL leaves it out of the baseline). Pass it as the (only) reward function."""
    rewards = kwargs.get("raas_reward")
    if rewards is None or len(rewards) != len(completions):
        raise RaasError("raas_reward needs the raas rollout_func's raas_reward field", kind="bad_request")
    return [None if r is None or (isinstance(r, float) and math.isnan(r)) else float(r) for r in rewards]


@dataclass
class TRLRolloutStats:
    """Counters; ``foreign_groups``: finished groups no call waited for (a shared client, a failed call)."""

    calls: int = 0
    groups: int = 0
    rows: int = 0
    masked_rows: int = 0
    foreign_groups: int = 0


class RaasRolloutFunc:
    """``GRPOTrainer(rollout_func=RaasRolloutFunc(client, index), reward_funcs=[raas_reward], ...)``.

    ``instances`` maps :func:`prompt_key` of each prompt to its raas instance (see :func:`instance_index`), or
    is a function of the prompt. ``client`` must be dedicated to this function (it takes every finished
    group); give it ``FailurePolicy(min_group_size=num_generations, refill=True)`` to replace lost samples
    by fresh ones. ``sampling_params`` override those derived from the trainer's config."""

    def __init__(
        self,
        client: SyncRolloutClient,
        instances: Mapping[str, dict[str, Any]] | Callable[[Any], dict[str, Any]],
        *,
        sampling_params: Mapping[str, Any] | None = None,
        on_missing: OnMissing = "raise",
        timeout_s: float | None = None,
        on_output: Callable[[list[Any], dict[str, list[Any]]], None] | None = None,
    ) -> None:
        if on_missing not in ("raise", "mask"):
            raise RaasError(f"on_missing must be 'raise' or 'mask', got {on_missing!r}", kind="bad_request")
        self.client = client
        self.instances = instances
        self.sampling_params = dict(sampling_params or {})
        self.on_missing: OnMissing = on_missing
        self.timeout_s = timeout_s
        self.on_output = on_output
        self.stats = TRLRolloutStats()

    def instance_for(self, prompt: Any) -> dict[str, Any]:
        if callable(self.instances):
            return self.instances(prompt)
        key = prompt_key(prompt)
        if key not in self.instances:
            raise RaasError(f"no raas instance for prompt {key[:80]!r}", kind="not_found")
        return self.instances[key]

    def __call__(self, prompts: list[Any], trainer: TrainerLike) -> dict[str, list[Any]]:
        n = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        if n < 1 or len(prompts) % n:
            raise RaasError(
                f"{len(prompts)} prompts are not groups of num_generations={n}", kind="bad_request"
            )
        chunks = [prompts[i : i + n] for i in range(0, len(prompts), n)]
        for chunk in chunks:
            if any(prompt_key(p) != prompt_key(chunk[0]) for p in chunk):
                raise RaasError(
                    f"TRL's prompts are not runs of {n} equal prompts (RepeatSampler order expected)",
                    kind="bad_request",
                )
        instances = [self.instance_for(chunk[0]) for chunk in chunks]
        params = {**sampling_params_from(trainer.args), **self.sampling_params}
        groups = self.client.run(lambda c: self._rollout(c, instances, n, params), timeout=None)
        out = groups_to_trl(groups, n, pad_id=_pad_id(trainer.processing_class), on_missing=self.on_missing)
        self.stats.calls += 1
        self.stats.groups += len(groups)
        self.stats.rows += len(out["prompt_ids"])
        self.stats.masked_rows += sum(1 for job in out["raas_job_id"] if job is None)
        if self.on_output is not None:
            self.on_output(prompts, out)
        return out

    async def _rollout(
        self, c: RolloutClient, instances: list[dict[str, Any]], n: int, params: dict[str, Any]
    ) -> list[Group]:
        """Submit one group per prompt and wait for all of them; on any error (a timeout included) the
        unfinished ones are cancelled so no sandbox keeps running for a batch nobody will train on."""
        groups = [c.new_group(inst, n, sampling_params=params) for inst in instances]
        await c.submit_groups(groups)
        want = {g.group_id for g in groups}
        done: set[str] = set()
        try:
            while want - done:
                g = await c.next_group(timeout=self.timeout_s)
                if g.group_id in want:
                    done.add(g.group_id)
                else:
                    self.stats.foreign_groups += 1
        except TimeoutError as exc:
            await c.cancel_groups(groups)
            raise RaasError(
                f"{len(want - done)} of {len(groups)} groups not finished in {self.timeout_s} s",
                kind="timeout",
            ) from exc
        except BaseException:
            await c.cancel_groups(groups)
            raise
        return groups


def _pad_id(processing_class: Any) -> int:
    tok = getattr(processing_class, "tokenizer", processing_class)  # a processor wraps its tokenizer
    pad = getattr(tok, "pad_token_id", None)
    pad = getattr(tok, "eos_token_id", None) if pad is None else pad
    if not isinstance(pad, int):
        raise RaasError("the trainer's tokenizer has neither a pad nor an eos token id", kind="bad_request")
    return pad


class RaasWeightSyncCallback(TrainerCallback):
    """After every ``every``-th optimizer step: pause raas, ``sync(model, step)`` (push the new weights into
    the inference servers), stamp version ``str(step)`` on them, resume. At the start of training the
    servers are stamped ``"0"`` (the weights they already hold). Without it raas keeps sampling from the
    initial weights and TRL trains increasingly off-policy."""

    def __init__(
        self, client: SyncRolloutClient, sync: Callable[[Any, int], None] | None, every: int = 1
    ) -> None:
        if every < 1:
            raise RaasError(f"every must be >= 1, got {every}", kind="bad_request")
        self.client = client
        self.sync = sync
        self.every = every
        self.synced: list[int] = []

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.client.run(lambda c: c.set_weight_version(str(state.global_step)))

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        step = state.global_step
        if step % self.every:
            return
        model, sync = kwargs.get("model"), self.sync
        self.client.weight_sync(str(step), (lambda: sync(model, step)) if sync is not None else None)
        self.synced.append(step)
