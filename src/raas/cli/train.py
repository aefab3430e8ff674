"""``raas train``: the reference GRPO/DAPO trainer (:mod:`raas.learn.reference`) from the command line.

With no ``--server`` it starts everything in this process (the policy's llama.cpp server, a raas service)
and trains the embedded SmolLM2-135M-Instruct on ``builtin:addition:train``, evaluating on the held-out
``builtin:addition:test``; ``OUT/train.jsonl`` gets a line per step and per evaluation, and
``OUT/learning_curve.png`` the plot.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer


def train(
    train_data: Annotated[
        str, typer.Option(help="Training dataset (builtin:NAME[:SPLIT][:N] or a file).")
    ] = ("builtin:addition:train"),
    eval_data: Annotated[
        str, typer.Option(help="Held-out dataset for the pass rate.")
    ] = "builtin:addition:test",
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 40,
    group_size: Annotated[int, typer.Option(help="Samples per prompt (GRPO group).")] = 8,
    target_groups: Annotated[int, typer.Option(help="Informative groups per step (DAPO).")] = 8,
    max_inflight_groups: Annotated[int, typer.Option(help="Most groups running at once.")] = 12,
    carry_over: Annotated[
        bool, typer.Option(help="Keep unfinished groups running through the update (asynchronous).")
    ] = True,
    max_staleness: Annotated[int, typer.Option(help="Most weight versions a trained sample may lag.")] = 1,
    mask_stale_turns: Annotated[bool, typer.Option(help="Loss 0 on turns of an older policy.")] = False,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 1e-5,
    clip_low: Annotated[float, typer.Option(help="PPO clip below 1 (ε_low).")] = 0.2,
    clip_high: Annotated[float, typer.Option(help="PPO clip above 1 (ε_high; DAPO's clip-higher).")] = 0.28,
    kl_coef: Annotated[
        float, typer.Option(help="k3 KL penalty against the initial policy (0: KL-free).")
    ] = 0.0,
    max_tokens: Annotated[int, typer.Option(help="Tokens per model turn.")] = 32,
    max_response_len: Annotated[
        int, typer.Option(help="Response columns of a batch row (longer rows: loss masked).")
    ] = 256,
    max_prompt_len: Annotated[int, typer.Option(help="Prompt columns of a batch row.")] = 1024,
    eval_every: Annotated[int, typer.Option(help="Evaluate every N steps (0: never).")] = 10,
    eval_samples: Annotated[int, typer.Option(help="Samples per held-out problem.")] = 4,
    model: Annotated[str | None, typer.Option(help="A llama-architecture GGUF (default: embedded).")] = None,
    tensor_type: Annotated[str, typer.Option(help="Weights the server loads: f16, bf16 or f32.")] = "f16",
    slots: Annotated[int, typer.Option(help="Decoding slots of the policy's llama.cpp server.")] = 8,
    server: Annotated[str | None, typer.Option(help="Use a running raas service.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when present).")] = None,
    max_minutes: Annotated[
        float | None, typer.Option(help="Time budget: start no new step after this many minutes.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Data order and torch seed.")] = 0,
    out: Annotated[
        str, typer.Option("--out", "-o", help="Directory for train.jsonl and the plot.")
    ] = "train-out",
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
) -> None:
    """Train a policy through raas: GRPO + DAPO dynamic sampling, a weight sync into llama.cpp per step."""
    from raas.errors import RaasError
    from raas.learn.reference import TrainConfig
    from raas.learn.reference import train as run_training
    from raas.trainer.policy_loss import LossConfig

    if tensor_type not in ("f16", "bf16", "f32"):
        raise typer.BadParameter("--tensor-type must be f16, bf16 or f32")
    cfg = TrainConfig(
        train_data=train_data,
        eval_data=eval_data,
        steps=steps,
        group_size=group_size,
        target_groups=target_groups,
        max_inflight_groups=max_inflight_groups,
        carry_over=carry_over,
        max_staleness=max_staleness,
        mask_stale_turns=mask_stale_turns,
        lr=lr,
        loss=LossConfig(clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef),
        max_tokens=max_tokens,
        max_response_len=max_response_len,
        max_prompt_len=max_prompt_len,
        eval_every=eval_every,
        eval_samples=eval_samples,
        model=model,
        tensor_type=tensor_type,  # type: ignore[arg-type]
        slots=slots,
        server=server,
        device=device,
        max_wall_s=max_minutes * 60 if max_minutes is not None else None,
        seed=seed,
        out_dir=out,
        progress=progress,
    )
    try:
        summary = asyncio.run(run_training(cfg))
    except RaasError as exc:
        typer.echo(f"raas train: {exc.kind}: {exc}", err=True)
        raise typer.Exit(1) from exc
    except KeyboardInterrupt:
        plot = Path(out) / "learning_curve.png"
        typer.echo(
            f"raas train: stopped; the log is {Path(out) / 'train.jsonl'}"
            + (f", the plot {plot}" if plot.exists() else ""),
            err=True,
        )
        raise typer.Exit(130) from None
    evals = [{"step": e["step"], "pass_rate": round(e["pass_rate"], 3)} for e in summary.evals]
    typer.echo(
        json.dumps(
            {
                "steps": summary.steps,
                "wall_s": round(summary.wall_s, 1),
                "evals": evals,
                "log": summary.log_path,
                "plot": summary.plot_path,
            }
        )
    )
