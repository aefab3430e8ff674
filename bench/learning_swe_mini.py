"""Does a policy learn to fix bugs through raas's SWE path? ``raas train --recipe swe-mini`` on 2 CPU cores.

One invocation runs the recipe (:mod:`raas.learn.swe_mini`: the ``builtin:swe-mini`` curriculum, the base
policy's held-out resolved rate, a warm start by rejection-sampling fine-tuning on a scripted teacher's
resolved trajectories, then GRPO + DAPO with carry-over and per-prompt pass-rate tracking for
``--minutes``) and merges its summary into ``bench/results/learning.json`` under ``swe-mini``, with the
RL log and curve copied to ``bench/results/learning_swe-mini.jsonl`` / ``.png``. The held-out set is
instances of modules the policy never saw, graded by EVAL (hidden tests, fresh sandbox).

Reported besides the shape of the other ``learning.json`` entries: the base / warm-start / RL held-out
rates, rollouts per minute, mean turns, the tool-call fraction, the trainer's resident memory, whether the
issue's goal (RL's held-out rate at least 2x the warm start's and +15 points) was met.

Usage: ``python bench/learning_swe_mini.py --minutes 120``, or ``--from-recipe DIR`` to summarize a run of
``raas train --recipe swe-mini -o DIR`` (finished or stopped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from pathlib import Path
from typing import Any

from learning import save_run, summarize
from raas.learn.reference import TrainConfig
from raas.learn.swe_mini import SweMiniConfig, run_recipe
from raas.trainer.train_log import plot_learning_curve, read_log

NAME = "swe-mini"


def swe_fields(recipe: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval" and r.get("pass_rate") is not None]
    rl_minutes = max((r["wall_s"] for r in records), default=0.0) / 60
    phases = recipe.get("phases", {})
    held = recipe.get("held_out", {})
    start = evals[0]["pass_rate"] if evals else None
    final = evals[-1]["pass_rate"] if evals else None
    warm = phases.get("warm_start", {})

    def mean(key: str, rows: list[dict[str, Any]]) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.fmean(vals), 4) if vals else None

    return {
        "held_out_base": phases.get("base", {}).get("pass_rate"),
        # a stopped run's recipe.json has no held_out yet: RL's step-0 evaluation is the warm start's
        "held_out_warm_start": held.get("warm_start", start if warm else None),
        "held_out_rl_final": final,
        "held_out_rl_best": held.get("rl_best"),
        "goal_2x_and_15_points": (
            start is not None and final is not None and final >= 2 * start and final - start >= 0.15
        ),
        "rollouts_per_min": round(sum(s.get("rollouts", 0) for s in steps) / rl_minutes, 2)
        if rl_minutes
        else None,
        "turns_mean_train": mean("turns_mean", steps),
        "turns_mean_eval": mean("turns_mean", evals),
        "tool_call_fraction_train": mean("tool_call_fraction", steps),
        "rss_mb_last": steps[-1].get("rss_mb") if steps else None,
        "rss_peak_mb": max((s.get("rss_peak_mb") or 0 for s in steps), default=None),
        "skipped_prompts": sum(s.get("skipped_prompts", 0) for s in steps),
        "checkpointed_micro_batches": sum(s.get("checkpointed_micro_batches", 0) for s in steps),
        "warm_start": {
            "teacher": {
                k: warm.get("teacher", {}).get(k) for k in ("scripted", "resolved", "filtered", "wall_s")
            },
            "sft": {
                "rows": warm.get("sft", {}).get("rows"),
                "target_tokens": warm.get("sft", {}).get("target_tokens"),
                "epochs": warm.get("sft", {}).get("epochs"),
                "wall_s": warm.get("sft", {}).get("wall_s"),
            },
        },
        "base_eval": {
            k: phases.get("base", {}).get(k)
            for k in ("pass_rate", "rollouts", "tool_call_fraction", "turns_mean", "eval_s")
        },
        "curriculum": phases.get("curriculum"),
        "recipe_wall_s": recipe.get("wall_s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=120.0, help="RL's time budget")
    ap.add_argument("--out", default="train-swe-mini")
    ap.add_argument("--from-recipe", help="summarize this recipe output dir instead of running one")
    ap.add_argument("--no-save", action="store_true", help="print only; do not touch bench/results")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    out = Path(args.from_recipe or args.out)
    if not args.from_recipe:
        asyncio.run(run_recipe(SweMiniConfig(out_dir=str(out), rl_minutes=args.minutes)))
    recipe = json.loads((out / "recipe.json").read_text())
    log_path = out / "rl" / "train.jsonl"
    records = read_log(log_path)
    plot = plot_learning_curve(
        log_path, out / "rl" / "learning_curve.png", title="raas train --recipe swe-mini (RL)"
    )
    c = recipe["config"]
    cfg = TrainConfig(eval_samples=c["eval_samples"])
    wall = max((r["wall_s"] for r in records), default=0.0)
    result = {
        "model": "SmolLM2-135M-Instruct (top 20 of 30 layers trained in torch fp32; served by llama.cpp, f16)",
        "task": NAME,
        "mode": "async",
        "cpu_cores": os.cpu_count(),
        "load_average_at_start": round(load, 2),
        "config": {
            k: c[k]
            for k in (
                "lr",
                "group_size",
                "target_groups",
                "max_inflight_groups",
                "max_tokens_per_turn",
                "max_turns",
                "eval_samples",
                "eval_instances",
                "levels",
                "eval_levels",
                "sft_epochs",
                "sft_lr",
                "trainable_layers",
                "pass_rate_filter",
                "rl_minutes",
                "seed",
            )
        },
        "stopped_early_from_log": False,
        **summarize(records, cfg, wall),
        **swe_fields(recipe, records),
    }
    print(json.dumps(result, indent=1))
    if not args.no_save:
        save_run(NAME, result, log_path, plot)


if __name__ == "__main__":
    main()
