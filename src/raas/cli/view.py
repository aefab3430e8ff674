"""``raas view results.jsonl``: the trajectory inspector's job list and job pages for a results file, with
no service running (for a ``raas run -o`` directory, or a file copied from a cluster)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated

import typer

from raas.cli.common import console, fail
from raas.errors import RaasError


def view(
    results: Annotated[
        Path, typer.Argument(help="A results file (one job result per line), or a run's directory")
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

    from raas.api import inspector
    from raas.api.inspector_data import FileJobs
    from raas.llm.models import prepare_tokenizer
    from raas.llm.tokenizer import ChatTokenizer

    path = results / "results.jsonl" if results.is_dir() else results
    try:
        if not path.is_file():
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
        jobs = FileJobs(path)
        tok = ChatTokenizer.from_pretrained(tokenizer or prepare_tokenizer())
    except RaasError as exc:
        raise fail(exc) from exc
    app = FastAPI(title="raas view", docs_url=None, redoc_url=None, openapi_url=None)
    decode: inspector.Decoder = tok.decode
    inspector.install(app, jobs, lambda: decode)
    console.print(f"{len(jobs.rows)} jobs from {path}: http://{host}:{port}{inspector.JOBS_PATH}")
    uvicorn.run(app, host=host, port=port, log_level="warning")
