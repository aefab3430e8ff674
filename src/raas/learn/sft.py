"""Supervised fine-tuning on raas trajectories: rejection-sampling fine-tuning's training half.

Given results that raas graded (``raas run -o results.jsonl``, or the warm start of
:mod:`raas.learn.warmstart`), keep those whose reward reaches ``min_reward`` and train the policy on their
exact token sequences with cross-entropy on the sampled tokens only (``loss_mask`` 1: the policy's own
turns; the prompt, the tool observations and the chat template's tokens are context, never targets). A
result the agent split into several token segments contributes each segment. The trained weights are
written as a GGUF (``OUT/policy.gguf``) that ``raas train --model`` and ``raas run --model`` load.

The loss is the mean over every target token of an epoch's batch (long trajectories weigh per token, as
in the RL loss); rows go through the model in micro-batches sized by the same attention budget the RL
trainer uses.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raas.errors import RaasError
from raas.learn.memory import activation_budget, release_memory, set_checkpointing, set_trainable_layers
from raas.trainer.grpo import token_segments
from raas.trainer.hf_weights import TensorType, export_gguf, load_policy
from raas.trainer.types import JobResult, is_valid

_log = logging.getLogger("raas.learn")


@dataclass
class SftConfig:
    min_reward: float = 1.0
    """Results below this reward are not trained on (1.0: resolved only)."""
    epochs: int = 2
    lr: float = 2e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    batch_rows: int = 16
    """Rows per optimizer step."""
    micro_batch_cells: int = 1_000_000
    """At most rows x columns² per forward/backward (see ``TrainConfig.micro_batch_cells``)."""
    trainable_layers: int | None = None
    """Train only the top N decoder layers and the final norm (see ``TrainConfig.trainable_layers``)."""
    micro_batch_tokens: int = 600
    """At most rows x columns per forward/backward with every activation kept; a longer single row runs
    with activation checkpointing (see ``TrainConfig.micro_batch_tokens``)."""
    max_len: int = 4096
    """Longer rows are left out (counted in ``skipped_long``)."""
    model: str | None = None
    """The GGUF to start from; None: the embedded SmolLM2-135M-Instruct."""
    tensor_type: TensorType = "f32"
    """How ``policy.gguf`` stores the weights (f32: exactly the trained numbers)."""
    seed: int = 0
    device: str | None = None


@dataclass
class Row:
    ids: list[int]
    targets: list[bool]
    """Per position of ``ids``: whether the token is trained on (sampled by the policy)."""


@dataclass
class SftSummary:
    rows: int
    target_tokens: int
    skipped_long: int
    epochs: list[dict[str, Any]] = field(default_factory=list)
    gguf: str = ""
    wall_s: float = 0.0


def rows_of(results: Iterable[JobResult], min_reward: float) -> list[Row]:
    """Training rows of the valid results whose reward reaches ``min_reward`` (one per token segment)."""
    rows: list[Row] = []
    for r in results:
        if not is_valid(r) or r.reward is None or float(r.reward) < min_reward:
            continue
        for seg in token_segments(r):
            if len(seg.loss_mask) != len(seg.response_ids):
                raise RaasError(
                    f"job {r.job_id}: loss_mask and response_ids differ in length", kind="bad_request"
                )
            if not any(seg.loss_mask):
                continue
            ids = list(seg.prompt_ids) + list(seg.response_ids)
            targets = [False] * len(seg.prompt_ids) + [bool(m) for m in seg.loss_mask]
            rows.append(Row(ids, targets))
    return rows


def read_results(path: str | Path) -> list[JobResult]:
    """Job results from a JSONL file (``raas run -o`` or the warm start's ``warmstart.jsonl``)."""
    out = []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(JobResult.model_validate(json.loads(line)))
        except ValueError as e:
            raise RaasError(f"{path}:{i}: not a raas job result: {e}", kind="bad_request") from e
    return out


def _micro_batches(rows: list[Row], cells: int, tokens: int) -> list[list[Row]]:
    """Rows of similar length together, each micro-batch within the attention and activation budgets."""
    out: list[list[Row]] = []
    current: list[Row] = []
    for row in sorted(rows, key=lambda r: len(r.ids)):
        width = len(row.ids)
        n = len(current) + 1
        if current and (n * width**2 > cells or n * width > tokens):
            out.append(current)
            current = []
        current.append(row)
    if current:
        out.append(current)
    return out


def _loss_sum(model: Any, rows: list[Row], device: torch.device) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of the target tokens of ``rows`` (right-padded) and their count. Only the
    positions that predict a target go through the LM head."""
    width = max(len(r.ids) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    predicts = torch.zeros((len(rows), width), dtype=torch.bool)  # position t predicts token t+1
    for i, r in enumerate(rows):
        ids[i, : len(r.ids)] = torch.tensor(r.ids)
        attention[i, : len(r.ids)] = 1
        predicts[i, : len(r.ids) - 1] = torch.tensor(r.targets[1:])
    ids, attention, predicts = ids.to(device), attention.to(device), predicts.to(device)
    hidden = model.model(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
    labels = torch.roll(ids, shifts=-1, dims=1)[predicts]
    logits = model.lm_head(hidden[predicts]).float()
    loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
    return loss, int(labels.numel())


def sft(
    results: Iterable[JobResult],
    cfg: SftConfig,
    out_dir: str | Path,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
    on_step: Callable[[int, int, int], None] | None = None,
    stop: threading.Event | None = None,
) -> SftSummary:
    """Fine-tune on ``results`` (see the module docstring); writes ``OUT/policy.gguf`` and ``OUT/sft.jsonl``.
    ``on_step`` gets (epoch, optimizer steps done in it, steps per epoch) after each step. Blocking
    (torch): call it in a thread from async code, and set ``stop`` to end it at the next optimizer step
    (``RaasError`` ``cancelled``, nothing written)."""
    if cfg.epochs < 1 or cfg.batch_rows < 1 or not cfg.lr > 0:
        raise RaasError("epochs and batch_rows must be >= 1 and lr > 0", kind="bad_request")
    from raas.llm.models import default_gguf_path

    started = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    all_rows = rows_of(results, cfg.min_reward)
    rows = [r for r in all_rows if len(r.ids) <= cfg.max_len]
    if not rows:
        raise RaasError(
            f"no trajectory to fine-tune on: none of the results is valid with reward >= {cfg.min_reward}",
            kind="bad_request",
        )
    summary = SftSummary(len(rows), sum(sum(r.targets) for r in rows), len(all_rows) - len(rows))
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gguf = Path(cfg.model) if cfg.model else default_gguf_path()
    model: Any = load_policy(gguf)
    model = model.to(device)
    set_trainable_layers(model, cfg.trainable_layers)
    budget = activation_budget(model, cfg.micro_batch_tokens, cfg.trainable_layers)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    log_path = out / "sft.jsonl"
    with log_path.open("w", encoding="utf-8") as log:
        for epoch in range(cfg.epochs):
            order = list(rows)
            rng.shuffle(order)
            model.train()
            total_loss, total_tokens, steps = 0.0, 0, 0
            for start in range(0, len(order), cfg.batch_rows):
                if stop is not None and stop.is_set():
                    raise RaasError("the fine-tune was stopped", kind="cancelled")
                batch = order[start : start + cfg.batch_rows]
                n = sum(sum(r.targets[1:]) for r in batch) or 1
                optimizer.zero_grad(set_to_none=True)
                for mb in _micro_batches(batch, cfg.micro_batch_cells, budget):
                    set_checkpointing(model, len(mb) * max(len(r.ids) for r in mb) > budget)
                    loss, count = _loss_sum(model, mb, device)
                    (loss / n).backward()
                    total_loss += float(loss.item())
                    total_tokens += count
                torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
                optimizer.step()
                steps += 1
                if on_step is not None:
                    on_step(epoch + 1, steps, -(-len(order) // cfg.batch_rows))
            set_checkpointing(model, False)
            model.eval()
            release_memory()
            rec = {
                "kind": "sft_epoch",
                "epoch": epoch + 1,
                "loss": total_loss / max(total_tokens, 1),
                "tokens": total_tokens,
                "optimizer_steps": steps,
                "wall_s": time.monotonic() - started,
            }
            summary.epochs.append(rec)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            _log.info("sft epoch %d: loss %.4f over %d tokens", epoch + 1, rec["loss"], total_tokens)
            if on_epoch is not None:
                on_epoch(rec)
    summary.gguf = str(export_gguf(model, out / "policy.gguf", template=gguf, tensor_type=cfg.tensor_type))
    summary.wall_s = time.monotonic() - started
    del model, optimizer
    release_memory()  # the caller (a recipe) trains another model in this process next
    return summary
