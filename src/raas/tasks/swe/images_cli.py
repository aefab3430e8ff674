"""``raas images pull DATASET``: convert every image a dataset needs into the image cache, before jobs run.

Why: converting a SWE-bench image (``docker://``, a SIF) takes minutes; done inside INIT it would count
against the first job's budget of each image. Pulling first does each image once, a bounded number at a
time, with a progress bar.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from raas.errors import RaasError

images_app = typer.Typer(no_args_is_help=True, add_completion=False, help="Task images of datasets.")


@images_app.callback()
def _group() -> None:
    """Images of a dataset's tasks (SWE-bench naming, SIF, docker://, docker-archive:, rootfs dirs)."""


@images_app.command("pull")
def pull(
    dataset: Annotated[str, typer.Argument(help="A .jsonl/.json/.parquet dataset")],
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, help="Conversions at once")] = 2,
    image_template: Annotated[
        str | None, typer.Option(help="Image of SWE records without one (default: the SWE handler's config)")
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N rows")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON on stdout")] = False,
) -> None:
    """Convert (once, into RAAS_IMAGE_CACHE) every image the dataset's rows need."""
    from raas.tasks.datasets import load_dataset

    from .config import load_config
    from .images import PullResult, dataset_references, pull_images

    console = Console(stderr=True)
    try:
        rows = load_dataset(dataset)[:limit]
        refs = dataset_references(rows, image_template or load_config().image_template)
    except RaasError as e:
        console.print(f"[red]error[/red] ({e.kind}): {e.message}")
        raise typer.Exit(2 if e.kind == "bad_request" else 1) from None
    progress = Progress(
        TextColumn("[bold]images"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
    )
    task = progress.add_task("", total=len(refs))

    def done(res: PullResult) -> None:
        progress.update(task, advance=1, description=res.reference[-60:])

    with progress:
        results = asyncio.run(pull_images(refs, jobs=jobs, on_done=done))
    table = Table("image", "state", "s")
    for r in results:
        state = f"[red]failed[/red]: {r.error}" if r.error else ("cached" if r.cached else "converted")
        table.add_row(r.reference, state, f"{r.seconds:.1f}")
    console.print(table)
    failed = [r for r in results if r.error]
    console.print(f"{len(results) - len(failed)} of {len(results)} images ready ({len(rows)} rows)")
    if as_json:
        print(json.dumps([r.__dict__ for r in results]))
    if failed:
        raise typer.Exit(1)
