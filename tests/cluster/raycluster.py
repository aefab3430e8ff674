"""A real multi-node Ray cluster on this machine, for tests and ``bench/cluster.py``.

Each node is its own ``ray start --block`` (head first, then ``--address``), on its own loopback address
(127.0.0.x: Ray rewrites 127.0.0.1 to the machine's external address, so the cluster uses others), with
every port chosen free, its own temp dir, one CPU and a custom resource ``raas_sandbox``. Nothing is
shared with other Ray clusters on the machine (no ``ray stop``): every process this cluster starts, Ray's
worker processes included (they start their own sessions), carries a unique tag in its environment, and
:meth:`LocalRayCluster.stop` kills exactly those, by pid.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
REPO = Path(__file__).resolve().parents[2]
TAG = "RAAS_TEST_RAY_CLUSTER"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NodeExited(RuntimeError):
    """A node's ``ray start`` ended before the node registered."""


@dataclass
class RayNode:
    ip: str
    proc: subprocess.Popen[bytes]
    log: Path


class LocalRayCluster:
    """``with LocalRayCluster([4, 4, 2]) as c:`` — one Ray node per entry (its ``raas_sandbox`` amount)."""

    def __init__(
        self, capacities: list[int], *, base_ip: int | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.capacities = capacities
        base = base_ip if base_ip is not None else 20 + (os.getpid() % 200)
        self.ips = [f"127.0.{base}.{i + 2}" for i in range(len(capacities))]
        self.tag = uuid.uuid4().hex
        self.dir = Path(tempfile.mkdtemp(prefix="rq", dir="/tmp"))  # short: AF_UNIX paths are limited
        self.gcs_port = free_port()
        self.nodes: list[RayNode] = []
        pythonpath = os.pathsep.join(
            [str(REPO / "src"), str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
        )
        self.env = {
            **os.environ,
            TAG: self.tag,
            "PYTHONPATH": pythonpath,
            "RAY_USAGE_STATS_ENABLED": "0",
            **(env or {}),
        }

    @property
    def address(self) -> str:
        return f"{self.ips[0]}:{self.gcs_port}"

    @property
    def head_ip(self) -> str:
        return self.ips[0]

    def _start_node(self, i: int) -> RayNode:
        ip = self.ips[i]
        args = [
            RAY, "start", "--block", "--node-ip-address", ip, "--num-cpus", "1",
            "--resources", f'{{"raas_sandbox": {self.capacities[i]}}}',
            "--disable-usage-stats", "--include-log-monitor", "false",
            "--object-store-memory", str(80 * 1024 * 1024),
            "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
            "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port()),
            "--min-worker-port", "0", "--max-worker-port", "0",
        ]  # fmt: skip
        if i == 0:
            args += [
                "--head", "--port", str(self.gcs_port), "--temp-dir", str(self.dir / "t"),
                "--include-dashboard", "false", "--dashboard-port", str(free_port()),
                "--ray-client-server-port", str(free_port()),
            ]  # fmt: skip
        else:
            args += ["--address", self.address]
        log = self.dir / f"node{i}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                args, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return RayNode(ip=ip, proc=proc, log=log)

    def start(self, timeout_s: float = 180.0) -> LocalRayCluster:
        """Bring the nodes up one at a time (a loaded 2-core machine cannot start several raylets within
        Ray's fixed 30 s registration window); a node whose ``ray start`` gave up is started again."""
        try:
            for i in range(len(self.capacities)):
                for attempt in range(3):
                    node = self._start_node(i)
                    if len(self.nodes) > i:
                        self.nodes[i] = node
                    else:
                        self.nodes.append(node)
                    try:
                        self._wait_nodes(i + 1, timeout_s)
                        break
                    except NodeExited:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(node.proc.pid, signal.SIGKILL)  # what that attempt left running
                        if attempt == 2:
                            raise
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_nodes(self, n: int, timeout_s: float) -> None:
        """Until the GCS lists ``n`` alive nodes (this process joins the cluster as a Ray driver)."""
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.proc.poll() is not None:
                    raise NodeExited(f"ray node {node.ip} exited: {node.log.read_text()[-2000:]}")
            if not ray.is_initialized():
                with contextlib.suppress(Exception):
                    ray.init(
                        address=self.address,
                        _node_ip_address=self.head_ip,
                        namespace="raas",
                        log_to_driver=False,
                        configure_logging=False,
                    )
            if ray.is_initialized() and sum(1 for x in ray.nodes() if x["Alive"]) >= n:
                return
            time.sleep(0.3)
        raise TimeoutError(f"the Ray cluster did not reach {n} nodes in {timeout_s} s")

    def kill_node(self, i: int, extra_pids: list[int] | tuple[int, ...] = ()) -> None:
        """SIGKILL one node: its ``ray start`` process group (raylet, agents) and ``extra_pids`` (e.g. the
        raas node service's worker process)."""
        node = self.nodes[i]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.proc.pid, signal.SIGKILL)
        for pid in extra_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.proc.wait(30)

    def tagged_pids(self) -> list[int]:
        """Every live process this cluster started (by the tag in its environment)."""
        needle = f"{TAG}={self.tag}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if needle in env.split(b"\0"):
                pids.append(int(entry))
        return pids

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            with contextlib.suppress(Exception):
                ray.shutdown()
        for node in self.nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
        for _ in range(3):  # workers start their own sessions: find them by tag
            pids = self.tagged_pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
