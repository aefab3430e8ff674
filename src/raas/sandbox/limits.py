"""Per-sandbox resource limits.

What raas enforces itself, on every backend:

* **Wall clock per command**: ``SandboxConfig.command_timeout_s`` is sent with each bash call; the tool
  server interrupts the command (Ctrl-C, then a restart of the session) and reports ``timed_out``.
* **Output cap**: ``output_cap_bytes`` (head + tail with a truncation marker) so a model context is
  never flooded.
* **RLIMITs** (``memory_mb`` → ``RLIMIT_AS``, ``file_size_mb`` → ``RLIMIT_FSIZE``, ``max_procs`` →
  ``RLIMIT_NPROC``): set inside the sandbox by a tiny launcher run with the image's own ``python3``
  just before it becomes the tool server, so they apply to the server and everything it starts, but
  never to the bwrap/apptainer runtime itself (Go's runtime reserves far more address space than any
  sensible ``RLIMIT_AS``). ``RLIMIT_AS`` is per process (a memory cap per process, not per sandbox).

``RLIMIT_NPROC`` is counted by the kernel per *real uid across the whole host*, not per sandbox:

* ``local``: the sandbox shares the host user's uid, so the limit includes every other process of
  that user (the host's agents, servers, other sandboxes).
* ``bwrap`` / ``apptainer`` (rootless): uid 0 inside maps to the invoking user outside, so again the
  count is the user's whole process count; run each sandbox under its own user (or rely on cgroups)
  for a true per-sandbox cap. When the invoking user is root, processes inside drop their
  capabilities, so root's host-wide process count applies.
* ``docker`` / ``podman``: mapped to ``--pids-limit`` (a cgroup pids controller, truly per container).

cgroups (CPU and memory per sandbox): raas does not create cgroups itself, because rootless cgroup
control needs cgroup v2 with delegation (systemd ``Delegate=yes`` or ``systemd-run --user --scope``).
Where that exists, run the raas service itself in a delegated scope, e.g.
``systemd-run --user --scope -p MemoryMax=64G -p CPUQuota=800% raas serve ...``, or use apptainer's own
``--memory/--cpus`` (cgroup v2 + systemd) through ``SandboxConfig.binds``-style extra flags in a
backend subclass. On cgroup v1 hosts (like the CI machines) only RLIMITs are available; docker/podman
use their engine's cgroups.
"""

from __future__ import annotations

import resource

from raas.errors import RaasError

# Run by the image's python3 (>= 3.8) before the tool server: set the limits given as
# name=value arguments up to "--", then run the module named after it with the remaining arguments.
LAUNCHER = (
    "import resource,runpy,sys\n"
    "a=sys.argv[1:];i=a.index('--')\n"
    "for kv in a[:i]:\n"
    " k,v=kv.split('=');n=getattr(resource,'RLIMIT_'+k);v=int(v);h=resource.getrlimit(n)[1]\n"
    " resource.setrlimit(n,(v,v) if h<0 or v<=h else (h,h))\n"
    "sys.argv=[a[i+2]]+a[i+3:]\n"
    "runpy.run_module(a[i+2],run_name='__main__',alter_sys=True)\n"
)


def rlimit_args(memory_mb: int | None, file_size_mb: int | None, max_procs: int | None) -> list[str]:
    """``NAME=value`` arguments for :data:`LAUNCHER` (empty when no limit is set)."""
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


def python_command(python: str, module: str, module_args: list[str], limits: list[str]) -> list[str]:
    """The argv that starts ``python -m module args`` with ``limits`` applied first (if any)."""
    if not limits:
        return [python, "-m", module, *module_args]
    return [python, "-c", LAUNCHER, *limits, "--", "-m", module, *module_args]


def current(name: str) -> tuple[int, int]:
    """The calling process's (soft, hard) limit ``RLIMIT_<name>``; tests compare against it."""
    return resource.getrlimit(getattr(resource, "RLIMIT_" + name))
