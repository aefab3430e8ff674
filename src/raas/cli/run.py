"""``raas run``: run a dataset end to end over HTTP, as a trainer would, and summarise it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from raas.cli.common import choose_sandbox, console, fail
from raas.cli.inprocess import embedded_llm, service_in_process
from raas.errors import RaasError
from raas.tasks.datasets import BUILTIN_SPLITS, BUILTINS

TERMINAL = ("completed", "failed", "timeout", "cancelled")


BASE_AGENT: dict[str, int] = {"max_turns": 4, "max_tokens_per_turn": 256, "context_budget": 2048}
"""The agent settings of a run whose task names none of its own (math and the built-in benchmarks are
measured with these)."""


def _default_help() -> dict[str, str]:
    """``(default 4; SWE tasks 30)``: the generic default and each task's own, for ``raas run --help``."""
    from raas.tasks.swe.config import AGENT_DEFAULTS as SWE

    return {k: f"(default {v}; SWE tasks {SWE[k]})" for k, v in BASE_AGENT.items()}


_DEFAULTS = _default_help()


def agent_settings(
    instances: list[dict[str, Any]], chosen: dict[str, int | None]
) -> tuple[dict[str, int], list[dict[str, int]]]:
    """The run's agent settings (``chosen``, the user's, over :data:`BASE_AGENT`) and, per instance, the
    settings its task handler's ``agent_defaults`` add where the user chose nothing (sent per job)."""
    from raas.tasks.registry import HandlerRegistry

    user = {k: v for k, v in chosen.items() if v is not None}
    classes = HandlerRegistry().classes()
    extra: list[dict[str, int]] = []
    for inst in instances:
        cls = classes.get(str(inst.get("data_source")))
        defaults = cls.agent_defaults if cls is not None else {}
        extra.append({k: v for k, v in defaults.items() if k not in user})
    return {**BASE_AGENT, **user}, extra


def make_jobs(
    instances: list[dict[str, Any]],
    n_samples: int,
    run_id: str,
    sampling_params: dict[str, Any] | None,
    timeout_s: float | None,
    per_instance: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One request per (instance, sample); job ids are unique per run so reruns never collide.
    ``per_instance[i]`` adds to instance i's sampling params (its handler's agent defaults)."""
    jobs = []
    for i, inst in enumerate(instances):
        params = {**(sampling_params or {}), **(per_instance[i] if per_instance else {})}
        for k in range(n_samples):
            body: dict[str, Any] = {"instance": inst, "job_id": f"{run_id}-{i:05d}-{k}"}
            if params:
                body["sampling_params"] = params
            if timeout_s:
                body["timeout_s"] = timeout_s
            jobs.append(body)
    return jobs


class RunProgress:
    """Live view of a run: jobs per state, from the event stream and from results as they arrive."""

    def __init__(self, total: int) -> None:
        self.state: dict[str, str] = {}
        self.total = total
        self.progress = Progress(
            TextColumn("[bold]rollouts"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=console,
            transient=False,
        )
        self.task = self.progress.add_task("", total=total)

    def set(self, job_id: str, status: str) -> None:
        if self.state.get(job_id) in TERMINAL:
            return
        self.state[job_id] = status
        self.refresh()

    def counts(self) -> Counter[str]:
        return Counter(self.state.values())

    def refresh(self) -> None:
        c = self.counts()
        done = sum(c[s] for s in TERMINAL)
        desc = (
            f"done {c['completed']}  failed {c['failed'] + c['timeout'] + c['cancelled']}  |  "
            f"init {c['queued'] + c['init']}  run {c['queued_run'] + c['run']}  "
            f"eval {c['queued_eval'] + c['eval']}"
        )
        self.progress.update(self.task, completed=done, description=desc)


async def drive(
    client: Any,
    jobs: list[dict[str, Any]],
    progress: RunProgress | None = None,
    *,
    job_timeout_s: float | None = None,
    parallel_polls: int = 48,
) -> list[dict[str, Any]]:
    """Submit ``jobs`` and collect every result (in submission order)."""
    progress = progress or RunProgress(len(jobs))
    for j in jobs:
        progress.state[j["job_id"]] = "queued"
    progress.refresh()
    events_task = asyncio.create_task(_follow_events(client, progress))
    try:
        await asyncio.sleep(0)  # let the subscription open before the first job can move
        for start in range(0, len(jobs), 256):
            for item in await client.submit_batch(jobs[start : start + 256]):
                if item.get("status") in TERMINAL:  # an earlier run already finished it (idempotent ids)
                    progress.set(str(item.get("job_id")), str(item["status"]))
        gate = asyncio.Semaphore(parallel_polls)

        async def one(job_id: str) -> dict[str, Any]:
            try:
                async with gate:
                    res = await client.wait(job_id, timeout_s=job_timeout_s)
            except RaasError as e:
                # The result could not be fetched (service gone, job pruned): report it as a filtered
                # failure of this client rather than losing every other result with it.
                res = {
                    "job_id": job_id,
                    "status": "failed",
                    "reward": None,
                    "filter": True,
                    "error": {"stage": "client", "kind": e.kind, "message": e.message},
                }
            progress.set(job_id, str(res.get("status")))
            return res

        return list(await asyncio.gather(*(one(j["job_id"]) for j in jobs)))
    finally:
        events_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await events_task


async def _follow_events(client: Any, progress: RunProgress) -> None:
    """Best effort: stage changes for the live view (results come from long-polls, not from here)."""
    with contextlib.suppress(RaasError):
        async for ev in client.events():
            job_id, status = ev.get("job_id"), ev.get("status")
            if job_id in progress.state and isinstance(status, str):
                progress.set(job_id, status)


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers for the summary table (also returned as JSON by ``raas run --json``)."""
    status = Counter(r.get("status") for r in results)
    scored = [r for r in results if r.get("reward") is not None and not r.get("filter")]
    rewards = [float(r["reward"]) for r in scored]
    failures = Counter(
        f"{(r.get('error') or {}).get('stage')}/{(r.get('error') or {}).get('kind')}"
        for r in results
        if r.get("error")
    )
    timing: dict[str, dict[str, float]] = {}
    for key in ("queue_s", "init_s", "run_s", "eval_s", "total_s"):
        vals = [float((r.get("timing") or {}).get(key) or 0.0) for r in results]
        timing[key] = {
            "p50": _pct(vals, 0.5),
            "p90": _pct(vals, 0.9),
            "max": max(vals) if vals else float("nan"),
        }
    turns = [len(r.get("turns") or []) for r in results]
    return {
        "jobs": len(results),
        "status": dict(status),
        "scored": len(scored),
        "filtered": sum(1 for r in results if r.get("filter")),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "pass_rate": sum(1 for x in rewards if x >= 1.0) / len(rewards) if rewards else None,
        "mean_turns": sum(turns) / len(turns) if turns else 0.0,
        "failures": dict(failures),
        "timing": timing,
    }


def print_summary(s: dict[str, Any], wall_s: float, out: Console | None = None) -> None:
    """The summary tables, on stdout unless ``out`` says otherwise (``--json`` sends them to stderr)."""
    out = out or Console()
    t = Table(title="raas run", show_header=False)
    t.add_row("jobs", str(s["jobs"]))
    t.add_row("status", ", ".join(f"{k} {v}" for k, v in sorted(s["status"].items())))
    t.add_row("scored / filtered", f"{s['scored']} / {s['filtered']}")
    t.add_row("reward mean", "n/a" if s["reward_mean"] is None else f"{s['reward_mean']:.3f}")
    t.add_row("pass rate", "n/a" if s["pass_rate"] is None else f"{s['pass_rate']:.1%}")
    t.add_row("mean turns", f"{s['mean_turns']:.2f}")
    t.add_row("wall time", f"{wall_s:.1f} s")
    out.print(t)
    tt = Table(title="time per stage (s)")
    for col in ("stage", "p50", "p90", "max"):
        tt.add_column(col, justify="right" if col != "stage" else "left")
    for key, v in s["timing"].items():
        tt.add_row(key.removesuffix("_s"), f"{v['p50']:.2f}", f"{v['p90']:.2f}", f"{v['max']:.2f}")
    out.print(tt)
    if s["failures"]:
        ft = Table(title="failures by stage/kind")
        ft.add_column("stage/kind")
        ft.add_column("count", justify="right")
        for k, n in sorted(s["failures"].items(), key=lambda kv: -kv[1]):
            ft.add_row(k, str(n))
        out.print(ft)


def write_jsonl(path: Path, results: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".part")
    with tmp.open("w", encoding="utf-8") as f:
        for r in results:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


async def run_dataset(
    instances: list[dict[str, Any]],
    *,
    n_samples: int,
    server: str | None,
    llm: list[str],
    out: Path | None,
    sandbox: dict[str, Any] | None,
    agent: dict[str, Any],
    sampling: dict[str, Any],
    job_timeout_s: float,
    workers: tuple[int, int, int],
    tokenizer_dir: Path | None,
    llm_context: int,
    token: str | None,
    per_instance: list[dict[str, Any]] | None = None,
    replay_patches: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run every instance ``n_samples`` times and return the summary; the whole stack lives and dies here
    unless ``server`` points at a running service. ``replay_patches`` (instance_id -> patch): the replay
    policy plays them instead of a model (:mod:`raas.tasks.swe.replay`)."""
    from raas.trainer.client import RaasClient

    run_id = "run-" + secrets.token_hex(4)
    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        url = server
        servers = list(llm)
        if replay_patches is not None:
            from raas.llm.models import default_tokenizer_dir
            from raas.llm.scripted import ScriptedLLM
            from raas.llm.tokenizer import ChatTokenizer
            from raas.tasks.swe.replay import replay_book, replay_context

            tok = ChatTokenizer.from_pretrained(tokenizer_dir or default_tokenizer_dir())
            book, scripts = replay_book(tok, replay_patches, instances)
            # The script's own budgets win: a replayed patch is one turn however long it is.
            per_instance = [
                {**(per_instance[i] if per_instance else {}), **sp} for i, sp in enumerate(scripts)
            ]
            scripted = ScriptedLLM(book, max_model_len=replay_context(scripts))
            servers = [(await stack.enter_async_context(scripted)).url]
        jobs = make_jobs(instances, n_samples, run_id, sampling, job_timeout_s, per_instance)
        if url is None:
            from raas.agent.config import AgentConfig
            from raas.llm.models import default_tokenizer_dir
            from raas.pipeline.config import ServiceConfig

            if not servers:
                with console.status("starting the embedded model server (llama.cpp, SmolLM2-135M)..."):
                    servers = [await stack.enter_async_context(embedded_llm(llm_context, workers[1]))]
            state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="raas-run-")))
            config = ServiceConfig(
                state_dir=state,
                sandbox=sandbox or {"backend": "local"},
                llm_servers=servers,
                tokenizer_dir=tokenizer_dir or default_tokenizer_dir(),
                agent=AgentConfig(**agent),
                init_workers=workers[0],
                run_workers=workers[1],
                eval_workers=workers[2],
                default_timeout_s=job_timeout_s,
                shutdown_grace_s=0.0,
                max_pending=max(1024, len(jobs)),
            )
            with console.status("starting the rollout service..."):
                url = await stack.enter_async_context(service_in_process(config))
        client = await stack.enter_async_context(RaasClient(url, token=token, timeout_s=60.0))
        progress = RunProgress(len(jobs))
        with Live(progress.progress, console=console, refresh_per_second=4, transient=False):
            # No client-side deadline: queue waits do not count against a job's budget, and the service
            # ends every accepted job (stage timeouts), so each long-poll returns eventually.
            results = await drive(client, jobs, progress)
    wall = time.monotonic() - started
    if out is not None:
        write_jsonl(out, results)
    summary = summarize(results)
    summary["wall_s"] = wall
    return summary


def report(summary: dict[str, Any], as_json: bool) -> None:
    """The run's summary: tables on stdout, or with ``as_json`` one JSON document on stdout and the tables
    on stderr, so ``raas run --json | jq`` parses (progress and status lines are on stderr either way)."""
    if as_json:
        print_summary(summary, summary["wall_s"], console)
        print(json.dumps(summary), flush=True)
    else:
        print_summary(summary, summary["wall_s"])


def _run_main(coro: Any) -> Any:
    """Run ``coro``; SIGINT/SIGTERM cancel it so every ``finally`` (servers, sandboxes, temp dirs) runs."""

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await coro
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        console.print("[yellow]interrupted: everything was shut down[/yellow]")
        raise typer.Exit(130) from None


def replay_inputs(
    policy: str, patches: Path | None, instances: list[dict[str, Any]], *, server: str | None, llm: Any
) -> dict[str, str] | None:
    """The patches ``--policy replay`` plays (instance_id -> patch), or None for ``--policy model``;
    ``bad_request`` for a combination that cannot work or a predictions file with a bad row."""
    if policy not in ("model", "replay"):
        raise RaasError(f"--policy must be 'model' or 'replay', not {policy!r}", kind="bad_request")
    if policy == "model":
        if patches is not None:
            raise RaasError("--patches is for --policy replay", kind="bad_request")
        return None
    if patches is None:
        raise RaasError("--policy replay needs --patches FILE (SWE-bench predictions)", kind="bad_request")
    if server or llm:
        raise RaasError("--policy replay serves its own policy: drop --server and --llm", kind="bad_request")
    from raas.cli.swe_eval import load_predictions
    from raas.tasks.swe.images import SWE_SOURCES

    not_swe = [str(i.get("instance_id")) for i in instances if i.get("data_source") not in SWE_SOURCES]
    if not_swe:
        raise RaasError(
            f"--policy replay plays SWE patches; not SWE records: {', '.join(not_swe[:5])}",
            kind="bad_request",
        )
    out: dict[str, str] = {}
    for p in load_predictions(patches):
        if p.error is not None:
            raise RaasError(p.error.message, kind=p.error.kind)
        out[p.instance_id] = p.model_patch
    ids = [str(i.get("instance_id")) for i in instances]
    missing = [i for i in ids if i not in out]
    if missing:  # a typo in an id would otherwise pass as a wrong patch
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        console.print(
            f"{len(missing)} of {len(ids)} instances have no prediction in {patches} and are played without "
            f"an edit (graded empty_patch): {shown}",
            style="yellow",
            markup=False,
        )
    return out


_SPLITS = ", ".join(f"{name} ({'/'.join(splits)})" for name, splits in BUILTIN_SPLITS.items())


def run(
    dataset: Annotated[
        str,
        typer.Argument(
            help=f"builtin:NAME[:N] ({', '.join(BUILTINS)}; builtin:NAME:SPLIT[:N] for {_SPLITS}), "
            "or a .jsonl/.json/.parquet file"
        ),
    ],
    n_samples: Annotated[int, typer.Option("--n-samples", "-n", min=1, help="Rollouts per instance")] = 1,
    server: Annotated[str | None, typer.Option(help="Use a running raas service at this URL")] = None,
    llm: Annotated[
        list[str] | None, typer.Option(help="Inference server URL (repeatable); default: embedded")
    ] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write results as JSONL")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Use only the first N instances")] = None,
    sandbox: Annotated[
        str, typer.Option(help="auto (bwrap if possible, else local), bwrap, apptainer, local")
    ] = "auto",
    image: Annotated[str | None, typer.Option(help="Sandbox image (rootfs dir, SIF, docker://...)")] = None,
    max_turns: Annotated[
        int | None,
        typer.Option(min=1, show_default=False, help=f"Agent turns per rollout {_DEFAULTS['max_turns']}"),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(min=1, show_default=False, help=f"Tokens per turn {_DEFAULTS['max_tokens_per_turn']}"),
    ] = None,
    context_budget: Annotated[
        int | None,
        typer.Option(
            min=64,
            show_default=False,
            help=f"Prompt + response tokens per rollout {_DEFAULTS['context_budget']}",
        ),
    ] = None,
    temperature: Annotated[float, typer.Option(min=0.0)] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed (per request)")] = None,
    timeout: Annotated[float, typer.Option(min=1.0, help="Seconds of in-stage time per rollout")] = 600.0,
    init_workers: Annotated[int, typer.Option(min=1)] = 4,
    run_workers: Annotated[int, typer.Option(min=1)] = 8,
    eval_workers: Annotated[int, typer.Option(min=1)] = 2,
    tokenizer: Annotated[
        Path | None, typer.Option(help="Chat tokenizer dir (default: the embedded model's)")
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print only the summary as JSON on stdout (the tables go to stderr)"),
    ] = False,
    policy: Annotated[
        str,
        typer.Option(
            help="model: sample from the model (embedded or --llm); replay: play --patches instead (SWE dry run)"
        ),
    ] = "model",
    patches: Annotated[
        Path | None,
        typer.Option(help="With --policy replay: SWE-bench predictions (instance_id, model_patch) to play"),
    ] = None,
) -> None:
    """Run a dataset end to end and summarise it (starts everything in-process unless --server is given)."""
    from raas.tasks.datasets import load_dataset

    try:
        instances = load_dataset(dataset)
        if limit is not None:
            instances = instances[:limit]
        if not instances:
            raise RaasError(f"dataset {dataset} is empty", kind="bad_request")
        replay_patches = replay_inputs(policy, patches, instances, server=server, llm=llm)
        box = None if server else choose_sandbox(sandbox, image)
    except RaasError as e:
        raise fail(e) from None
    sampling: dict[str, Any] = {"temperature": temperature}
    if seed is not None:
        sampling["seed"] = seed
    agent, per_instance = agent_settings(
        instances,
        {"max_turns": max_turns, "max_tokens_per_turn": max_tokens, "context_budget": context_budget},
    )
    if server:
        # A running service keeps its own agent settings unless the job overrides them.
        sampling.update(agent)
    try:
        summary = _run_main(
            run_dataset(
                instances,
                n_samples=n_samples,
                server=server,
                llm=list(llm or []),
                out=output,
                sandbox=box,
                agent=agent,
                sampling=sampling,
                job_timeout_s=timeout,
                workers=(init_workers, run_workers, eval_workers),
                tokenizer_dir=tokenizer,
                llm_context=max(
                    2048, agent["context_budget"], *(e.get("context_budget", 0) for e in per_instance)
                ),
                token=os.environ.get("RAAS_API_TOKEN"),
                per_instance=per_instance,
                replay_patches=replay_patches,
            )
        )
    except RaasError as e:
        raise fail(e) from None
    report(summary, as_json)
    if not summary["status"].get("completed"):
        raise typer.Exit(1)
