"""``raas train --recipe swe-mini``: a policy learns to fix bugs through raas's SWE path, in one command.

1. **Curriculum.** ``builtin:swe-mini`` (:mod:`raas.tasks.swe.mini.build`): SWE-bench-format records built
   and validated once (cached), train and held-out splits that share no module. Training uses the rungs in
   ``levels``; the held-out set is a fixed prefix of the test split at ``eval_levels``.
2. **Base.** The starting policy's held-out resolved rate (every instance ``eval_samples`` times).
3. **Warm start** (rejection-sampling fine-tuning): a scripted teacher acts out the gold fix of every
   training instance through the same tools (:mod:`raas.learn.warmstart`); EVAL keeps the resolved
   trajectories; the policy is fine-tuned on their exact tokens, observations masked (:mod:`raas.learn.sft`).
4. **RL.** ``raas train`` (GRPO + DAPO with carry-over and per-prompt pass-rate tracking) from the
   warm-started weights, for ``rl_minutes``; its step-0 evaluation is the warm start's held-out rate.

Everything goes through a raas service in this process with real sandboxes (``bwrap``): INIT copies the
repository, RUN's tools act in it, EVAL grades the patch with the hidden tests in a fresh sandbox.
``OUT/recipe.json`` gets the three held-out rates and what each phase cost; ``OUT/rl/`` holds
``train.jsonl`` and ``learning_curve.png``.

Run again into the same ``OUT`` (after a crash, a reboot or Ctrl-C), the recipe keeps the phases it
finished with the same settings (the base evaluation, the warm start whose weights are still there) and
starts RL again from the warm-started weights; the interrupted RL log is kept beside the new one.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from raas.errors import RaasError
from raas.learn.evaluation import evaluate
from raas.learn.local import local_service, policy_tokenizer
from raas.learn.progress import print_table
from raas.learn.reference import TrainConfig, train
from raas.learn.sft import SftConfig, read_results, sft
from raas.learn.warmstart import teacher_trajectories
from raas.tasks.swe.mini.build import MiniOptions, split_records
from raas.tasks.swe.mini.dataset import build_default
from raas.tasks.swe.mini.handler import AGENT_DEFAULTS


@dataclass
class SweMiniConfig:
    out_dir: str = "train-swe-mini"
    build: MiniOptions = field(default_factory=MiniOptions)
    """How the curriculum is built (its levels, modules, ...): the default is ``builtin:swe-mini``."""
    levels: tuple[str, ...] = ("function", "module")
    """The rungs trained on."""
    eval_levels: tuple[str, ...] = ("function", "module")
    eval_instances: int = 24
    eval_samples: int = 4
    train_instances: int | None = None
    """At most this many training instances (None: all of the split at ``levels``)."""
    base_eval: bool = True
    warm_start: bool = True
    sft_epochs: int = 2
    sft_lr: float = 5e-5
    trainable_layers: int | None = 20
    """The top N of SmolLM2's 30 decoder layers are trained (warm start and RL), the rest frozen: on 2
    cores a multi-turn row costs ~45% less and the trainer keeps no optimizer state for the rest."""
    rl_minutes: float = 120.0
    rl_steps: int = 1000
    eval_every: int = 5
    group_size: int = 8
    target_groups: int = 3
    max_inflight_groups: int = 6
    lr: float = 2e-5
    temperature: float = 1.0
    pass_rate_filter: bool = True
    dynamic_sampling: bool = True
    max_tokens_per_turn: int = AGENT_DEFAULTS["max_tokens_per_turn"]
    max_turns: int = AGENT_DEFAULTS["max_turns"]
    max_prompt_len: int = 1024
    max_response_len: int = 1536
    model: str | None = None
    """The starting GGUF; None: the embedded SmolLM2-135M-Instruct."""
    sandbox: str = "bwrap"
    slots: int = 8
    seed: int = 0
    progress: bool = True


_PHASE_SETTINGS = {
    "base": ("build", "eval_levels", "eval_instances", "eval_samples", "model", "sandbox", "temperature"),
    "warm_start": (
        "build",
        "levels",
        "train_instances",
        "model",
        "sft_epochs",
        "sft_lr",
        "trainable_layers",
        "seed",
    ),
}
"""The settings each finished phase depends on: a phase is reused only if all of them are unchanged."""


def _finished_phases(cfg: SweMiniConfig, out: Path) -> dict[str, Any]:
    """The phases an earlier run into ``out`` finished with the same settings (and whose files remain)."""
    try:
        earlier = json.loads((out / "recipe.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    now = json.loads(json.dumps(asdict(cfg)))  # tuples as lists, as the file has them
    kept: dict[str, Any] = {}
    for phase, keys in _PHASE_SETTINGS.items():
        done = earlier.get("phases", {}).get(phase)
        if done is None or any(earlier.get("config", {}).get(k) != now[k] for k in keys):
            continue
        if phase == "warm_start" and not Path(done.get("sft", {}).get("gguf", "")).is_file():
            continue
        kept[phase] = done
    return kept


def _stage(cfg: SweMiniConfig, text: str) -> None:
    if cfg.progress:
        import sys

        sys.stderr.write(f"[raas train swe-mini] {text}\n")
        sys.stderr.flush()


class _Every:
    """A progress line at most every ``interval_s`` seconds."""

    def __init__(self, cfg: SweMiniConfig, interval_s: float) -> None:
        self.cfg, self.interval_s, self.last = cfg, interval_s, 0.0

    def __call__(self, text: str) -> None:
        if time.monotonic() - self.last >= self.interval_s:
            self.last = time.monotonic()
            _stage(self.cfg, text)


async def _held_out(cfg: SweMiniConfig, gguf: str | None, test: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out resolved rate of the policy in ``gguf`` (None: the embedded model), served by a
    llama.cpp server of its own."""
    from raas.llm.embedded import EmbeddedServer
    from raas.llm.models import default_gguf_path

    tokenizer = await policy_tokenizer(gguf)
    server = EmbeddedServer(
        Path(gguf) if gguf else default_gguf_path(),
        parallel=cfg.slots,
        ctx_per_slot=AGENT_DEFAULTS["context_budget"],
    )
    sampling = {
        "temperature": cfg.temperature,
        "max_tokens": cfg.max_tokens_per_turn,
        "max_turns": cfg.max_turns,
    }
    async with server:
        async with local_service(
            [server.url], tokenizer, run_workers=cfg.slots, sandbox={"backend": cfg.sandbox}
        ) as url:
            every = _Every(cfg, 10.0)

            def counted(done: int, total: int, solved: int) -> None:
                every(f"  {done}/{total} held-out instances x {cfg.eval_samples}, {solved} resolved")

            return await evaluate(url, test, cfg.eval_samples, sampling, counted)


def _keep_interrupted_log(rl_dir: Path) -> None:
    """An earlier RL log in ``rl_dir`` is renamed ``train.<n>.jsonl`` instead of being overwritten."""
    log = rl_dir / "train.jsonl"
    if not log.exists():
        return
    n = 1
    while (rl_dir / f"train.{n}.jsonl").exists():
        n += 1
    log.rename(rl_dir / f"train.{n}.jsonl")


async def run_recipe(cfg: SweMiniConfig) -> dict[str, Any]:
    """Run the recipe (see the module docstring); returns what ``OUT/recipe.json`` holds."""
    started = time.monotonic()
    out = Path(cfg.out_dir)
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    finished = await asyncio.to_thread(_finished_phases, cfg, out)
    summary: dict[str, Any] = {"config": asdict(cfg), "phases": {}}

    def save() -> None:
        (out / "recipe.json").write_text(json.dumps(summary, indent=1, sort_keys=True), encoding="utf-8")

    _stage(cfg, "building the curriculum (cached after the first build)")
    t0 = time.monotonic()
    records = await asyncio.to_thread(build_default, cfg.build)
    train_rows = split_records(records, "train", cfg.levels)
    if cfg.train_instances is not None:
        train_rows = train_rows[: cfg.train_instances]
    test_rows = split_records(records, "test", cfg.eval_levels)[: cfg.eval_instances]
    if not train_rows or not test_rows:
        raise RaasError("the curriculum has no instance at these levels", kind="bad_request")
    data = out / "data"
    await asyncio.to_thread(data.mkdir, exist_ok=True)
    for name, rows in (("train", train_rows), ("test", test_rows)):
        text = "".join(json.dumps(r) + "\n" for r in rows)
        await asyncio.to_thread((data / f"{name}.jsonl").write_text, text, "utf-8")
    summary["phases"]["curriculum"] = {
        "train_instances": len(train_rows),
        "test_instances": len(test_rows),
        "records": len(records),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    _stage(cfg, f"{len(train_rows)} training and {len(test_rows)} held-out instances")
    save()

    if cfg.base_eval and "base" in finished:
        summary["phases"]["base"] = finished["base"]
        _stage(cfg, f"base held-out resolved rate (from the earlier run): {finished['base']['pass_rate']}")
    elif cfg.base_eval:
        _stage(cfg, f"held-out rate of the starting policy ({len(test_rows)} x {cfg.eval_samples} rollouts)")
        base = await _held_out(cfg, cfg.model, test_rows)
        summary["phases"]["base"] = base
        _stage(cfg, f"base held-out resolved rate: {base['pass_rate']}")
        save()

    start_model = cfg.model
    if cfg.warm_start and "warm_start" in finished:
        summary["phases"]["warm_start"] = finished["warm_start"]
        start_model = finished["warm_start"]["sft"]["gguf"]
        _stage(cfg, f"warm start (from the earlier run): {start_model}")
        save()
    elif cfg.warm_start:
        _stage(cfg, f"warm start: the teacher acts out {len(train_rows)} gold fixes through raas")
        tokenizer = await policy_tokenizer(cfg.model)
        every = _Every(cfg, 10.0)
        stats = await teacher_trajectories(
            train_rows,
            tokenizer,
            out / "warmstart.jsonl",
            sandbox=cfg.sandbox,
            workers=cfg.slots,
            on_result=lambda st: every(f"  {st.results}/{st.scripted} acted out, {st.resolved} resolved"),
        )
        _stage(cfg, f"warm start: {stats.resolved} of {stats.results} resolved by EVAL; fine-tuning")
        results = await asyncio.to_thread(read_results, out / "warmstart.jsonl")
        sft_cfg = SftConfig(
            epochs=cfg.sft_epochs,
            lr=cfg.sft_lr,
            model=cfg.model,
            seed=cfg.seed,
            trainable_layers=cfg.trainable_layers,
        )
        stop = threading.Event()
        try:
            tuned = await asyncio.to_thread(
                sft,
                results,
                sft_cfg,
                out / "sft",
                lambda rec: _stage(cfg, f"  fine-tuning: epoch {rec['epoch']} loss {rec['loss']:.3f}"),
                lambda epoch, done, total: every(f"  fine-tuning: epoch {epoch}, step {done}/{total}"),
                stop,
            )
        except asyncio.CancelledError:
            stop.set()  # the thread ends at its next optimizer step instead of finishing the epochs
            raise
        summary["phases"]["warm_start"] = {"teacher": asdict(stats), "sft": asdict(tuned)}
        start_model = tuned.gguf
        save()

    _stage(cfg, f"RL for up to {cfg.rl_minutes:g} minutes")
    await asyncio.to_thread(_keep_interrupted_log, out / "rl")
    rl_cfg = TrainConfig(
        train_data=str(data / "train.jsonl"),
        eval_data=str(data / "test.jsonl"),
        steps=cfg.rl_steps,
        group_size=cfg.group_size,
        target_groups=cfg.target_groups,
        max_inflight_groups=cfg.max_inflight_groups,
        lr=cfg.lr,
        temperature=cfg.temperature,
        max_tokens=cfg.max_tokens_per_turn,
        max_turns=cfg.max_turns,
        max_prompt_len=cfg.max_prompt_len,
        max_response_len=cfg.max_response_len,
        eval_every=cfg.eval_every,
        eval_samples=cfg.eval_samples,
        model=start_model,
        slots=cfg.slots,
        context_per_slot=AGENT_DEFAULTS["context_budget"],
        sandbox=cfg.sandbox,
        pass_rate_filter=cfg.pass_rate_filter,
        trainable_layers=cfg.trainable_layers,
        dynamic_sampling=cfg.dynamic_sampling,
        max_wall_s=cfg.rl_minutes * 60,
        seed=cfg.seed,
        out_dir=str(out / "rl"),
        progress=cfg.progress,
    )
    rl = await train(rl_cfg)
    evals = [e for e in rl.evals if e.get("pass_rate") is not None]
    summary["phases"]["rl"] = {
        "steps": rl.steps,
        "wall_s": round(rl.wall_s, 1),
        "evals": rl.evals,
        "log": rl.log_path,
        "plot": rl.plot_path,
    }
    summary["held_out"] = {
        "base": summary["phases"].get("base", {}).get("pass_rate"),
        "warm_start": evals[0]["pass_rate"] if evals and cfg.warm_start else None,
        "rl_start": evals[0]["pass_rate"] if evals else None,
        "rl_final": evals[-1]["pass_rate"] if evals else None,
        "rl_best": max(e["pass_rate"] for e in evals) if evals else None,
    }
    summary["wall_s"] = round(time.monotonic() - started, 1)
    save()
    if cfg.progress:
        h = summary["held_out"]
        print_table(
            "swe-mini: held-out resolved rate (unseen modules, graded by EVAL)",
            ["policy", "resolved rate", "rollouts"],
            [
                ["base", h["base"], summary["phases"].get("base", {}).get("rollouts")],
                ["after warm start", h["warm_start"], evals[0]["rollouts"] if evals else None],
                [f"after RL ({rl.steps} steps)", h["rl_final"], evals[-1]["rollouts"] if evals else None],
            ],
        )
    return summary
