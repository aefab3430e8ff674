"""How to run one sandbox (:class:`SandboxConfig`), validated where user input enters.

Kept apart from :mod:`raas.sandbox.base` (which runs sandboxes) because the service, the task handlers and
the HTTP API build and check configs without starting anything.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from raas.errors import RaasError
from raas.sandbox import procs

# Image dirs the writable area is bound over inside container sandboxes (besides the workdir).
WRITABLE_DIRS = ("/tmp", "/var/tmp", "/root", "/run", "/dev/shm")


class SandboxConfig(BaseModel):
    """How to run one sandbox; backends read the fields that apply to them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: str = "local"
    image: str | None = Field(
        default=None, description="rootfs dir, SIF file, docker://, docker-archive:, oci-archive:"
    )
    network: bool = False
    fakeroot: bool = True
    workdir: str = "/workspace"
    env: dict[str, str] = Field(default_factory=dict)
    binds: list[str] = Field(default_factory=list, description="HOST:DEST[:ro|rw]")
    command_timeout_s: float | None = Field(
        300.0, gt=0, description="default limit of every bash/ipython call (None: no limit)"
    )
    output_cap_bytes: int = 30000
    memory_mb: int | None = Field(None, gt=0, description="RLIMIT_AS of every process in the sandbox")
    file_size_mb: int | None = Field(
        None, gt=0, description="RLIMIT_FSIZE: the largest file a process may write"
    )
    max_procs: int | None = Field(
        None,
        gt=0,
        description="RLIMIT_NPROC: per sandbox when raas runs as root (a uid of its own), per user otherwise",
    )
    disk_mb: int | None = Field(
        1024,
        gt=0,
        description="size of the sandbox's writable area (tmpfs, all writable dirs together); None: no cap",
    )
    max_ptys: int = Field(64, ge=4, le=4096, description="pseudo-terminals the sandbox may hold at once")
    max_sessions: int = Field(32, ge=1, le=1024, description="bash sessions the tool server keeps at once")
    writable: list[str] = Field(
        default_factory=list,
        description="image dirs besides workdir that become writable copies (copied into the writable area)",
    )
    liveness_timeout_s: float = Field(
        5.0, gt=0, description="a tool server that does not answer a ping this long is dead"
    )
    start_timeout_s: float = 60.0
    python: str = "python3"
    root_writes: Literal["tmpfs", "host"] = Field(
        default="tmpfs",
        description="the writable area: a size-capped tmpfs (RAM), or a host dir under the scratch dir "
        "(disk, not capped by disk_mb)",
    )
    extra_args: list[str] = Field(default_factory=list, description="extra runtime flags, backend-specific")
    seed: dict[str, str] = Field(
        default_factory=dict,
        description="populated dir (the workdir or one of `writable`) -> host dir bound read-only over the "
        "image there, so the sandbox's private writable copy is made from it instead of the image "
        "(a prepared layer shared by a group of jobs; bwrap and apptainer)",
    )

    @field_validator("binds")
    @classmethod
    def _check_binds(cls, v: list[str]) -> list[str]:
        for b in v:
            _, dest, _ = parse_bind(b)
            shadowed = [w for w in WRITABLE_DIRS if dest == w or dest.startswith(w + "/")]
            if shadowed or dest == "/" or dest == "/.raas" or dest.startswith("/.raas/"):
                raise ValueError(
                    f"bind {b!r}: {dest} is inside the sandbox's own writable area or raas's /.raas; "
                    "bind somewhere else (e.g. /mnt/...)"
                )
        return v

    @field_validator("workdir")
    @classmethod
    def _check_workdir(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("workdir must be an absolute path")
        return v

    @model_validator(mode="after")
    def _binds_outside_workdir(self) -> SandboxConfig:
        for b in self.binds:
            dest = parse_bind(b)[1]
            if dest == self.workdir or dest.startswith(self.workdir.rstrip("/") + "/"):
                raise ValueError(f"bind {b!r}: {dest} is inside the workdir, which the writable area covers")
        return self

    @field_validator("writable")
    @classmethod
    def _check_writable(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/") or p.rstrip("/") in ("", "/.raas") or p.startswith("/.raas/"):
                raise ValueError(f"writable dir {p!r} must be an absolute path outside /.raas")
        return v

    @model_validator(mode="after")
    def _seed_targets(self) -> SandboxConfig:
        populated = {self.workdir.rstrip("/") or "/", *(w.rstrip("/") or "/" for w in self.writable)}
        for dest, host in self.seed.items():
            if dest.rstrip("/") not in populated:
                raise ValueError(f"seed {dest!r} is neither the workdir nor one of the writable dirs")
            if not host.startswith("/"):
                raise ValueError(f"seed {dest!r}: {host!r} is not an absolute host path")
        return self

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not k or "=" in k or "\0" in k or k == procs.ENV_KEY:
                raise ValueError(f"invalid environment variable name {k!r}")
        return v


def config_from_dict(data: dict[str, Any]) -> SandboxConfig:
    """Validate user-supplied config data; a bad field is a ``bad_request``, not a pydantic error."""
    try:
        return SandboxConfig.model_validate(data)
    except ValidationError as e:
        raise RaasError(f"invalid sandbox config: {e}", kind="bad_request") from e


def parse_bind(spec: str) -> tuple[str, str, bool]:
    """``HOST:DEST[:ro|rw]`` → (host, dest, read_only); raises ValueError on a malformed spec."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0].startswith("/") or not parts[1].startswith("/"):
        raise ValueError(f"bind {spec!r} is not HOST:DEST[:ro|rw] with absolute paths")
    mode = parts[2] if len(parts) == 3 else "rw"
    if mode not in ("ro", "rw"):
        raise ValueError(f"bind {spec!r}: mode must be ro or rw")
    return parts[0], parts[1], mode == "ro"
