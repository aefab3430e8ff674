"""``raas cluster``: raas on a Ray cluster (``up``, ``status``, ``down``) and its front door (``router``).

Needs the ``raas[cluster]`` extra (``ray``). ``--address`` is what ``ray.init`` takes: ``auto`` (the
cluster this machine is part of), ``HOST:PORT`` of the GCS, or ``ray://HOST:10001``.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from raas.cli.common import choose_sandbox, console, fail
from raas.errors import RaasError

if TYPE_CHECKING:
    from raas.pipeline.config import ServiceConfig

cluster_app = typer.Typer(no_args_is_help=True, help="raas on a Ray cluster: one service per node, a router.")

Address = Annotated[str, typer.Option(help="Ray cluster: auto, HOST:PORT (GCS) or ray://HOST:PORT")]
NodeIp = Annotated[
    str | None, typer.Option(help="This machine's address as Ray knows it (several Ray nodes on one machine)")
]
Resource = Annotated[
    str, typer.Option(help="Custom Ray resource that selects raas nodes; its amount is the sandbox capacity")
]


def _ray_nodes() -> Any:
    try:
        from raas.cluster import ray_nodes
    except ImportError as exc:
        raise fail(
            RaasError(f"raas cluster needs Ray: pip install 'raas[cluster]' ({exc})", kind="unavailable")
        ) from None
    return ray_nodes


def _config(config: Path | None, **overrides: Any) -> ServiceConfig:
    from raas.pipeline.config import ServiceConfig

    try:
        return ServiceConfig.load(config, **overrides)
    except RaasError as e:
        raise fail(e) from None


@cluster_app.command()
def up(
    address: Address = "auto",
    node_ip: NodeIp = None,
    resource: Resource = "raas_sandbox",
    config: Annotated[Path | None, typer.Option(help="Node service config (JSON or TOML)")] = None,
    state_dir: Annotated[
        Path | None, typer.Option(help="Where each node keeps its ledger (node-local disk; one dir per node)")
    ] = None,
    port: Annotated[int | None, typer.Option(help="Port of every node service (0 = any free one)")] = None,
    sandbox: Annotated[
        str | None, typer.Option(help="Sandbox backend (local, bwrap, apptainer, ...)")
    ] = None,
    image: Annotated[str | None, typer.Option(help="Sandbox image")] = None,
    insecure: Annotated[bool, typer.Option(help="Serve node addresses without RAAS_API_TOKEN")] = False,
) -> None:
    """Start a raas node service on every Ray node that declares RESOURCE and has none yet."""
    ray_nodes = _ray_nodes()
    box = choose_sandbox(sandbox or "auto", image) if (sandbox or image) else None
    cfg = _config(config, state_dir=state_dir, port=port, sandbox=box, insecure=insecure or None)
    try:
        ray_nodes.connect(address, node_ip=node_ip)
        placed = ray_nodes.place(cfg, resource=resource)
    except RaasError as e:
        raise fail(e) from None
    if not placed:
        console.print(f"no alive Ray node declares the resource {resource!r}: nothing to place")
        raise typer.Exit(1)
    for p in placed:
        console.print(
            f"{'started' if p.created else 'running'}  {p.node_id[:12]}  {p.url}  capacity {p.capacity}"
        )


@cluster_app.command()
def status(
    address: Address = "auto",
    node_ip: NodeIp = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print raw JSON")] = False,
) -> None:
    """The raas nodes Ray knows of: address, capacity, liveness and load."""
    ray_nodes = _ray_nodes()
    try:
        ray_nodes.connect(address, node_ip=node_ip)
        records = ray_nodes.discover()
    except RaasError as e:
        raise fail(e) from None
    rows = []
    for r in records:
        st = r.status or {}
        stages = st.get("stages") or {}
        rows.append(
            {
                "node_id": r.node_id,
                "url": r.url,
                "host": r.host,
                "alive": r.alive,
                "capacity": r.capacity,
                "pending": st.get("pending"),
                "active": {k: v.get("active") for k, v in stages.items() if isinstance(v, dict)},
                "queued": {k: v.get("queued") for k, v in stages.items() if isinstance(v, dict)},
                "finished": st.get("finished"),
                "llm_servers": len(st.get("llm_servers") or []),
            }
        )
    if as_json:
        print(json.dumps({"nodes": rows}))
        return
    t = Table(title=f"raas nodes on Ray at {address}")
    for col in ("node", "url", "alive", "capacity", "pending", "active (init/run/eval)", "llm"):
        t.add_column(col)
    for row in rows:
        active = row["active"]
        t.add_row(
            row["node_id"][:12],
            str(row["url"]),
            "yes" if row["alive"] else "NO",
            str(row["capacity"]),
            str(row["pending"]),
            "/".join(str(active.get(s, "-")) for s in ("init", "run", "eval")),
            str(row["llm_servers"]),
        )
    Console().print(t)


@cluster_app.command()
def down(
    address: Address = "auto",
    node_ip: NodeIp = None,
    node: Annotated[str | None, typer.Option(help="Only this Ray node (id or prefix)")] = None,
    grace_s: Annotated[float, typer.Option(help="How long in-flight jobs may finish")] = 30.0,
) -> None:
    """Drain and stop raas node services (all, or one node's)."""
    ray_nodes = _ray_nodes()
    try:
        ray_nodes.connect(address, node_ip=node_ip)
        stopped = ray_nodes.remove(node, grace_s=grace_s)
    except RaasError as e:
        raise fail(e) from None
    console.print(f"stopped {len(stopped)} raas node service(s)")


@cluster_app.command()
def router(
    address: Address = "auto",
    node_ip: NodeIp = None,
    config: Annotated[
        Path | None, typer.Option(help="Router config (JSON or TOML; a service config)")
    ] = None,
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    state_dir: Annotated[Path | None, typer.Option(help="Where the router keeps its ledger")] = None,
    node_deadline_s: Annotated[
        float, typer.Option(help="A node unreachable this long is dropped and its jobs move")
    ] = 15.0,
    insecure: Annotated[
        bool, typer.Option(help="Serve a non-loopback --host without RAAS_API_TOKEN")
    ] = False,
) -> None:
    """Serve the cluster's front door (native /v1 and ProRL-compatible API) until SIGINT/SIGTERM."""
    ray_nodes = _ray_nodes()
    from raas.cluster.router import ClusterRouter, RouterSettings

    if state_dir is None and config is None:  # not the node services' default state dir
        state_dir = Path(os.environ.get("RAAS_HOME") or Path.home() / ".cache" / "raas") / "router"
    cfg = _config(config, host=host, port=port, state_dir=state_dir, insecure=insecure or None)
    source = ray_nodes.RayNodeSource(address, node_ip=node_ip)
    svc = ClusterRouter(cfg, source, RouterSettings(node_deadline_s=node_deadline_s))
    from raas.cli.serve import _stop_signals_end_cleanly

    async def run() -> None:
        from raas.api import serve

        console.print(f"raas router: starting, to serve on http://{cfg.host}:{cfg.port}")
        with _stop_signals_end_cleanly():
            await serve(svc, host=cfg.host, port=cfg.port, log_level="info")

    try:
        asyncio.run(run())
    except RaasError as e:
        raise fail(e) from None
