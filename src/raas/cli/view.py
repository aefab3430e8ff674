"""``raas view results.jsonl``: the trajectory inspector's job list and job pages for a results file, with
no service running (for a ``raas run -o`` directory, or a file copied from a cluster); ``raas view
train.jsonl`` (or a ``raas train -o`` directory) the live training view, which follows the log while the run
writes it."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

import typer

from raas.cli.common import console, fail
from raas.errors import RaasError


def view(
    results: Annotated[
        Path,
        typer.Argument(
            help="A results file (one job result per line), a train.jsonl, or a run's directory (either or both)"
        ),
    ],
    host: Annotated[str, typer.Option(help="Address to serve on (loopback unless --public)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0: any free one)")] = 8090,
    tokenizer: Annotated[
        Path | None, typer.Option(help="Chat tokenizer dir of the policy (default: the embedded model's)")
    ] = None,
    public: Annotated[
        bool, typer.Option(help="Allow a non-loopback --host (the pages show every rollout)")
    ] = False,
) -> None:
    """Browse the rollouts of a results file: filter the jobs, open one, read its turns and tokens."""
    import uvicorn
    from fastapi import FastAPI

    from raas.api import inspector, train_view
    from raas.api.inspector_data import FileJobs
    from raas.llm.models import prepare_tokenizer
    from raas.llm.tokenizer import ChatTokenizer

    if results.is_dir():
        path: Path | None = results / "results.jsonl" if (results / "results.jsonl").is_file() else None
        train_log: Path | None = results / "train.jsonl"
    elif results.name == "train.jsonl":
        path, train_log = None, results
    else:
        path, train_log = results, None
    try:
        if path is not None and not path.is_file():
            raise RaasError(f"{path} is not a file", kind="bad_request")
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError as exc:
            raise RaasError(f"--host {host} is not an IP address", kind="bad_request") from exc
        if not loopback and not public:
            raise RaasError(
                f"--host {host} is not a loopback address: add --public to show these rollouts to the network",
                kind="bad_request",
            )
        jobs = FileJobs(path) if path is not None else None
        tok = ChatTokenizer.from_pretrained(tokenizer or prepare_tokenizer()) if jobs is not None else None
    except RaasError as exc:
        raise fail(exc) from exc
    app = FastAPI(title="raas view", docs_url=None, redoc_url=None, openapi_url=None)
    if jobs is not None and tok is not None:
        decode: inspector.Decoder = tok.decode
        inspector.install(app, jobs, lambda: decode)
        console.print(f"{len(jobs.rows)} jobs from {path}: http://{host}:{port}{inspector.JOBS_PATH}")
    if train_log is not None:
        train_view.install(app, train_log, jobs=jobs is not None)
        console.print(
            f"training log {train_log} (followed as it grows): http://{host}:{port}{train_view.TRAIN_PATH}"
        )
    uvicorn.run(app, host=host, port=port, log_level="warning")
