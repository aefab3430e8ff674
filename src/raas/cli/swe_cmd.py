"""``raas swe eval``: the command line over :mod:`raas.cli.swe_eval` (options, the table, JSON output)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from raas.cli.common import console, fail
from raas.cli.run import write_jsonl
from raas.cli.swe_eval import evaluate_predictions, load_predictions, single_prediction
from raas.errors import RaasError

SWE_BACKENDS = ("bwrap", "apptainer", "docker", "podman")


def _counts(rows: list[dict[str, Any]], category: str) -> str:
    tests = rows[0]["tests"].get(category) if rows else None
    if not tests:
        return "-"
    passed, failed = len(tests["passed"]), len(tests["failed"])
    return f"{passed}/{passed + failed}"


def results_table(rows: list[dict[str, Any]]) -> Table:
    """One line per graded prediction: the verdict, the test counts, the failing tests or the error."""
    t = Table(title="raas swe eval")
    for col in (
        "instance",
        "model",
        "outcome",
        "resolved",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "failing / error",
    ):
        t.add_column(col, overflow="fold")
    for r in rows:
        err = r.get("error")
        if err:
            verdict, resolved = f"[red]{err['kind']}[/red]", "-"
            why = f"{err['stage']}: {err['message']}"
        else:
            verdict = str(r.get("outcome"))
            resolved = "[green]yes[/green]" if r.get("resolved") else "no"
            failing = r.get("failing_tests") or []
            why = ", ".join(failing[:5]) + (f" (+{len(failing) - 5} more)" if len(failing) > 5 else "")
        t.add_row(
            str(r.get("instance_id")),
            str(r.get("model_name_or_path") or ""),
            verdict,
            resolved,
            _counts([r], "FAIL_TO_PASS"),
            _counts([r], "PASS_TO_PASS"),
            why,
        )
    return t


def summary_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    graded = [r for r in rows if not r.get("error")]
    return {
        "predictions": len(rows),
        "graded": len(graded),
        "resolved": sum(1 for r in graded if r.get("resolved")),
        "errors": len(rows) - len(graded),
    }


def swe_eval(
    dataset: Annotated[
        str, typer.Argument(help="SWE records: a .jsonl/.json file (SWE-bench, SWE-Gym, R2E-Gym)")
    ],
    predictions: Annotated[
        Path | None,
        typer.Option(
            "--predictions",
            "-p",
            help="SWE-bench predictions (.jsonl/.json of instance_id, model_patch, ...)",
        ),
    ] = None,
    patch: Annotated[Path | None, typer.Option(help="One patch file (with --instance)")] = None,
    instance: Annotated[str | None, typer.Option(help="The instance_id --patch is for")] = None,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="Write the graded results here (JSONL)")
    ] = Path("swe-eval.jsonl"),
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, help="Predictions graded at once")] = 2,
    sandbox: Annotated[str, typer.Option(help=f"Sandbox backend: {', '.join(SWE_BACKENDS)}")] = "bwrap",
    as_json: Annotated[
        bool,
        typer.Option("--json", help="Print only JSON on stdout (summary and rows; the table goes to stderr)"),
    ] = False,
) -> None:
    """Grade patches against SWE records with the SWE task's own EVAL (fresh sandbox from each record's
    image, apply the patch, run the hidden tests, SWE-bench's grading): resolved, FAIL_TO_PASS /
    PASS_TO_PASS outcomes and failing test names. Exit 0 when every prediction was graded."""
    try:
        if sandbox not in SWE_BACKENDS:
            raise RaasError(f"--sandbox must be one of {', '.join(SWE_BACKENDS)}", kind="bad_request")
        if (predictions is None) == (patch is None):
            raise RaasError(
                "give either --predictions FILE or --patch FILE --instance ID", kind="bad_request"
            )
        if patch is not None and not instance:
            raise RaasError("--patch needs --instance ID (the record it is for)", kind="bad_request")
        if predictions is not None:
            preds = load_predictions(predictions)
        else:
            assert patch is not None and instance  # checked above
            preds = [single_prediction(patch, instance)]
        if not preds:
            raise RaasError(f"{predictions} holds no predictions", kind="bad_request")
    except RaasError as e:
        raise fail(e) from None
    progress = Progress(
        TextColumn("[bold]grading"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )
    task = progress.add_task("", total=len(preds))
    try:
        with progress:
            rows = asyncio.run(
                evaluate_predictions(
                    dataset,
                    preds,
                    sandbox={"backend": sandbox},
                    jobs=jobs,
                    on_done=lambda _row: progress.advance(task),
                )
            )
    except RaasError as e:
        raise fail(e) from None
    write_jsonl(output, rows)
    summary = summary_of(rows)
    out = console if as_json else Console()
    out.print(results_table(rows))
    out.print(
        f"{summary['resolved']} of {summary['graded']} graded resolved; {summary['errors']} errors; "
        f"results in {output}"
    )
    if as_json:
        print(json.dumps({**summary, "output": str(output), "results": rows}), flush=True)
    if summary["errors"]:
        raise typer.Exit(1)
