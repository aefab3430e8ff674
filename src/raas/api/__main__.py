"""``python -m raas.api``: run the service under uvicorn (what ``raas serve`` does, without the CLI layer)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from raas.api.app import serve
from raas.errors import RaasError
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m raas.api", description="Serve raas over HTTP.")
    p.add_argument("--config", type=Path, help="JSON or TOML ServiceConfig file")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--state-dir", type=Path)
    p.add_argument("--ledger", type=Path, dest="ledger_path")
    p.add_argument("--llm", action="append", dest="llm_servers", help="inference server URL (repeatable)")
    p.add_argument("--tokenizer-dir", type=Path)
    p.add_argument("--init-workers", type=int)
    p.add_argument("--run-workers", type=int)
    p.add_argument("--eval-workers", type=int)
    p.add_argument("--max-pending", type=int)
    p.add_argument("--timeout", type=float, dest="default_timeout_s")
    p.add_argument("--shutdown-grace", type=float, dest="shutdown_grace_s")
    p.add_argument(
        "--handler",
        action="append",
        default=[],
        metavar="NAME=MODULE:CLASS",
        help="register an extra task handler (repeatable)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="serve a non-loopback --host without RAAS_API_TOKEN (anyone who reaches it can submit jobs)",
    )
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> ServiceConfig:
    handlers = {}
    for spec in args.handler:
        name, sep, target = spec.partition("=")
        if not sep or ":" not in target:
            raise RaasError(f"--handler wants NAME=MODULE:CLASS, got {spec!r}", kind="bad_request")
        handlers[name] = target
    keys = (
        "host",
        "port",
        "state_dir",
        "ledger_path",
        "llm_servers",
        "tokenizer_dir",
        "init_workers",
        "run_workers",
        "eval_workers",
        "max_pending",
        "default_timeout_s",
        "shutdown_grace_s",
        "insecure",
    )
    overrides = {k: getattr(args, k) for k in keys}
    if handlers:
        overrides["extra_handlers"] = handlers
    return ServiceConfig.load(args.config, **overrides)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = build_config(args)
        asyncio.run(serve(RolloutService(config), log_level=args.log_level))
    except RaasError as exc:  # a bad config or an unusable state dir: say so, no traceback
        print(f"raas: {exc.message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
