"""The swe-mini recipe end to end in miniature (CI's smoke run of `raas train --recipe swe-mini`): a few
one-function instances built and validated in real sandboxes, the base policy evaluated, the teacher's
gold fixes acted out through the SWE handler and graded by EVAL, a fine-tune on their exact tokens, and
two RL steps from the fine-tuned weights with held-out evaluations. What must hold is the plumbing, not
the learning: every teacher trajectory resolves (a gold fix typed through the scaffold's tools passes the
hidden tests), the fine-tune trains only on sampled tokens and writes a GGUF the RL trainer serves, and RL
steps through multi-turn SWE rows with rollout and trainer log-probs in agreement."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from raas.learn.sft import read_results, rows_of
from raas.learn.swe_mini import SweMiniConfig, run_recipe
from raas.tasks.swe.mini.build import MiniOptions

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        (os.geteuid() != 0 or shutil.which("bwrap") is None) and not os.environ.get("RAAS_CI"),
        reason="building the curriculum's images needs root; SWE sandboxes need bwrap",
    ),
]


async def test_the_recipe_in_miniature(tmp_path: Path) -> None:
    cfg = SweMiniConfig(
        out_dir=str(tmp_path / "out"),
        build=MiniOptions(levels=("function",), modules=("ranges", "fizzbuzz")),
        levels=("function",),
        eval_levels=("function",),
        eval_instances=1,
        eval_samples=1,
        train_instances=3,
        sft_epochs=1,
        rl_steps=2,
        eval_every=2,
        max_tokens_per_turn=24,  # a barely tuned policy rambles; short turns keep the run short
        max_turns=4,
        group_size=2,
        target_groups=1,
        max_inflight_groups=2,
        dynamic_sampling=False,  # two tiny steps must not wait for groups whose rewards differ
        slots=2,
        progress=False,
    )
    summary = await run_recipe(cfg)
    await asyncio.to_thread(check_outputs, cfg, summary)


def check_outputs(cfg: SweMiniConfig, summary: dict[str, Any]) -> None:
    out = Path(cfg.out_dir)
    phases = summary["phases"]
    assert phases["curriculum"]["train_instances"] == 3 and phases["curriculum"]["test_instances"] == 1
    train = [json.loads(line) for line in (out / "data/train.jsonl").read_text().splitlines()]
    test = [json.loads(line) for line in (out / "data/test.jsonl").read_text().splitlines()]
    assert {r["module"] for r in train} == {"ranges"} and {r["module"] for r in test} == {"fizzbuzz"}
    assert phases["base"]["rollouts"] == 1 and phases["base"]["filtered"] == 0
    teacher = phases["warm_start"]["teacher"]
    assert teacher["scripted"] == 3 and teacher["resolved"] == 3 and teacher["filtered"] == 0
    results = read_results(out / "warmstart.jsonl")
    rows = rows_of(results, 1.0)
    assert len(rows) == 3
    for r, row in zip(results, rows, strict=True):
        # Trained on exactly the teacher's sampled tokens: every assistant turn, nothing else.
        sampled = sum(len(t.output_ids) for t in r.turns)
        assert sum(row.targets) == sampled and len(r.turns) >= 3
        assert [m.tool_calls[0].name for m in r.messages if m.role == "assistant" and m.output_ids][:2] == [
            "view",
            "replace",
        ]
    sft = phases["warm_start"]["sft"]
    assert sft["rows"] == 3 and Path(sft["gguf"]).is_file() and sft["epochs"][0]["loss"] > 0
    rl = phases["rl"]
    assert rl["steps"] == 2 and [e["step"] for e in rl["evals"]] == [0, 2]
    steps = [json.loads(line) for line in Path(rl["log"]).read_text().splitlines()]
    steps = [s for s in steps if s["kind"] == "step"]
    assert all(s["rows"] == 2 and s["filtered"] == 0 for s in steps)
    # The first step trains on rollouts of exactly the fine-tuned weights (served as f16).
    assert steps[0]["fresh_logprob_abs_diff_mean"] < 0.05
    assert all(s["rss_peak_mb"] > 0 for s in steps)
    assert set(summary["held_out"]) == {"base", "warm_start", "rl_start", "rl_final", "rl_best"}
    assert json.loads((out / "recipe.json").read_text())["held_out"] == summary["held_out"]
