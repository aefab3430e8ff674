"""Does a policy learn through raas? The reference trainer (``raas train``) on 2 CPU cores, measured.

One invocation is one run: the embedded SmolLM2-135M-Instruct, GRPO + DAPO dynamic sampling through a
raas service in this process, a weight sync into llama.cpp after every step, a time budget. The held-out
pass rate (every problem ``--eval-samples`` times at temperature 1) is measured before the first step and
every ``--eval-every`` steps. Runs:

* ``--task addition``: ``builtin:addition:train`` (61 one-digit sums), held out ``builtin:addition:test``
  (20 others);
* ``--task lookup``: the agentic task whose answer is in a file inside the sandbox (``builtin:lookup``):
  also reports the fraction of rollouts that call the bash tool;
* ``--mode async`` (DynamicSampler with carry-over: rollouts keep running while the trainer trains) or
  ``--mode sync`` (generate-then-train: unfinished groups are cancelled at each step's end, so the trainer
  and the rollouts take turns).

Each run's summary is merged into ``bench/results/learning.json`` under ``TASK-MODE``; its step log and
plot are copied to ``bench/results/learning_TASK-MODE.jsonl`` / ``.png``.

Usage: ``python bench/learning.py --task addition --mode async --minutes 40``. ``--from-log DIR`` summarizes
a run that was stopped early from its ``train.jsonl`` (its evaluations so far are the result).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from raas.learn.reference import TrainConfig, train
from raas.trainer.train_log import plot_learning_curve, read_log

RESULTS = Path(__file__).resolve().parent / "results"
TASKS = {
    "addition": {
        "train_data": "builtin:addition:train",
        "eval_data": "builtin:addition:test",
        "max_tokens": 24,
    },
    "lookup": {"train_data": "builtin:lookup:train", "eval_data": "builtin:lookup:test:16", "max_tokens": 96},
}


def save_run(name: str, result: dict[str, Any], log: str | Path, plot: str | Path | None) -> None:
    """Merge ``result`` into ``bench/results/learning.json`` under ``name``; copy its log and plot beside it."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "learning.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[name] = result
    path.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")
    shutil.copy(log, RESULTS / f"learning_{name}.jsonl")
    if plot:
        shutil.copy(plot, RESULTS / f"learning_{name}.png")


def summarize(records: list[dict[str, Any]], cfg: TrainConfig, wall_s: float) -> dict[str, Any]:
    steps = [r for r in records if r["kind"] == "step"]
    evals = [r for r in records if r["kind"] == "eval"]

    def mean(key: str, rows: list[dict[str, Any]] = steps) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.fmean(vals), 4) if vals else None

    evals = [e for e in evals if e["pass_rate"] is not None]  # an all-filtered evaluation has no verdict
    first, last = evals[0], evals[-1]
    reached = {}
    for level in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8):
        hit = next((e for e in evals if e["pass_rate"] >= level), None)
        reached[str(level)] = round(hit["wall_s"], 1) if hit else None
    fresh = [s for s in steps if s.get("fresh_logprob_abs_diff_mean") is not None]
    return {
        "steps": len(steps),
        "wall_s": round(wall_s, 1),
        "pass_rate_before": round(first["pass_rate"], 4),
        "pass_rate_after": round(last["pass_rate"], 4),
        "pass_rate_best": round(max(e["pass_rate"] for e in evals), 4),
        "tool_call_fraction_before": first.get("tool_call_fraction"),
        "tool_call_fraction_after": last.get("tool_call_fraction"),
        "evals": [
            {
                k: round(e[k], 4) if isinstance(e[k], float) else e[k]
                for k in ("step", "wall_s", "pass_rate", "tool_call_fraction")
            }
            for e in evals
        ],
        "wall_s_to_pass_rate": reached,
        "trainer_idle_fraction": round(
            sum(s["wait_s"] for s in steps) / max(sum(s["step_s"] for s in steps), 1e-9), 4
        ),
        "trainer_idle_fraction_first_10_steps": round(
            sum(s["wait_s"] for s in steps[:10]) / max(sum(s["step_s"] for s in steps[:10]), 1e-9), 4
        ),
        "mean_wait_s": mean("wait_s"),
        "mean_train_s": mean("train_s"),
        "mean_sync_s": mean("sync_s"),
        "mean_sync_pause_s": mean("sync_pause_s"),
        "mean_step_s": mean("step_s"),
        "train_tokens_per_s": mean("train_tokens_per_s"),
        "rollout_tokens_per_s": mean("rollout_tokens_per_s"),
        "informative_fraction": mean("informative_fraction"),
        "response_len_first": steps[0].get("response_len_mean") if steps else None,
        "response_len_last": steps[-1].get("response_len_mean") if steps else None,
        "logprob_mismatch_step1": {
            "mean_abs": steps[0].get("fresh_logprob_abs_diff_mean") if steps else None,
            "max_abs": steps[0].get("fresh_logprob_abs_diff_max") if steps else None,
            "tokens": steps[0].get("trained_tokens") if steps else None,
        },
        "logprob_mismatch_fresh_rows_mean": mean("fresh_logprob_abs_diff_mean", fresh),
        "logprob_mismatch_fresh_rows_max": max(
            (s["fresh_logprob_abs_diff_max"] for s in fresh), default=None
        ),
        "filtered_rollouts": sum(s.get("filtered", 0) for s in steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=sorted(TASKS), default="addition")
    ap.add_argument("--mode", choices=("async", "sync"), default="async")
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--target-groups", type=int, default=4)
    ap.add_argument("--inflight", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-save", action="store_true", help="print only; do not touch bench/results")
    ap.add_argument("--from-log", help="summarize the stopped run whose out dir this is (same settings)")
    args = ap.parse_args()
    task = TASKS[args.task]
    name = f"{args.task}-{args.mode}"
    out_dir = Path(tempfile.mkdtemp(prefix=f"raas-learning-{name}-"))
    cfg = TrainConfig(
        train_data=str(task["train_data"]),
        eval_data=str(task["eval_data"]),
        steps=args.steps,
        group_size=args.group_size,
        target_groups=args.target_groups,
        max_inflight_groups=args.inflight,
        carry_over=args.mode == "async",
        lr=args.lr,
        max_tokens=int(task["max_tokens"]),
        max_response_len=384 if args.task == "lookup" else 64,
        max_prompt_len=1024,
        eval_every=args.eval_every,
        eval_samples=args.eval_samples,
        max_wall_s=args.minutes * 60,
        seed=args.seed,
        out_dir=str(out_dir),
        progress=False,
    )
    load = os.getloadavg()[0]
    started = time.monotonic()
    records: list[dict[str, Any]] = []

    def show(rec: dict[str, Any]) -> None:
        records.append(rec)
        keys = (
            "kind",
            "step",
            "pass_rate",
            "reward_mean",
            "tool_call_fraction",
            "wait_s",
            "train_s",
            "sync_s",
        )
        print(json.dumps({k: rec.get(k) for k in keys}), flush=True)

    if args.from_log:
        log_path = Path(args.from_log) / "train.jsonl"
        records = read_log(log_path)
        wall = max((r["wall_s"] for r in records), default=0.0)
        plot: str | None = str(plot_learning_curve(log_path, out_dir / "learning_curve.png"))
        saved_log = str(log_path)
    else:
        summary = asyncio.run(train(cfg, on_step=show))
        wall, plot, saved_log = time.monotonic() - started, summary.plot_path, summary.log_path
    result = {
        "model": "SmolLM2-135M-Instruct (trained in torch fp32; served by llama.cpp from an f16 GGUF)",
        "task": args.task,
        "mode": args.mode,
        "cpu_cores": os.cpu_count(),
        "load_average_at_start": round(load, 2),
        "config": {
            "lr": cfg.lr,
            "group_size": cfg.group_size,
            "target_groups": cfg.target_groups,
            "max_inflight_groups": cfg.max_inflight_groups,
            "max_tokens": cfg.max_tokens,
            "clip": [cfg.loss.clip_low, cfg.loss.clip_high],
            "kl_coef": cfg.loss.kl_coef,
            "eval_samples": cfg.eval_samples,
            "minutes": args.minutes,
            "seed": cfg.seed,
        },
        "stopped_early_from_log": bool(args.from_log),
        **summarize(records, cfg, wall),
    }
    print(json.dumps(result, indent=1))
    if not args.no_save:
        save_run(name, result, saved_log, plot)
    shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
