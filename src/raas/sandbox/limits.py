"""Per-sandbox resource limits.

What raas enforces itself, on every backend:

* **Wall clock per command**: ``SandboxConfig.command_timeout_s`` (default 300 s) is sent with each
  bash/ipython call; the tool server interrupts the command and reports ``timed_out``.
* **Output cap**: ``output_cap_bytes`` (head + tail with a truncation marker) so a model context is
  never flooded.
* **RLIMITs** (``memory_mb`` → ``RLIMIT_AS``, ``file_size_mb`` → ``RLIMIT_FSIZE``, ``max_procs`` →
  ``RLIMIT_NPROC``): set by the boot step inside the sandbox (``raas_toolserver.boot``) before the tool
  server starts, so they apply to it and everything it starts, but never to the container runtime.
  ``RLIMIT_AS`` is per process.

``RLIMIT_NPROC`` is counted by the kernel per *host uid*:

* container backends run as root: every sandbox has a uid of its own (:mod:`raas.sandbox.identity`), so
  ``max_procs`` caps exactly that sandbox's processes;
* container backends run as a normal user, and ``local``: every sandbox shares the user's uid, so the
  count includes all of that user's processes (other sandboxes, the service). Per-sandbox process caps
  for normal users need a cgroup (run the service in a delegated cgroup, e.g. ``systemd-run --user
  --scope -p TasksMax=...``, or the HPC scheduler's job cgroup);
* ``docker`` / ``podman``: ``--pids-limit`` (a cgroup, per container).

Container backends (bwrap, apptainer) also cap, per sandbox, the **writable area** (``disk_mb``: one tmpfs
for the workdir, /tmp, /var/tmp, /root, /run and /dev/shm together; ``df`` inside shows it) and the
**pseudo-terminals** (``max_ptys``: a devpts instance of the sandbox's own). CPU time and total memory per
sandbox need cgroups; run the service inside one (see above) to bound all sandboxes together.
"""

from __future__ import annotations

import resource

from raas.errors import RaasError


def rlimit_args(memory_mb: int | None, file_size_mb: int | None, max_procs: int | None) -> list[str]:
    """``NAME=value`` arguments for the boot step's ``--rlimit`` (empty when no limit is set)."""
    out: list[str] = []
    for name, value, scale in (
        ("AS", memory_mb, 1 << 20),
        ("FSIZE", file_size_mb, 1 << 20),
        ("NPROC", max_procs, 1),
    ):
        if value is None:
            continue
        if value <= 0:
            raise RaasError(f"limit {name} must be positive, got {value}", kind="bad_request")
        out.append(f"{name}={value * scale}")
    return out


def current(name: str) -> tuple[int, int]:
    """The calling process's (soft, hard) limit ``RLIMIT_<name>``; tests compare against it."""
    return resource.getrlimit(getattr(resource, "RLIMIT_" + name))
