"""The Ray side of ``raas cluster``: one raas node service per selected Ray node.

Why Ray: the trainers raas serves already run on it, and on HPC it is started inside the SLURM job, so
the cluster's membership (which nodes exist, which died) comes from Ray's GCS rather than from a registry
of raas's own. A node is *selected* by a custom resource (default ``raas_sandbox``, e.g. ``ray start
--resources '{"raas_sandbox": 16}'``); its amount is the node's sandbox capacity, and the node service
reserves all of it, so Ray's own accounting shows what raas holds.

Each node service is a named, detached actor (``raas-node-<node id>`` in the ``raas`` namespace) pinned to
its node with a hard :class:`~ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy`; it runs the
normal :class:`~raas.pipeline.service.RolloutService` (its own ledger, sandboxes, pools) and serves it on
the node's address. It is never restarted elsewhere (``max_restarts=0``): a service belongs to its node,
and when the node goes the router moves its unfinished jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raas.cluster.nodes import NodeRecord
from raas.errors import RaasError
from raas.pipeline.config import ServiceConfig

log = logging.getLogger("raas.cluster")

NAMESPACE = "raas"
ACTOR_PREFIX = "raas-node-"
DEFAULT_RESOURCE = "raas_sandbox"


def actor_name(node_id: str) -> str:
    return f"{ACTOR_PREFIX}{node_id}"


def connect(address: str = "auto", *, node_ip: str | None = None) -> None:
    """Join the Ray cluster at ``address`` (``auto``, ``HOST:PORT`` or ``ray://...``) in raas's namespace.

    ``node_ip`` is this machine's address as Ray knows it; needed only where Ray cannot tell (several Ray
    nodes on one machine, as in tests)."""
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False, "configure_logging": False}
    if node_ip and not address.startswith("ray://"):
        kwargs["_node_ip_address"] = node_ip
    try:
        ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RaasError(
            f"cannot connect to the Ray cluster at {address!r}: {exc}", kind="unavailable"
        ) from exc


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=64)  # type: ignore[call-overload]
class NodeService:
    """A raas service on one Ray node (an async actor: the service and its HTTP server run on the actor's
    event loop). ``start`` returns once it listens; killing the actor's process ends the service and, by
    the tool servers' parent-death watch, its sandboxes."""

    def __init__(self, config: dict[str, Any], node_id: str, capacity: int) -> None:
        self._config = ServiceConfig.model_validate(config)
        self._node_id = node_id
        self._capacity = capacity
        self._url: str | None = None
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._service: Any = None

    async def start(self) -> dict[str, Any]:
        if self._url is not None:
            return await self.info()
        from raas.api import served
        from raas.pipeline.service import RolloutService

        ip = ray.util.get_node_ip_address()
        cfg = self._config
        service = RolloutService(cfg)
        self._service = service
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                async with served(service, host=ip, port=cfg.port, log_level="warning") as url:
                    ready.set_result(url)
                    await self._stop.wait()
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                raise

        self._task = asyncio.create_task(run(), name="raas-node-service")
        self._url = await ready
        log.info("raas node service for Ray node %s at %s", self._node_id, self._url)
        return await self.info()

    async def info(self) -> dict[str, Any]:
        status: dict[str, Any] = {}
        if self._service is not None:
            with contextlib.suppress(Exception):
                status = self._service.status()
        return {
            "node_id": self._node_id,
            "url": self._url,
            "host": ray.util.get_node_ip_address(),
            "capacity": self._capacity,
            "pid": os.getpid(),
            "status": status,
        }

    async def stop(self) -> bool:
        """Shut the service down (graceful: in-flight jobs get ``shutdown_grace_s``)."""
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await self._task
        return True


@dataclass
class Placement:
    node_id: str
    host: str
    capacity: int
    url: str | None
    created: bool


def selected_nodes(resource: str = DEFAULT_RESOURCE) -> list[dict[str, Any]]:
    """Alive Ray nodes that declare ``resource`` (> 0), in a stable order."""
    nodes = [n for n in ray.nodes() if n.get("Alive") and float(n.get("Resources", {}).get(resource, 0)) >= 1]
    return sorted(nodes, key=lambda n: n["NodeID"])


def node_config(base: ServiceConfig, node_id: str, capacity: int) -> dict[str, Any]:
    """A node's service config: its own state dir under the base one (node-local disk on a cluster), and
    ``run_workers`` = the node's sandbox capacity."""
    state_dir = Path(base.state_dir) / f"node-{node_id[:16]}"
    return base.model_copy(
        update={"state_dir": state_dir, "ledger_path": None, "run_workers": capacity}
    ).model_dump(mode="json")


def place(
    base: ServiceConfig, *, resource: str = DEFAULT_RESOURCE, start_timeout_s: float = 120.0
) -> list[Placement]:
    """Start a node service on every selected Ray node that has none (re-running adds new nodes only).
    Blocking (call it from a thread in async code)."""
    placed: list[Placement] = []
    pending: list[tuple[dict[str, Any], Any, bool]] = []
    for node in selected_nodes(resource):
        node_id = node["NodeID"]
        capacity = int(float(node["Resources"][resource]))
        existing = _existing(node_id)
        if existing is not None:
            pending.append((node, existing, False))
            continue
        actor = NodeService.options(  # type: ignore[attr-defined]
            name=actor_name(node_id),
            namespace=NAMESPACE,
            lifetime="detached",
            resources={resource: capacity},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(node_config(base, node_id, capacity), node_id, capacity)
        pending.append((node, actor, True))
    for node, actor, created in pending:
        try:
            info = ray.get(actor.start.remote(), timeout=start_timeout_s)
        except ray.exceptions.RayError as exc:  # a node that died after Ray last listed it alive
            log.warning("no raas node service on Ray node %s: %s", node["NodeID"][:12], exc)
            continue
        placed.append(
            Placement(
                node_id=node["NodeID"],
                host=info["host"],
                capacity=info["capacity"],
                url=info["url"],
                created=created,
            )
        )
    return placed


def _existing(node_id: str) -> Any | None:
    try:
        return ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
    except ValueError:
        return None


def remove(node_id: str | None = None, *, grace_s: float = 30.0) -> list[str]:
    """Drain and stop the node service of one node (``node_id``) or of all; returns the node ids stopped."""
    stopped: list[str] = []
    for name in ray.util.list_named_actors():
        if not name.startswith(ACTOR_PREFIX):
            continue
        nid = name[len(ACTOR_PREFIX) :]
        if node_id is not None and not nid.startswith(node_id):
            continue
        actor = _existing(nid)
        if actor is None:
            continue
        with contextlib.suppress(Exception):
            ray.get(actor.stop.remote(), timeout=grace_s + 30.0)
        ray.kill(actor, no_restart=True)
        stopped.append(nid)
    return stopped


def discover(*, call_timeout_s: float = 5.0) -> list[NodeRecord]:
    """Every raas node service Ray knows of, with its state: ``alive`` is false when its Ray node is dead
    or its actor does not answer (dead actor) within ``call_timeout_s``. Blocking."""
    alive_nodes = {n["NodeID"]: bool(n.get("Alive")) for n in ray.nodes()}
    names = [n for n in ray.util.list_named_actors() if n.startswith(ACTOR_PREFIX)]
    handles: list[tuple[str, Any]] = []
    for name in names:
        nid = name[len(ACTOR_PREFIX) :]
        actor = _existing(nid)
        if actor is not None:
            handles.append((nid, actor))
    refs = [actor.info.remote() for _, actor in handles]
    # All asked at once: one hung node costs one timeout, not one per node.
    answered = set(ray.wait(refs, num_returns=len(refs), timeout=call_timeout_s)[0]) if refs else set()
    records: list[NodeRecord] = []
    for (nid, _), ref in zip(handles, refs, strict=True):
        try:
            if ref not in answered:
                raise TimeoutError(f"no answer in {call_timeout_s:g} s")
            info = ray.get(ref, timeout=call_timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.info("raas node %s does not answer through Ray: %s", nid[:12], type(exc).__name__)
            records.append(NodeRecord(node_id=nid, url=None, host=None, capacity=0, alive=False))
            continue
        records.append(
            NodeRecord(
                node_id=nid,
                url=info.get("url"),
                host=info.get("host"),
                capacity=int(info.get("capacity") or 0),
                alive=alive_nodes.get(nid, False) and info.get("url") is not None,
                pid=info.get("pid"),
                status=info.get("status") or {},
            )
        )
    return records


class RayNodeSource:
    """The router's node list, from Ray: every call asks the GCS and the node actors afresh."""

    def __init__(self, address: str = "auto", *, node_ip: str | None = None) -> None:
        self.address = address
        self.node_ip = node_ip

    async def start(self) -> None:
        await asyncio.to_thread(connect, self.address, node_ip=self.node_ip)

    async def snapshot(self) -> list[NodeRecord]:
        return await asyncio.to_thread(discover)

    async def close(self) -> None:
        return None


def placement_dicts(placed: list[Placement]) -> list[dict[str, Any]]:
    return [asdict(p) for p in placed]
