"""The reference trainer end to end, 2 steps (CI's smoke run): the embedded SmolLM2-135M samples through
a real raas service, trains on the batch, and syncs its weights into llama.cpp each step. What must hold
is what a practitioner reads first: the rollout log-probs match the trainer's on the same weights (a
token-fidelity bug shows as a mismatch of several nats), each step bumps the weight version the turns
carry, and the log and the plot are written."""

from __future__ import annotations

import asyncio
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from raas.errors import RaasError
from raas.learn.reference import TrainConfig, train

pytestmark = pytest.mark.e2e


async def test_two_steps_train_sync_and_log(tmp_path: Path) -> None:
    cfg = TrainConfig(
        train_data="builtin:addition",
        eval_data="builtin:addition:test:2",
        steps=2,
        group_size=4,
        target_groups=2,
        max_inflight_groups=4,
        max_tokens=12,
        eval_every=2,
        eval_samples=2,
        slots=4,
        out_dir=str(tmp_path / "out"),
        progress=False,
    )
    records: list[dict[str, Any]] = []
    summary = await train(cfg, on_step=records.append)
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert summary.steps == 2 and [s["step"] for s in steps] == [1, 2]
    assert [e["step"] for e in evals] == [0, 2] and all(e["rollouts"] == 4 for e in evals)
    first = steps[0]
    assert first["policy_version"] == 0 and steps[1]["policy_version"] == 1
    assert first["rows"] == 8 and first["trained_tokens"] > 0 and first["filtered"] == 0
    # Step 1 trains on rollouts sampled by exactly the trainer's weights (served as f16).
    assert first["fresh_logprob_abs_diff_mean"] < 0.05
    assert first["fresh_logprob_abs_diff_max"] < 1.0
    assert all(s["sync_restart_s"] > 0 and s["grad_norm"] > 0 for s in steps)
    lines = await asyncio.to_thread(Path(summary.log_path).read_text)
    assert len(lines.splitlines()) == len(records)
    # the results each step trained on, with step, group and advantage: what `raas view OUT` links a step to
    trained = [json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [sum(1 for t in trained if t["train_step"] == s["step"]) for s in steps] == [
        s["trained_jobs"] for s in steps
    ]
    assert steps[0]["trained_jobs"] == first["rows"]
    for gid in {t["group_id"] for t in trained if t["train_step"] == 1}:
        members = [t for t in trained if t["group_id"] == gid and t["train_step"] == 1]
        rewards = [t["reward"] for t in members]
        mean, std = statistics.fmean(rewards), statistics.stdev(rewards)  # std_normalize: on by default
        assert all(abs(t["advantage"] - (t["reward"] - mean) / (std + 1e-6)) < 1e-4 for t in members)
    assert summary.plot_path is not None
    png = await asyncio.to_thread(Path(summary.plot_path).read_bytes)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    "field,value", [("group_size", 1), ("steps", 0), ("lr", 0.0), ("eval_samples", 0), ("target_groups", 0)]
)
def test_bad_settings_are_refused_before_anything_starts(field: str, value: Any) -> None:
    cfg = TrainConfig(**{field: value})
    with pytest.raises(RaasError) as err:
        cfg.validate()
    assert err.value.kind == "bad_request"


async def test_a_batch_too_narrow_for_every_row_is_an_error_not_a_silent_no_op(tmp_path: Path) -> None:
    cfg = TrainConfig(
        train_data="builtin:addition",
        steps=1,
        group_size=2,
        target_groups=1,
        max_inflight_groups=2,
        max_tokens=8,
        max_prompt_len=8,  # the chat-templated prompt alone is ~40 tokens
        eval_every=0,
        slots=2,
        out_dir=str(tmp_path / "out"),
        progress=False,
    )
    with pytest.raises(RaasError) as err:
        await train(cfg)
    assert err.value.kind == "bad_request" and "max_prompt_len 8" in str(err.value)
    # a run that stops early (an error, Ctrl-C) still leaves its config and the plot of what it logged
    out = tmp_path / "out"
    assert (out / "config.json").is_file() and (out / "learning_curve.png").stat().st_size > 0


@pytest.mark.unit
def test_long_rows_get_smaller_micro_batches() -> None:
    from raas.learn.reference import micro_batch_rows

    cfg = TrainConfig(micro_batch_rows=16, micro_batch_cells=1_000_000, micro_batch_tokens=10_000)
    assert micro_batch_rows(cfg, 40) == 16  # short rows: the row cap
    assert micro_batch_rows(cfg, 400) == 6  # the attention budget
    assert micro_batch_rows(cfg, 900) == 1  # an agentic trajectory: one row at a time
    assert micro_batch_rows(cfg, 10_000) == 1  # never 0
    # The activation budget (rows x columns kept for the backward), by default ~600 token positions.
    assert micro_batch_rows(TrainConfig(), 80) == 7 and micro_batch_rows(TrainConfig(), 700) == 1
