"""``raas status``: queue depth per stage and the inference servers of a running service."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from raas.cli.common import DEFAULT_SERVER, fail
from raas.errors import RaasError


def status(
    server: Annotated[str, typer.Option(help="raas service URL")] = DEFAULT_SERVER,
    as_json: Annotated[bool, typer.Option("--json", help="Print raw JSON")] = False,
) -> None:
    """Queue depth and activity per stage, and the inference servers, of a running service (a service
    started with RAAS_API_TOKEN needs the same token in this command's environment)."""
    from raas.trainer.client import RaasClient

    async def fetch() -> tuple[dict[str, Any], Any]:
        async with RaasClient(server, token=os.environ.get("RAAS_API_TOKEN"), timeout_s=10.0) as c:
            return await c.status(), await c.servers()

    try:
        st, servers = asyncio.run(fetch())
    except RaasError as e:
        raise fail(e) from None
    if as_json:
        print(json.dumps({"status": st, "servers": servers}))
        return
    out = Console()
    stages = st.get("stages") if isinstance(st, dict) else None
    if isinstance(stages, dict):
        t = Table(title=f"raas at {server}")
        t.add_column("stage")
        cols = sorted({k for v in stages.values() if isinstance(v, dict) for k in v})
        for c in cols:
            t.add_column(c, justify="right")
        for name, v in stages.items():
            t.add_row(name, *(str(v.get(c, "")) if isinstance(v, dict) else "" for c in cols))
        out.print(t)
    if isinstance(st, dict):
        skip = ("stages", "llm_servers")
        out.print_json(json.dumps({k: v for k, v in st.items() if k not in skip}, default=str))
    rows = servers.get("servers") if isinstance(servers, dict) else servers
    if isinstance(rows, list) and rows:
        t = Table(title="inference servers")
        for c in ("address", "kind", "weight_version", "healthy", "in_flight", "requests", "failures"):
            t.add_column(c)
        for r in rows:
            t.add_row(
                *(
                    str(r.get(c, ""))
                    for c in (
                        "address",
                        "kind",
                        "weight_version",
                        "healthy",
                        "in_flight",
                        "requests",
                        "failures",
                    )
                )
            )
        out.print(t)
    else:
        out.print("no inference servers registered")
