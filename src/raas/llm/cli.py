"""``raas llm ...`` and ``raas tokenizer ...`` commands."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from raas.errors import RaasError

llm_app = typer.Typer(no_args_is_help=True)
tokenizer_app = typer.Typer(no_args_is_help=True)


def _fail(exc: RaasError) -> None:
    typer.echo(f"error ({exc.kind}): {exc.message}", err=True)
    raise typer.Exit(2)


@llm_app.command("serve")
def serve(
    port: Annotated[int | None, typer.Option(help="Port (default: a free one)")] = None,
    host: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
    parallel: Annotated[int, typer.Option("--parallel", "-np", help="Request slots")] = 8,
    ctx_per_slot: Annotated[int, typer.Option(help="Context tokens per slot")] = 2048,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads", "-t", help="CPU threads (default: $RAAS_LLAMA_THREADS, else 2 but at most cores - 1)"
        ),
    ] = None,
    model: Annotated[
        Path | None, typer.Option(help="GGUF file (default: embedded SmolLM2-135M-Instruct)")
    ] = None,
) -> None:
    """Run the embedded llama.cpp server in the foreground; prints its URL once /health is ok."""
    from raas.llm.embedded import EmbeddedServer

    server = EmbeddedServer(
        model, port=port, host=host, parallel=parallel, ctx_per_slot=ctx_per_slot, threads=threads
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, stop.set)
        try:
            await server.start()
            print(server.url, flush=True)
            while not stop.is_set() and server.running:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
            if not server.running and not stop.is_set():
                typer.echo(f"llama-server exited: {server.log_tail()}", err=True)
                raise typer.Exit(1)
        finally:
            await server.stop()

    try:
        asyncio.run(main())
    except RaasError as exc:
        _fail(exc)


@llm_app.command("prepare")
def prepare(
    source: Annotated[
        Path | None, typer.Argument(help="GGUF file or HF model dir (default: embedded model)")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="Output tokenizer dir")] = None,
    force: Annotated[bool, typer.Option(help="Rebuild even if present")] = False,
) -> None:
    """Convert a model's tokenizer + chat template into a cached dir that loads without torch."""
    from raas.llm.models import prepare_tokenizer

    try:
        path = prepare_tokenizer(source, out, force=force)
    except RaasError as exc:
        _fail(exc)
        return
    typer.echo(str(path))


@tokenizer_app.command("check")
def check(
    path: Annotated[Path, typer.Argument(help="Tokenizer dir (tokenizer.json + chat template)")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the full report as JSON")] = False,
    strip_stop: Annotated[bool, typer.Option(help="Simulate a server that strips the stop token")] = False,
) -> None:
    """Report whether append-only templating equals a full re-render; exit 1 where it drifts."""
    from raas.llm.template_check import check_template
    from raas.llm.tokenizer import ChatTokenizer

    try:
        tok = ChatTokenizer.from_pretrained(path)
        report = check_template(tok, server_returns_stop_token=not strip_stop)
    except RaasError as exc:
        _fail(exc)
        return
    typer.echo(report.to_json() if as_json else report.summary())
    sys.stdout.flush()
    raise typer.Exit(0 if report.ok else 1)


__all__ = ["llm_app", "tokenizer_app"]
