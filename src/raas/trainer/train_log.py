"""What the reference trainer writes down: one JSON line per step and per evaluation, the results each
step trained on, a live progress bar, and a learning-curve plot at the end.

The JSONL file is the record (every figure a benchmark or a README quotes comes from it); the plot is
drawn from that file alone, so it can be redrawn from any run's log (``plot_learning_curve(log)``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from raas.trainer.grpo import group_advantages
from raas.trainer.types import Group, is_valid


class TrainLog:
    """Append-only JSONL: ``{"kind": "step", ...}`` and ``{"kind": "eval", ...}`` records."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO | None = self.path.open("w", encoding="utf-8")
        self.records: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            raise ValueError("the training log is closed")
        clean = {k: _finite(v) for k, v in record.items()}
        self.records.append(clean)
        self._fh.write(json.dumps(clean, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> TrainLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrainedResults:
    """Append-only ``results.jsonl`` of a training run: every sample a step trained on, as the service
    returned it, plus ``train_step``, ``group_id`` and the ``advantage`` it was trained with (the group
    baseline :func:`~raas.trainer.grpo.assemble_batch` uses). ``raas view OUT`` lists a step's jobs from it.

    Why the trainer writes it and not the service: the ledger does not know which results a step used (a
    DAPO step keeps some groups, drops others, carries some over), and the service of ``raas train`` lives
    only as long as the run."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh: TextIO | None = self.path.open("w", encoding="utf-8")

    def write(self, step: int, groups: Sequence[Group], *, std_normalize: bool = False) -> int:
        """Append the usable samples of ``groups`` trained at ``step``; returns how many."""
        if self._fh is None:
            raise ValueError("the results file is closed")
        lines = []
        for group in groups:
            samples = [r for r in group.samples if is_valid(r)]
            rewards = [float(r.reward) for r in samples]  # type: ignore[arg-type]
            for r, adv in zip(samples, group_advantages(rewards, std_normalize=std_normalize), strict=True):
                body = r.model_dump(mode="json")
                body.update(train_step=step, group_id=group.group_id, advantage=float(adv))
                lines.append(json.dumps(body) + "\n")
        self._fh.write("".join(lines))
        self._fh.flush()
        return len(lines)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> TrainedResults:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: they become null (a diverged loss still leaves a readable log)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _series(records: list[dict[str, Any]], key: str) -> list[float]:
    """One field of every record as floats, a missing or null value as NaN (a gap in the plot)."""
    return [float(r[key]) if r.get(key) is not None else math.nan for r in records]


def read_log(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def plot_learning_curve(log: str | Path, out: str | Path, title: str = "raas reference trainer") -> Path:
    """A PNG with four panels over training steps: held-out pass rate (evaluations), training reward,
    the rollout-vs-trainer log-prob mismatch, and where each step's time went."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_log(log)
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    if evals:
        ax.plot([e["step"] for e in evals], _series(evals, "pass_rate"), "o-", label="held-out pass rate")
        if any(e.get("tool_call_fraction") for e in evals):
            ax.plot(
                [e["step"] for e in evals],
                _series(evals, "tool_call_fraction"),
                "s--",
                label="rollouts calling the tool",
            )
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_title("held-out evaluation")
    if evals:
        ax.legend(loc="lower right")
    ax = axes[0][1]
    xs = [s["step"] for s in steps]
    ax.plot(xs, _series(steps, "reward_mean"), label="reward mean (all judged groups)")
    ax.plot(xs, _series(steps, "informative_fraction"), label="informative-group fraction")
    ax.set_ylim(0, 1)
    ax.set_xlabel("step")
    ax.set_title("training rollouts")
    ax.legend(loc="lower right")
    ax = axes[1][0]
    ax.plot(xs, _series(steps, "logprob_abs_diff_mean"), label="mean |Δ|, all rows")
    ax.plot(xs, _series(steps, "logprob_abs_diff_max"), label="max |Δ|, all rows", alpha=0.5)
    ax.plot(
        xs,
        _series(steps, "fresh_logprob_abs_diff_mean"),
        "o",
        label="mean |Δ|, rows sampled by the trainer's weights",
    )
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel("step")
    ax.set_title("rollout vs trainer log-probs (sampled tokens)")
    ax.legend(loc="upper left")
    ax = axes[1][1]
    ax.stackplot(
        xs,
        _series(steps, "wait_s"),
        _series(steps, "train_s"),
        _series(steps, "sync_s"),
        labels=["waiting for rollouts", "optimizer step", "weight sync"],
    )
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.set_title("trainer time per step")
    ax.legend(loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
