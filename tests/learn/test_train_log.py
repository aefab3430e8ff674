"""The training log is the record every reported figure comes from: a non-finite loss is written as null
(the file stays valid JSON lines), and the learning curve is drawn from the file alone, gaps included (an
evaluation whose rollouts were all filtered has no pass rate, not a 0)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raas.trainer.train_log import TrainLog, plot_learning_curve, read_log

pytestmark = pytest.mark.unit


def test_log_lines_are_json_and_nan_is_null(tmp_path: Path) -> None:
    with TrainLog(tmp_path / "t.jsonl") as log:
        log.write({"kind": "step", "step": 1, "loss": math.nan, "wait_s": 1.5, "train_s": 2.0, "sync_s": 0.5})
        log.write({"kind": "eval", "step": 1, "pass_rate": None})
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in lines] == ["step", "eval"]
    assert read_log(tmp_path / "t.jsonl")[0]["loss"] is None
    with pytest.raises(ValueError):
        log.write({"kind": "step"})


def test_plot_from_the_log_alone_with_gaps(tmp_path: Path) -> None:
    with TrainLog(tmp_path / "t.jsonl") as log:
        log.write({"kind": "eval", "step": 0, "pass_rate": 0.2, "tool_call_fraction": 0.5})
        for step in (1, 2):
            log.write({"kind": "step", "step": step, "reward_mean": 0.3, "wait_s": 1.0, "train_s": 2.0,
                       "sync_s": 0.5, "logprob_abs_diff_mean": 0.002})  # fmt: skip
        log.write({"kind": "eval", "step": 2, "pass_rate": None, "tool_call_fraction": None})
    out = plot_learning_curve(tmp_path / "t.jsonl", tmp_path / "curve.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
