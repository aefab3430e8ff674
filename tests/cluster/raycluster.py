"""A real multi-node Ray cluster on this machine, for tests and ``bench/cluster.py``.

Each node is its own ``ray start --block`` (head first, then ``--address``), on its own loopback address
(127.0.0.x: Ray rewrites 127.0.0.1 to the machine's external address, so the cluster uses others), with
its own temp dir, one CPU and a custom resource ``raas_sandbox``. The head's GCS picks its own port
(``--port 0``; the address is read from the file Ray writes): a port chosen in advance can be taken
before the GCS binds it, and Ray then neither starts nor gives up for many minutes. Nothing is
shared with other Ray clusters on the machine (no ``ray stop``): every process this cluster starts, Ray's
worker processes included (they start their own sessions), carries a unique tag in its environment, and
:meth:`LocalRayCluster.stop` kills exactly those, by pid.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
REPO = Path(__file__).resolve().parents[2]
TAG = "RAAS_TEST_RAY_CLUSTER"


def free_port(host: str = "") -> int:
    """A port nothing listens on, on any address (the default) or on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NodeExited(RuntimeError):
    """A node's ``ray start`` ended before the node registered."""


class ClusterStartError(RuntimeError):
    """The cluster did not come up in time; the message carries the nodes' logs."""


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of a block (this process only)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _ray_log_summary(path: Path, n: int) -> str:
    """A Ray C++ log's fatal and error lines (as Ray itself reports them), then its end."""
    text = _tail(path, 1_000_000)
    errors = [line for line in text.splitlines() if " C " in line or " E " in line][-10:]
    return ("errors:\n" + "\n".join(errors) + "\nend:\n" if errors else "") + text[-n:]


def _tail(path: Path, n: int) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as exc:
        return f"({exc})"


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
        self.gcs_port = 0  # known once the head is up
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
                "--head", "--port", "0", "--temp-dir", str(self.dir / "t"),
                "--include-dashboard", "false", "--dashboard-port", str(free_port()),
            ]  # fmt: skip
            if importlib.util.find_spec("grpc") is not None:
                # Ray starts its client server (fixed port 10001 unless told) only where ray[client] is
                # installed; asking for one without it makes `ray start` exit at once.
                args += ["--ray-client-server-port", str(free_port())]
        else:
            args += ["--address", self.address]
        log = self.dir / f"node{i}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                args, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return RayNode(ip=ip, proc=proc, log=log)

    def start(self, timeout_s: float = 240.0, attempts: int = 3) -> LocalRayCluster:
        """Bring the nodes up one at a time (a loaded 2-core machine cannot start several raylets within
        Ray's fixed 30 s registration window); a node whose ``ray start`` gave up is started again, up to
        ``attempts`` times in all.

        Every wait is bounded by ``timeout_s`` for the whole cluster: on failure this raises
        :class:`ClusterStartError` with each node's ``ray start`` output and the head's GCS and raylet
        logs, so a failure explains itself instead of hanging until the test's own time limit."""
        deadline = time.monotonic() + timeout_s
        try:
            for i in range(len(self.capacities)):
                for attempt in range(attempts):
                    node = self._start_node(i)
                    if len(self.nodes) > i:
                        self.nodes[i] = node
                    else:
                        self.nodes.append(node)
                    try:
                        self._wait_nodes(i + 1, deadline)
                        break
                    except NodeExited as exc:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(node.proc.pid, signal.SIGKILL)  # what that attempt left running
                        node.proc.wait(10)
                        if i == 0:  # nothing else runs yet: clear the way for a new head, new GCS port
                            self._kill_tagged()
                            (self.dir / "t" / "ray_current_cluster").unlink(missing_ok=True)
                            self.gcs_port = 0
                        if attempt == attempts - 1 or time.monotonic() >= deadline:
                            raise ClusterStartError(
                                f"{exc} (attempt {attempt + 1})\n{self.diagnostics()}"
                            ) from exc
        except ClusterStartError:
            self.stop()
            raise
        except BaseException as exc:
            report = self.diagnostics()
            self.stop()
            if isinstance(exc, Exception):
                raise ClusterStartError(f"{type(exc).__name__}: {exc}\n{report}") from exc
            raise
        return self

    def _check_alive(self) -> None:
        for node in self.nodes:
            code = node.proc.poll()
            if code is not None:
                raise NodeExited(f"`ray start` of node {node.ip} exited with status {code}")

    def _gcs_answers(self) -> bool:
        """Whether the head's GCS accepts connections (first reading its port from the address file
        ``ray start --head`` writes once the head is up)."""
        if not self.gcs_port:
            with contextlib.suppress(OSError, ValueError):
                host, _, port = (self.dir / "t" / "ray_current_cluster").read_text().strip().rpartition(":")
                if host == self.head_ip:
                    self.gcs_port = int(port)
        if not self.gcs_port:
            return False
        with contextlib.suppress(OSError), socket.create_connection((self.head_ip, self.gcs_port), timeout=1):
            return True
        return False

    def _wait_nodes(self, n: int, deadline: float) -> None:
        """Until the GCS lists ``n`` alive nodes (this process joins the cluster as a Ray driver, once the
        GCS accepts connections: ``ray.init`` itself retries for many minutes against a GCS that is not
        there, so it is only called against one that is, with its retries cut to one)."""
        import ray

        while time.monotonic() < deadline:
            self._check_alive()
            if not ray.is_initialized() and self._gcs_answers():
                with contextlib.suppress(Exception), _env(RAY_gcs_server_port_wait_time_s="1"):
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
        self._check_alive()
        state = "accepts connections" if self._gcs_answers() else "does not accept connections"
        raise TimeoutError(
            f"the Ray cluster did not reach {n} alive nodes in time (the GCS at {self.address} {state}, "
            f"this process {'is' if ray.is_initialized() else 'is not'} connected as a driver)"
        )

    def diagnostics(self, tail: int = 3000) -> str:
        """Each node's ``ray start`` output and the tails of the head session's GCS and raylet logs."""
        parts = []
        for i, node in enumerate(self.nodes):
            code = node.proc.poll()
            parts.append(
                f"--- node {i} ({node.ip}, `ray start` {'running' if code is None else f'exited {code}'}):\n"
                + _tail(node.log, tail)
            )
        logs = self.dir / "t" / "session_latest" / "logs"
        for name in ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err"):
            if (logs / name).exists():
                parts.append(f"--- head {name}:\n" + _ray_log_summary(logs / name, tail))
        if not logs.is_dir():
            parts.append(f"--- no session logs under {logs}")
        return "\n".join(parts)

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

    def _kill_tagged(self) -> None:
        for _ in range(3):  # workers start their own sessions: find them by tag
            pids = self.tagged_pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            with contextlib.suppress(Exception):
                ray.shutdown()
        for node in self.nodes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
        self._kill_tagged()
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
