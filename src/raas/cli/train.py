"""``raas train``: the reference GRPO/DAPO trainer (:mod:`raas.learn.reference`) from the command line.

With no ``--server`` it starts everything in this process (the policy's llama.cpp server, a raas service)
and trains the embedded SmolLM2-135M-Instruct on ``builtin:addition:train``, evaluating on the held-out
``builtin:addition:test``; ``OUT/train.jsonl`` gets a line per step and per evaluation,
``OUT/results.jsonl`` the samples each step trained on, and ``OUT/learning_curve.png`` the plot.

Two other modes:

* ``--recipe swe-mini`` runs :mod:`raas.learn.swe_mini` (curriculum, base evaluation, warm start, RL on the
  SWE path) with the recipe's own settings; ``--out``, ``--model``, ``--seed``, ``--max-minutes`` (RL's
  budget, default 120), ``--steps``, ``--eval-samples``, ``--lr`` and ``--progress`` override them;
* ``--sft RESULTS.jsonl`` fine-tunes on the resolved trajectories of a results file
  (:mod:`raas.learn.sft`) and writes ``OUT/policy.gguf`` for ``--model``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer

RECIPES = ("swe-mini",)


def train(
    train_data: Annotated[
        str, typer.Option(help="Training dataset (builtin:NAME[:SPLIT][:N] or a file).")
    ] = ("builtin:addition:train"),
    eval_data: Annotated[
        str, typer.Option(help="Held-out dataset for the pass rate.")
    ] = "builtin:addition:test",
    steps: Annotated[int | None, typer.Option(help="Optimizer steps (default 40).")] = None,
    group_size: Annotated[int, typer.Option(help="Samples per prompt (GRPO group).")] = 8,
    target_groups: Annotated[int, typer.Option(help="Informative groups per step (DAPO).")] = 8,
    max_inflight_groups: Annotated[int, typer.Option(help="Most groups running at once.")] = 12,
    carry_over: Annotated[
        bool, typer.Option(help="Keep unfinished groups running through the update (asynchronous).")
    ] = True,
    dynamic_sampling: Annotated[
        bool, typer.Option(help="Train only on groups whose rewards differ (DAPO); off: every group.")
    ] = True,
    trainable_layers: Annotated[
        int | None, typer.Option(help="Train only the top N decoder layers (default: all).")
    ] = None,
    max_staleness: Annotated[int, typer.Option(help="Most weight versions a trained sample may lag.")] = 1,
    mask_stale_turns: Annotated[bool, typer.Option(help="Loss 0 on turns of an older policy.")] = False,
    pass_rate_filter: Annotated[
        bool,
        typer.Option(
            help="Defer prompts all solved or all failed in their recent samples; prefer those near 50%."
        ),
    ] = False,
    lr: Annotated[float | None, typer.Option(help="AdamW learning rate (default 1e-5; SFT 2e-5).")] = None,
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
    eval_samples: Annotated[
        int | None, typer.Option(help="Samples per held-out problem (default 4).")
    ] = None,
    model: Annotated[str | None, typer.Option(help="A llama-architecture GGUF (default: embedded).")] = None,
    tensor_type: Annotated[str, typer.Option(help="Weights the server loads: f16, bf16 or f32.")] = "f16",
    slots: Annotated[int, typer.Option(help="Decoding slots of the policy's llama.cpp server.")] = 8,
    sandbox: Annotated[
        str | None, typer.Option(help="Sandbox backend of the in-process service (bwrap for SWE tasks).")
    ] = None,
    server: Annotated[str | None, typer.Option(help="Use a running raas service.")] = None,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when present).")] = None,
    max_minutes: Annotated[
        float | None, typer.Option(help="Time budget: start no new step after this many minutes.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Data order and torch seed.")] = 0,
    out: Annotated[
        str | None, typer.Option("--out", "-o", help="Output directory (default train-out; train-swe-mini).")
    ] = None,
    progress: Annotated[
        bool, typer.Option(help="Show progress (a bar on a terminal, lines in a file).")
    ] = True,
    recipe: Annotated[
        str | None, typer.Option(help=f"Run a whole recipe: {', '.join(RECIPES)} (docs: Trainers).")
    ] = None,
    sft: Annotated[
        Path | None, typer.Option(help="Fine-tune on the resolved trajectories of this results file instead.")
    ] = None,
    sft_epochs: Annotated[int, typer.Option(help="Epochs of --sft (and of the recipe's warm start).")] = 2,
) -> None:
    """Train a policy through raas: GRPO + DAPO dynamic sampling, a weight sync into llama.cpp per step."""
    from raas.errors import RaasError

    try:
        if recipe is not None and sft is not None:
            raise RaasError("give --recipe or --sft, not both", kind="bad_request")
        if recipe is not None:
            summary = _recipe(
                recipe, out, model, seed, max_minutes, steps, eval_samples, lr, sft_epochs, progress
            )
            typer.echo(json.dumps({"held_out": summary["held_out"], "out": out or "train-swe-mini"}))
            return
        if sft is not None:
            typer.echo(json.dumps(_sft(sft, out or "sft-out", model, lr, sft_epochs, seed)))
            return
    except RaasError as exc:
        typer.echo(f"raas train: {exc.kind}: {exc}", err=True)
        raise typer.Exit(2 if exc.kind == "bad_request" else 1) from exc
    except KeyboardInterrupt:
        where = Path(out or ("train-swe-mini" if recipe else "sft-out"))
        done = where / ("recipe.json" if recipe else "sft.jsonl")
        typer.echo(
            "raas train: stopped (rollouts, sandboxes and model servers shut down)"
            + (f"; what was done so far is in {done}" if done.exists() else ""),
            err=True,
        )
        raise typer.Exit(130) from None
    _rl(**{k: v for k, v in locals().items() if k not in ("recipe", "sft", "sft_epochs", "RaasError")})


def _recipe(
    name: str,
    out: str | None,
    model: str | None,
    seed: int,
    max_minutes: float | None,
    steps: int | None,
    eval_samples: int | None,
    lr: float | None,
    sft_epochs: int,
    progress: bool,
) -> dict[str, Any]:
    from raas.errors import RaasError
    from raas.learn.swe_mini import SweMiniConfig, run_recipe

    if name not in RECIPES:
        raise RaasError(f"unknown recipe {name!r} (known: {', '.join(RECIPES)})", kind="bad_request")
    cfg = SweMiniConfig(model=model, seed=seed, progress=progress, sft_epochs=sft_epochs)
    if out is not None:
        cfg.out_dir = out
    if max_minutes is not None:
        cfg.rl_minutes = max_minutes
    if steps is not None:
        cfg.rl_steps = steps
    if eval_samples is not None:
        cfg.eval_samples = eval_samples
    if lr is not None:
        cfg.lr = lr
    return asyncio.run(run_recipe(cfg))


def _sft(
    results: Path, out: str, model: str | None, lr: float | None, epochs: int, seed: int
) -> dict[str, Any]:
    from dataclasses import asdict

    from raas.learn.sft import SftConfig, read_results, sft

    cfg = SftConfig(model=model, epochs=epochs, seed=seed)
    if lr is not None:
        cfg.lr = lr
    summary = sft(read_results(results), cfg, out)
    return asdict(summary)


def _rl(
    *,
    train_data: str,
    eval_data: str,
    steps: int | None,
    group_size: int,
    target_groups: int,
    max_inflight_groups: int,
    carry_over: bool,
    dynamic_sampling: bool,
    trainable_layers: int | None,
    max_staleness: int,
    mask_stale_turns: bool,
    pass_rate_filter: bool,
    lr: float | None,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    max_tokens: int,
    max_response_len: int,
    max_prompt_len: int,
    eval_every: int,
    eval_samples: int | None,
    model: str | None,
    tensor_type: str,
    slots: int,
    sandbox: str | None,
    server: str | None,
    device: str | None,
    max_minutes: float | None,
    seed: int,
    out: str | None,
    progress: bool,
) -> None:
    from raas.errors import RaasError
    from raas.learn.progress import print_table
    from raas.learn.reference import TrainConfig
    from raas.learn.reference import train as run_training
    from raas.trainer.policy_loss import LossConfig

    if tensor_type not in ("f16", "bf16", "f32"):
        raise typer.BadParameter("--tensor-type must be f16, bf16 or f32")
    out = out or "train-out"
    cfg = TrainConfig(
        train_data=train_data,
        eval_data=eval_data,
        steps=40 if steps is None else steps,
        group_size=group_size,
        target_groups=target_groups,
        max_inflight_groups=max_inflight_groups,
        carry_over=carry_over,
        dynamic_sampling=dynamic_sampling,
        trainable_layers=trainable_layers,
        max_staleness=max_staleness,
        mask_stale_turns=mask_stale_turns,
        pass_rate_filter=pass_rate_filter,
        lr=1e-5 if lr is None else lr,
        loss=LossConfig(clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef),
        max_tokens=max_tokens,
        max_response_len=max_response_len,
        max_prompt_len=max_prompt_len,
        eval_every=eval_every,
        eval_samples=4 if eval_samples is None else eval_samples,
        model=model,
        tensor_type=tensor_type,  # type: ignore[arg-type]
        slots=slots,
        sandbox=sandbox,
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
    evals = [{"step": e["step"], "pass_rate": e["pass_rate"]} for e in summary.evals]
    if progress:
        print_table(
            "raas train: held-out pass rate",
            ["step", "pass rate", "rollouts", "calling a tool", "wall s"],
            [
                [e["step"], e["pass_rate"], e["rollouts"], e["tool_call_fraction"], round(e["wall_s"])]
                for e in summary.evals
            ],
        )
    typer.echo(
        json.dumps(
            {
                "steps": summary.steps,
                "wall_s": round(summary.wall_s, 1),
                "evals": [
                    {**e, "pass_rate": None if e["pass_rate"] is None else round(e["pass_rate"], 3)}
                    for e in evals
                ],
                "log": summary.log_path,
                "plot": summary.plot_path,
            }
        )
    )
