"""``raas swe``: build SWE-style task instances offline (a typer sub-app; ``raas.cli`` mounts it)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from raas.errors import RaasError

from .build import BuildOptions, PackageReport, build
from .mini.build import MiniReport
from .mutate import MUTATORS
from .packages import DEFAULT_PACKAGES, PACKAGES
from .records import write_jsonl

app = typer.Typer(no_args_is_help=True, add_completion=False, help="SWE-style tasks from real packages.")


@app.callback()
def _group() -> None:
    """SWE-style tasks built offline from real packages and their own test suites."""


def _split(values: list[str] | None, default: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out += [p.strip() for p in v.split(",") if p.strip()]
    return out or list(default)


@app.command("build")
def build_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="Write the records here (JSONL)")] = Path(
        "swe.jsonl"
    ),
    packages: Annotated[
        list[str] | None,
        typer.Option("--packages", "-p", help=f"Comma-separated or repeated; known: {', '.join(PACKAGES)}"),
    ] = None,
    per_package: Annotated[int, typer.Option("--per-package", "-n", min=1, help="Instances per package")] = 3,
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, help="Sandbox test runs at once")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the candidate order")] = 0,
    max_failing: Annotated[int, typer.Option(min=1, help="Most tests a kept bug may break")] = 20,
    max_candidates: Annotated[
        int | None, typer.Option(min=1, help="Candidate bugs tried per package (default 15 x per-package)")
    ] = None,
    mutators: Annotated[
        list[str] | None, typer.Option("--mutators", help=f"Subset of: {', '.join(MUTATORS)}")
    ] = None,
    backend: Annotated[str, typer.Option(help="Sandbox backend for the test runs")] = "bwrap",
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Rebuild even if a cached result exists")
    ] = False,
    report: Annotated[Path | None, typer.Option(help="Also write the per-package report as JSON")] = None,
) -> None:
    """Build instances: real sdists, injected bugs validated against their own test suites, SWE-bench-shaped
    JSONL plus one sandbox image per instance (in RAAS_IMAGE_CACHE; building images needs root)."""
    console = Console(stderr=True)
    opts = BuildOptions(
        packages=_split(packages, DEFAULT_PACKAGES),
        per_package=per_package,
        seed=seed,
        jobs=jobs,
        backend=backend,
        max_failing=max_failing,
        max_candidates=max_candidates,
        mutators=_split(mutators, tuple(MUTATORS)),
        use_cache=not no_cache,
    )
    progress = Progress(
        TextColumn("{task.fields[package]:<16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stage]}"),
        TimeElapsedColumn(),
        console=console,
    )
    tasks: dict[str, TaskID] = {
        p: progress.add_task(p, total=per_package, package=p, stage="waiting") for p in opts.packages
    }

    def on_event(package: str, event: str, rep: PackageReport) -> None:
        stage = event
        if event == "candidate":
            stage = f"tried {rep.tried} of {rep.candidates} candidates"
        elif event in ("done", "cached"):
            stage = f"{event}: {rep.accepted} kept of {rep.tried} tried"
        progress.update(tasks[package], completed=rep.accepted, stage=stage)

    t0 = time.monotonic()
    try:
        with progress:
            records, reports = asyncio.run(build(opts, on_event))
    except RaasError as e:
        console.print(f"[red]error[/red] ({e.kind}): {e.message}")
        raise typer.Exit(2 if e.kind == "bad_request" else 1) from None
    n = write_jsonl(records, out)
    table = Table("package", "version", "tests", "baseline s", "tried", "kept", "rejected", "s")
    for r in reports:
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(r.rejected.items()))
        table.add_row(
            r.package,
            r.version,
            str(r.tests),
            str(r.baseline_s),
            str(r.tried),
            str(r.accepted),
            rejected,
            "cached" if r.cached else str(r.seconds),
        )
    console.print(table)
    console.print(f"{n} instances in {out} ({time.monotonic() - t0:.1f} s)")
    if report is not None:
        report.write_text(json.dumps([r.__dict__ for r in reports], indent=1))


@app.command("mini")
def mini_cmd(
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory for train.jsonl and test.jsonl")] = Path(
        "swe-mini"
    ),
    levels: Annotated[
        list[str] | None,
        typer.Option("--levels", help="Comma-separated or repeated: function, module, report"),
    ] = None,
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, help="Sandbox test runs at once")] = 2,
    seed: Annotated[int, typer.Option(help="Seed of the candidate order")] = 0,
    backend: Annotated[str, typer.Option(help="Sandbox backend for the test runs")] = "bwrap",
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Rebuild even if a cached result exists")
    ] = False,
) -> None:
    """Build the swe-mini bug-fix curriculum (the corpus's small modules, single-site bugs, validated
    SWE-bench-format records with one image each) and write its train and held-out splits. What
    ``builtin:swe-mini:train`` / ``:test`` load (they build it on first use). Building needs root."""
    from .mini.build import LEVELS, MiniOptions, build_mini, split_records

    console = Console(stderr=True)
    chosen = tuple(_split(levels, LEVELS))
    opts = MiniOptions(levels=chosen, jobs=jobs, seed=seed, backend=backend, use_cache=not no_cache)  # type: ignore[arg-type]
    progress = Progress(
        TextColumn("swe-mini"), TextColumn("{task.fields[stage]}"), TimeElapsedColumn(), console=console
    )
    task = progress.add_task("", stage="starting")
    last_line = [0.0]

    def on_event(rep: MiniReport) -> None:
        rejected = sum(rep.rejected.values())
        stage = f"{rep.accepted} kept, {rejected} rejected of {rep.tried} bugs tried"
        progress.update(task, stage=stage)
        if (
            not console.is_terminal and time.monotonic() - last_line[0] >= 10
        ):  # a log file: a line now and then
            last_line[0] = time.monotonic()
            console.print(f"swe-mini {time.monotonic() - t0:.0f} s: {stage}")

    t0 = time.monotonic()
    try:
        with progress:
            records, rep = asyncio.run(build_mini(opts, on_event))
    except RaasError as e:
        console.print(f"[red]error[/red] ({e.kind}): {e.message}")
        raise typer.Exit(2 if e.kind == "bad_request" else 1) from None
    out.mkdir(parents=True, exist_ok=True)
    table = Table("split", *chosen, "all")
    for split in ("train", "test"):
        rows = split_records(records, split, chosen)
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        counts = [sum(1 for r in rows if r["level"] == lv) for lv in chosen]
        table.add_row(split, *map(str, counts), str(len(rows)))
    console.print(table)
    rejected = ", ".join(f"{k} {v}" for k, v in sorted(rep.rejected.items()))
    console.print(
        f"{len(records)} instances in {out}/ ({'cached' if rep.cached else f'{time.monotonic() - t0:.0f} s'}; "
        f"rejected: {rejected or 'none'})"
    )
