"""Running the recipe again into the same directory keeps the phases it finished with the same settings
(never one whose settings changed or whose weights are gone) and keeps the interrupted RL log."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from raas.learn.swe_mini import SweMiniConfig, _finished_phases, _keep_interrupted_log

pytestmark = pytest.mark.unit


def earlier_run(out: Path, cfg: SweMiniConfig, gguf: Path) -> None:
    phases = {
        "base": {"pass_rate": 0.0, "rollouts": 96},
        "warm_start": {"teacher": {"resolved": 3}, "sft": {"gguf": str(gguf)}},
    }
    (out / "recipe.json").write_text(json.dumps({"config": asdict(cfg), "phases": phases}), encoding="utf-8")


def test_finished_phases_are_kept_with_the_same_settings(tmp_path: Path) -> None:
    gguf = tmp_path / "sft" / "policy.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    cfg = SweMiniConfig(out_dir=str(tmp_path), rl_minutes=120)
    earlier_run(tmp_path, cfg, gguf)
    # RL's own settings (its minutes, the progress output) do not invalidate the earlier phases
    again = SweMiniConfig(out_dir=str(tmp_path), rl_minutes=30, progress=False)
    assert set(_finished_phases(again, tmp_path)) == {"base", "warm_start"}


def test_a_changed_setting_or_missing_weights_runs_the_phase_again(tmp_path: Path) -> None:
    gguf = tmp_path / "policy.gguf"
    gguf.write_bytes(b"GGUF")
    earlier_run(tmp_path, SweMiniConfig(out_dir=str(tmp_path)), gguf)
    assert set(_finished_phases(SweMiniConfig(sft_epochs=3), tmp_path)) == {"base"}
    assert set(_finished_phases(SweMiniConfig(eval_samples=2), tmp_path)) == {"warm_start"}
    assert _finished_phases(SweMiniConfig(model="/other.gguf"), tmp_path) == {}
    gguf.unlink()
    assert set(_finished_phases(SweMiniConfig(), tmp_path)) == {"base"}


def test_no_or_unreadable_earlier_run_keeps_nothing(tmp_path: Path) -> None:
    assert _finished_phases(SweMiniConfig(), tmp_path) == {}
    (tmp_path / "recipe.json").write_text("{not json", encoding="utf-8")
    assert _finished_phases(SweMiniConfig(), tmp_path) == {}


def test_an_interrupted_rl_log_is_kept_beside_the_new_one(tmp_path: Path) -> None:
    _keep_interrupted_log(tmp_path)  # nothing to keep
    for text in ("first", "second"):
        (tmp_path / "train.jsonl").write_text(text, encoding="utf-8")
        _keep_interrupted_log(tmp_path)
    assert not (tmp_path / "train.jsonl").exists()
    assert (tmp_path / "train.1.jsonl").read_text(encoding="utf-8") == "first"
    assert (tmp_path / "train.2.jsonl").read_text(encoding="utf-8") == "second"
