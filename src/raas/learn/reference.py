"""The reference trainer: GRPO with DAPO dynamic sampling, a policy that really learns through raas.

One loop, readable in one sitting, that a researcher can copy into their own trainer:

1. **Rollouts.** :class:`~raas.trainer.dapo.DynamicSampler` keeps groups running on the raas service and
   returns ``target_groups`` informative groups (reward variance); with ``carry_over`` the rest keeps
   running while the trainer trains (asynchronous), without it the rest is cancelled and the trainer and
   the rollouts take turns (generate-then-train).
2. **Batch.** :func:`~raas.trainer.grpo.assemble_batch`: token-exact prompt/response IDs, the loss mask
   (1 only on sampled tokens; tool observations and template tokens are 0), the rollout log-probs and the
   group-relative advantages. Stale turns from carried-over groups are masked or kept as
   ``mask_stale_turns`` says.
3. **Update.** One AdamW step on the DAPO loss (:mod:`raas.trainer.policy_loss`): importance ratio
   against the rollout log-probs, clip-higher, token-level mean, KL-free by default.
4. **Weight sync.** The new weights are written as a GGUF while rollouts still run, then raas pauses every
   inference call, the llama.cpp server restarts with the new file, the next weight version is stamped,
   and raas resumes (:class:`~raas.trainer.llama_sync.LlamaWeightSync`).
5. **Diagnostics.** Every step logs reward, pass rate, informative fraction, response length, the
   rollout-vs-trainer log-prob mismatch on sampled tokens, the trainer's idle time, sync time and
   tokens/s; every ``eval_every`` steps the held-out pass rate. JSONL + a PNG learning curve.

It trains the embedded SmolLM2-135M-Instruct on the CPU (CUDA when present) — the same loop runs any
llama-architecture GGUF.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from raas.errors import RaasError
from raas.learn.evaluation import evaluate, used_tool
from raas.learn.llama_sync import LlamaWeightSync
from raas.learn.local import rollout_service
from raas.learn.memory import (
    activation_budget,
    release_memory,
    rss_mb,
    set_checkpointing,
    set_trainable_layers,
)
from raas.learn.progress import Progress
from raas.tasks.datasets import load_dataset
from raas.trainer.dapo import DynamicSampler, StepStats
from raas.trainer.grpo import Batch, token_segments
from raas.trainer.hf_weights import TensorType, load_policy
from raas.trainer.pass_rates import PassRateFilter
from raas.trainer.policy_loss import LossConfig, TorchBatch, dapo_loss, response_logprobs
from raas.trainer.rollout import RolloutClient
from raas.trainer.train_log import TrainedResults, TrainLog, plot_learning_curve
from raas.trainer.types import Group, version_number

_log = logging.getLogger("raas.learn")


@dataclass
class TrainConfig:
    """Everything a run depends on; ``raas train --help`` shows each as an option."""

    train_data: str = "builtin:addition:train"
    eval_data: str = "builtin:addition:test"
    steps: int = 40
    group_size: int = 8
    target_groups: int = 8
    max_inflight_groups: int = 12
    carry_over: bool = True
    dynamic_sampling: bool = True
    """DAPO's filter: train only on groups whose rewards differ. False: every finished group is trained on
    (plain GRPO; an all-equal group has zero advantage, so it only dilutes the step)."""
    max_staleness: int = 1
    pass_rate_filter: bool = False
    """Per-prompt pass-rate tracking in the sampler (:class:`~raas.trainer.pass_rates.PassRateFilter`):
    defer prompts all solved or all failed in their recent samples, prefer those near 50%."""
    mask_stale_turns: bool = False
    """False: carried-over turns of the previous policy are trained on, corrected by the importance
    ratio against their own rollout log-probs (and clipped); True: their tokens get loss 0."""
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_rows: int = 16
    micro_batch_cells: int = 1_000_000
    """At most rows x columns² per forward/backward: eager attention keeps a ``columns²`` matrix per head
    and layer for the backward (~3 GB a row at 1,000 columns for SmolLM2's 30 layers), so long agentic
    rows go one at a time while short ones batch up to ``micro_batch_rows`` (two lookup runs with a
    linear token budget were OOM-killed at 20-23 GB)."""
    trainable_layers: int | None = None
    """Train only the top N decoder layers and the final norm (the embedding and LM head frozen); None:
    every parameter. Cuts compute, activation memory and optimizer state (see
    :func:`~raas.learn.memory.set_trainable_layers`)."""
    micro_batch_tokens: int = 600
    """At most rows x columns token positions per forward/backward with every activation kept for the
    backward (SmolLM2-135M keeps ~1.5 MB a token over its 30 layers, measured); a single row longer than
    this runs with activation checkpointing (each layer recomputed in the backward: ~40% more compute, a
    few hundred MB instead of GBs). With the weights, gradients and AdamW's moments (~2.2 GB in fp32) this
    keeps the trainer under ~4 GB resident on multi-turn rows."""
    loss: LossConfig = field(default_factory=LossConfig)
    std_normalize: bool = True
    """GRPO's advantage normalization by the group's reward std (False: Dr. GRPO's mean-centring only)."""
    temperature: float = 1.0
    max_tokens: int = 32
    """Tokens per model turn."""
    max_turns: int | None = None
    """Model turns per rollout (sent as the jobs' ``max_turns``); None: the task's own limit."""
    max_prompt_len: int = 1024
    max_response_len: int = 256
    """Longer rows are kept with loss 0 (DAPO's overlong masking) and counted in ``overlong``."""
    eval_every: int = 10
    eval_samples: int = 4
    """Samples per held-out problem (temperature ``temperature``): the pass rate is their mean reward."""
    model: str | None = None
    """A llama-architecture GGUF; None: the embedded SmolLM2-135M-Instruct."""
    tensor_type: TensorType = "f16"
    slots: int = 8
    context_per_slot: int = 1024
    server: str | None = None
    """A running raas service to use (its inference servers are replaced by this trainer's, so its
    tokenizer must be the policy's); None: one in this process."""
    sandbox: str | None = None
    """The sandbox backend of the service in this process (``bwrap`` for SWE tasks); None: its default."""
    device: str | None = None
    """``cpu``, ``cuda``; None: CUDA when present."""
    torch_threads: int | None = None
    max_wall_s: float | None = None
    """Start no new step after this many seconds (then the last evaluation runs): a time budget."""
    seed: int = 0
    out_dir: str = "train-out"
    progress: bool = True

    def validate(self) -> None:
        for name in (
            "steps",
            "group_size",
            "target_groups",
            "max_inflight_groups",
            "micro_batch_rows",
            "micro_batch_cells",
        ):
            if getattr(self, name) < 1:
                raise RaasError(f"{name} must be >= 1", kind="bad_request")
        if self.group_size < 2:
            raise RaasError("group_size must be >= 2: GRPO needs a group to compare with", kind="bad_request")
        if not (self.lr > 0 and self.max_tokens > 0 and self.max_response_len > 0):
            raise RaasError("lr, max_tokens and max_response_len must be > 0", kind="bad_request")
        if self.eval_every < 0 or self.eval_samples < 1:
            raise RaasError("eval_every must be >= 0 and eval_samples >= 1", kind="bad_request")


@dataclass
class TrainSummary:
    steps: int
    wall_s: float
    evals: list[dict[str, Any]]
    log_path: str
    plot_path: str | None


def _forever(items: list[dict[str, Any]], seed: int) -> Iterator[dict[str, Any]]:
    """Epochs of the training set, each shuffled anew (a data loader's order)."""
    rng = random.Random(seed)
    while True:
        order = list(items)
        rng.shuffle(order)
        yield from order


def sandbox_fields(cfg: TrainConfig) -> dict[str, Any] | None:
    return {"backend": cfg.sandbox} if cfg.sandbox else None


def micro_batch_rows(cfg: TrainConfig, columns: int, token_budget: int | None = None) -> int:
    """Rows per forward/backward for a batch ``columns`` wide: the row cap, lowered by the attention and
    activation budgets (``token_budget``: the activation budget in token positions, default
    ``cfg.micro_batch_tokens``)."""
    width = max(columns, 1)
    tokens = cfg.micro_batch_tokens if token_budget is None else token_budget
    return max(1, min(cfg.micro_batch_rows, cfg.micro_batch_cells // width**2, tokens // width))


class Trainer:
    """The model, its optimizer and one step of the loop; :func:`train` drives it."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        from raas.llm.models import default_gguf_path

        self.gguf = Path(cfg.model) if cfg.model else default_gguf_path()
        model: Any = load_policy(self.gguf)
        self.model: Any = model.to(self.device)
        self.pad_id = int(model.config.eos_token_id or 0)
        self.ref_model: Any = copy.deepcopy(model) if cfg.loss.kl_coef else None
        self.trainable_params = set_trainable_layers(self.model, cfg.trainable_layers)
        self.token_budget = activation_budget(self.model, cfg.micro_batch_tokens, cfg.trainable_layers)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=(0.9, 0.99),
            weight_decay=cfg.weight_decay,
        )

    def update(self, batch: Batch, fresh_rows: list[bool]) -> dict[str, Any]:
        """One optimizer step on ``batch``; returns the loss statistics and the log-prob mismatch, the
        latter both over all rows and over rows sampled entirely by the current weights."""
        cfg = self.cfg
        tb = TorchBatch.from_batch(batch, self.device)
        total = float(tb.loss_mask.sum().item())
        if total == 0:
            return {"loss": 0.0, "trained_tokens": 0}
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, stats_acc, diffs, fresh_diffs = 0.0, [], [], []
        rows = micro_batch_rows(cfg, int(tb.input_ids.shape[1]), self.token_budget)
        checkpointed = 0
        for start in range(0, batch.size, rows):
            mb = tb.rows(slice(start, start + rows))
            if mb.loss_mask.sum() == 0:
                continue
            checkpoint = mb.tokens > self.token_budget
            checkpointed += checkpoint
            set_checkpointing(self.model, checkpoint)
            sampled = mb.loss_mask.bool()
            logprobs = response_logprobs(self.model, mb, cfg.temperature, only=sampled)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = response_logprobs(self.ref_model, mb, cfg.temperature, only=sampled)
            loss, stats = dapo_loss(logprobs, mb, cfg.loss, ref_logprobs=ref, total_tokens=total)
            loss.backward()
            loss_sum += float(loss.item())
            stats_acc.append((float(mb.loss_mask.sum()), stats))
            d = (logprobs.detach() - mb.rollout_logprobs).abs()
            diffs.append(d[sampled])
            rows_fresh = torch.tensor(fresh_rows[start : start + rows], device=self.device)
            fresh_diffs.append(d[sampled & rows_fresh.unsqueeze(1)])
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], cfg.max_grad_norm
        )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        set_checkpointing(self.model, False)
        self.model.eval()
        weights = sum(w for w, _ in stats_acc) or 1.0
        out: dict[str, Any] = {
            k: sum(w * s[k] for w, s in stats_acc) / weights
            for k in ("ratio_mean", "clip_fraction", "approx_kl")
        }
        out["ratio_max"] = max((s["ratio_max"] for _, s in stats_acc), default=1.0)
        all_d = torch.cat(diffs) if diffs else torch.zeros(0)
        fresh_d = torch.cat(fresh_diffs) if fresh_diffs else torch.zeros(0)
        out.update(
            loss=loss_sum,
            grad_norm=float(grad_norm),
            trained_tokens=int(total),
            logprob_abs_diff_mean=float(all_d.mean()) if all_d.numel() else None,
            logprob_abs_diff_max=float(all_d.max()) if all_d.numel() else None,
            fresh_logprob_abs_diff_mean=float(fresh_d.mean()) if fresh_d.numel() else None,
            fresh_logprob_abs_diff_max=float(fresh_d.max()) if fresh_d.numel() else None,
            checkpointed_micro_batches=checkpointed,
        )
        del tb, diffs, fresh_diffs
        release_memory()
        return out


def fresh_rows(batch: Batch, groups: list[Group], version: int) -> list[bool]:
    """Per batch row: True when every turn was sampled by weight version ``version`` (the trainer's
    current weights), so its log-prob mismatch measures the engines alone, not a policy change."""
    by_job = {r.job_id: r for g in groups for r in g.samples}
    out = []
    for job_id in batch.job_ids:
        turns = by_job[job_id].turns
        out.append(all(version_number(t.weight_version) == version for t in turns))
    return out


def too_long(groups: list[Group], cfg: TrainConfig) -> str:
    """Why a step had nothing to train on: every row is overlong (its loss is masked)."""
    trajectories = [t for g in groups for r in g.samples for t in token_segments(r)]  # every row's sequence
    prompt = max((len(t.prompt_ids) for t in trajectories), default=0)
    response = max((len(t.response_ids) for t in trajectories), default=0)
    return (
        f"every row of the step is longer than the batch allows (prompts up to {prompt} tokens, max_prompt_len "
        f"{cfg.max_prompt_len}; responses up to {response}, max_response_len {cfg.max_response_len}): nothing "
        "would be trained; raise --max-prompt-len / --max-response-len"
    )


class JudgedGroups:
    """The groups the sampler judged this step, each counted once.

    With carry-over, a group accepted beyond one step's target is judged again at the next step (for
    staleness); its rewards belong to the step that first saw it, so the training curve's reward and pass
    rate count every sampled group exactly once."""

    def __init__(self, *, accept_all: bool = False) -> None:
        self.groups: list[Group] = []
        self._seen: set[str] = set()
        self.accept_all = accept_all

    def accept(self, group: Group) -> bool:
        if group.group_id not in self._seen:
            self._seen.add(group.group_id)
            self.groups.append(group)
        return self.accept_all or group.informative

    def clear(self) -> None:
        """Start the next step's list; the groups already seen stay seen."""
        self.groups = []


def step_record(stats: StepStats, judged: list[Group], batch: Batch) -> dict[str, Any]:
    """The rollout side of one step's log line."""
    rewards = [x for g in judged for x in g.rewards]
    samples = [r for g in judged for r in g.samples]
    sampled_lengths = [int(m.sum()) for m in (batch.loss_mask > 0)] if batch.size else []
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "pass_rate": statistics.fmean(x >= 1.0 for x in rewards) if rewards else None,
        "tool_call_fraction": statistics.fmean(used_tool(r) for r in samples) if samples else None,
        "turns_mean": statistics.fmean(len(r.turns) for r in samples) if samples else None,
        "rollouts": len(samples),
        "judged_groups": len(judged),
        "informative_fraction": stats.informative_fraction,
        "accepted_groups": stats.accepted_groups,
        "uninformative_groups": stats.uninformative_groups,
        "stale_dropped_groups": stats.stale_dropped_groups,
        "failed_groups": stats.failed_groups,
        "skipped_prompts": stats.skipped_prompts,
        "carried_in_groups": stats.carried_in_groups,
        "carried_over_groups": stats.carried_over_groups,
        "rollouts_wasted": stats.rollouts_wasted,
        "filtered": stats.failures.get("filtered", 0),
        "staleness": {str(k): v for k, v in sorted(stats.staleness.items())},
        "rows": batch.size,
        "overlong_rows": int(batch.overlong.sum()),
        "response_len_mean": statistics.fmean(sampled_lengths) if sampled_lengths else None,
        "rollout_tokens": sum(sum(len(t.output_ids) for t in r.turns) for r in samples),
    }


async def train(cfg: TrainConfig, on_step: Callable[[dict[str, Any]], None] | None = None) -> TrainSummary:
    """Run ``cfg.steps`` steps; every record also goes to ``on_step`` (tests, benchmarks)."""
    cfg.validate()
    torch.manual_seed(cfg.seed)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    train_set = load_dataset(cfg.train_data)
    eval_set = load_dataset(cfg.eval_data) if cfg.eval_every else []
    out_dir = Path(cfg.out_dir)
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    trainer = await asyncio.to_thread(Trainer, cfg)
    # raas's defaults for top_k, top_p and min_p are "off": the full distribution, as the loss assumes.
    sampling: dict[str, Any] = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens}
    if cfg.max_turns is not None:
        sampling["max_turns"] = cfg.max_turns
    started = time.monotonic()
    evals: list[dict[str, Any]] = []
    judged = JudgedGroups(accept_all=not cfg.dynamic_sampling)
    log = TrainLog(out_dir / "train.jsonl")
    trained = TrainedResults(out_dir / "results.jsonl")
    steps_done = 0
    finished = False
    try:
        with log, trained:

            def record(rec: dict[str, Any]) -> None:
                log.write(rec)
                if on_step is not None:
                    on_step(rec)

            async with contextlib.AsyncExitStack() as stack:
                sync = LlamaWeightSync(
                    trainer.model,
                    template=trainer.gguf,
                    parallel=cfg.slots,
                    ctx_per_slot=cfg.context_per_slot,
                    tensor_type=cfg.tensor_type,
                )
                llm_url = (await stack.enter_async_context(sync)).url
                url = await stack.enter_async_context(
                    rollout_service(
                        llm_url,
                        server=cfg.server,
                        model=cfg.model,
                        run_workers=cfg.slots,
                        sandbox=sandbox_fields(cfg),
                    )
                )
                client = await stack.enter_async_context(RolloutClient(url, run_id="train"))
                await client.set_weight_version("0")
                progress = stack.enter_context(Progress(cfg.steps, cfg.progress))

                async def run_eval(step: int) -> None:
                    def counted(done: int, total: int, solved: int) -> None:
                        progress.phase(
                            f"evaluating: {done}/{total} held-out problems x {cfg.eval_samples}, {solved} passed"
                        )

                    counted(0, len(eval_set), 0)
                    result = await evaluate(url, eval_set, cfg.eval_samples, sampling, counted)
                    result.update(kind="eval", step=step, wall_s=time.monotonic() - started)
                    evals.append(result)
                    record(result)
                    rate = result["pass_rate"]
                    progress.note("held-out: all filtered" if rate is None else f"held-out pass {rate:.0%}")

                if eval_set:
                    await run_eval(0)
                sampler = DynamicSampler(
                    client,
                    _forever(train_set, cfg.seed),
                    group_size=cfg.group_size,
                    target_groups=cfg.target_groups,
                    max_inflight_groups=cfg.max_inflight_groups,
                    carry_over=cfg.carry_over,
                    max_staleness=cfg.max_staleness,
                    sampling_params=sampling,
                    mask_stale_turns=cfg.mask_stale_turns,
                    accept=judged.accept,
                    pass_rates=PassRateFilter(min_samples=cfg.group_size, window=max(16, cfg.group_size))
                    if cfg.pass_rate_filter
                    else None,
                )
                stack.push_async_callback(sampler.close)

                def interrupted(kind: type[BaseException] | None, *_: object) -> None:
                    if kind is not None and issubclass(kind, asyncio.CancelledError | KeyboardInterrupt):
                        _log.warning(
                            "raas train: interrupted after %d steps; stopping the rollouts, sandboxes and "
                            "model server (the log so far: %s)",
                            steps_done,
                            log.path,
                        )

                stack.push(interrupted)
                for step in range(cfg.steps):
                    step_started = time.monotonic()
                    judged.clear()
                    progress.phase("waiting for rollouts")
                    groups, stats = await sampler.next_step()
                    batch = sampler.assemble(
                        groups,
                        trainer.pad_id,
                        cfg.max_prompt_len,
                        cfg.max_response_len,
                        std_normalize=cfg.std_normalize,
                    )
                    if batch.size and int(batch.overlong.sum()) == batch.size:
                        raise RaasError(too_long(groups, cfg), kind="bad_request")
                    rec: dict[str, Any] = {
                        "kind": "step",
                        "step": step + 1,
                        "policy_version": sampler.policy_version,
                    }
                    rec.update(step_record(stats, judged.groups, batch))
                    rec["trained_jobs"] = await asyncio.to_thread(
                        trained.write, step + 1, groups, std_normalize=cfg.std_normalize
                    )
                    train_started = time.monotonic()
                    fresh = fresh_rows(batch, groups, sampler.policy_version)
                    progress.phase(f"training on {batch.size} rows")
                    rec.update(await asyncio.to_thread(trainer.update, batch, fresh))
                    train_s = time.monotonic() - train_started
                    progress.phase("syncing weights")
                    write_s = await sync.write()  # rollouts (carry-over) keep running meanwhile
                    sync_started = time.monotonic()
                    restart_s = 0.0

                    async def restart() -> None:
                        nonlocal restart_s
                        restart_s = await sync.restart()

                    await sampler.update_weights(restart)
                    pause_s = time.monotonic() - sync_started
                    step_s = time.monotonic() - step_started
                    rec.update(
                        wait_s=stats.time_waiting_s,
                        train_s=train_s,
                        sync_s=write_s + pause_s,
                        sync_write_s=write_s,
                        sync_pause_s=pause_s,
                        sync_restart_s=restart_s,
                        step_s=step_s,
                        idle_fraction=stats.time_waiting_s / step_s if step_s else 0.0,
                        train_tokens_per_s=rec.get("trained_tokens", 0) / train_s if train_s else 0.0,
                        rollout_tokens_per_s=rec["rollout_tokens"] / step_s if step_s else 0.0,
                        wall_s=time.monotonic() - started,
                    )
                    rec["rss_mb"], rec["rss_peak_mb"] = rss_mb()
                    record(rec)
                    steps_done = step + 1
                    progress.advance(rec)
                    out_of_time = cfg.max_wall_s is not None and time.monotonic() - started >= cfg.max_wall_s
                    last = step + 1 == cfg.steps or out_of_time
                    if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last):
                        await run_eval(step + 1)
                    if last:
                        break
        finished = True
    finally:
        # Also for a run that was interrupted or failed: the plot and config of what it logged.
        plot = _write_outputs(cfg, log, out_dir, quiet=not finished)
    wall = time.monotonic() - started
    return TrainSummary(steps=steps_done, wall_s=wall, evals=evals, log_path=str(log.path), plot_path=plot)


def _write_outputs(cfg: TrainConfig, log: TrainLog, out_dir: Path, *, quiet: bool) -> str | None:
    """``config.json`` and the learning-curve plot (None without matplotlib, or when ``quiet`` and it
    fails: an interrupted run's own error is the one to report)."""
    plot = None
    try:
        (out_dir / "config.json").write_text(_config_json(cfg), encoding="utf-8")
        with contextlib.suppress(ImportError):
            plot = str(plot_learning_curve(log.path, out_dir / "learning_curve.png"))
    except Exception:
        if not quiet:
            raise
    return plot


def _config_json(cfg: TrainConfig) -> str:
    import json

    return json.dumps(asdict(cfg), indent=1, sort_keys=True)
