"""``raas serve``: the rollout API until SIGINT/SIGTERM (through :func:`raas.api.serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from raas.cli.common import choose_sandbox, console, fail
from raas.errors import RaasError

if TYPE_CHECKING:
    from raas.pipeline.config import ServiceConfig


WORKERS_HELP = "Jobs in this stage at once: a number, or auto (sized from CPUs, memory and measured load)"


def serve(
    config: Annotated[Path | None, typer.Option(help="Service config (JSON or TOML)")] = None,
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    sandbox: Annotated[
        str | None, typer.Option(help="Sandbox backend for every job (local, bwrap, ...)")
    ] = None,
    image: Annotated[str | None, typer.Option(help="Sandbox image for every job")] = None,
    llm: Annotated[list[str] | None, typer.Option(help="Inference server URL (repeatable)")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="Chat tokenizer dir of the policy model")] = None,
    init_workers: Annotated[str | None, typer.Option(help=WORKERS_HELP)] = None,
    run_workers: Annotated[str | None, typer.Option(help=WORKERS_HELP)] = None,
    eval_workers: Annotated[str | None, typer.Option(help=WORKERS_HELP)] = None,
    insecure: Annotated[
        bool,
        typer.Option(help="Serve a non-loopback --host without RAAS_API_TOKEN (anyone can submit jobs)"),
    ] = False,
) -> None:
    """Serve the rollout API until SIGINT/SIGTERM, then shut down gracefully."""
    from raas.pipeline.config import ServiceConfig

    try:
        box = None
        if sandbox or image:
            box = choose_sandbox(sandbox or "auto", image)
        cfg = ServiceConfig.load(
            config,
            host=host,
            port=port,
            sandbox=box,
            llm_servers=llm or None,
            tokenizer_dir=tokenizer,
            init_workers=init_workers,
            run_workers=run_workers,
            eval_workers=eval_workers,
            insecure=insecure or None,
        )
        if cfg.tokenizer_dir is None:
            from raas.llm.models import default_tokenizer_dir

            cfg = cfg.model_copy(update={"tokenizer_dir": default_tokenizer_dir()})
    except RaasError as e:
        raise fail(e) from None
    try:
        asyncio.run(_serve(cfg))
    except RaasError as e:
        raise fail(e) from None


async def _serve(cfg: ServiceConfig) -> None:
    """Serve until SIGINT/SIGTERM, then drain: :func:`raas.api.serve` stops uvicorn (ending event streams
    at once) and the app's lifespan shuts the service down."""
    from raas.api import serve
    from raas.pipeline.service import RolloutService

    service = RolloutService(cfg)
    console.print(f"raas: starting, to serve on http://{cfg.host}:{cfg.port}")
    try:
        with _stop_signals_end_cleanly():
            await serve(service, host=cfg.host, port=cfg.port, log_level="info")
    except SystemExit as exc:  # uvicorn exits when it cannot bind or the service cannot start
        raise RaasError(
            f"could not serve on {cfg.host}:{cfg.port} (exit {exc.code}; see the log above)",
            kind="unavailable",
        ) from None
    finally:
        await service.shutdown()  # a no-op after a normal stop; closes what a failed start left


@contextlib.contextmanager
def _stop_signals_end_cleanly() -> Iterator[None]:
    """Let a SIGINT/SIGTERM that stopped the server end ``raas serve`` with status 0.

    uvicorn handles the stop signal itself and, once it has shut down, raises it again against the
    handler that was installed before it started; with the default handlers that would kill the process
    (or raise KeyboardInterrupt) after a clean drain. A no-op handler installed here absorbs it."""
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda _sig, _frame: None) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
