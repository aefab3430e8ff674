"""How to run one sandbox: one config class per backend, told apart by ``backend``.

A backend accepts only the fields it honours, so a setting that would be silently ignored (an image for
``local``, a disk cap for ``docker``) is a validation error instead. :data:`SandboxConfig` is the union of
the classes; :func:`make_config` (programmatic) and :func:`config_from_dict` (user input) build the
right one from plain fields. Kept apart from :mod:`raas.sandbox.base` (which runs sandboxes) because the
service, the task handlers and the HTTP API build and check configs without starting anything.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from raas.errors import RaasError
from raas.sandbox import procs

# Image dirs the writable area is bound over inside container sandboxes (besides the workdir).
WRITABLE_DIRS = ("/tmp", "/var/tmp", "/root", "/run", "/dev/shm")


class CommonSandboxConfig(BaseModel):
    """What every backend honours: the tool server's limits, resource limits, environment, timeouts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workdir: str = Field("/workspace", description="the tool server's working dir (local: its own host dir)")
    env: dict[str, str] = Field(default_factory=dict)
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
    max_sessions: int = Field(32, ge=1, le=1024, description="bash sessions the tool server keeps at once")
    liveness_timeout_s: float = Field(
        5.0, gt=0, description="a tool server that does not answer a ping this long is dead"
    )
    start_timeout_s: float = 60.0

    @field_validator("workdir")
    @classmethod
    def _check_workdir(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("workdir must be an absolute path")
        return v

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not k or "=" in k or "\0" in k or k == procs.ENV_KEY:
                raise ValueError(f"invalid environment variable name {k!r}")
        return v


class LocalSandboxConfig(CommonSandboxConfig):
    """``local``: a host process in a private dir; no image, network or filesystem confinement."""

    backend: Literal["local"] = "local"


class ImageSandboxConfig(CommonSandboxConfig):
    """What every backend that runs an image honours: the image, network, binds, its python, runtime flags."""

    image: str | None = Field(
        default=None, description="rootfs dir, SIF file, docker://, docker-archive:, oci-archive:"
    )
    network: bool = False
    binds: list[str] = Field(default_factory=list, description="HOST:DEST[:ro|rw]")
    python: str = Field("python3", description="the image's interpreter that runs the tool server")
    extra_args: list[str] = Field(default_factory=list, description="extra runtime flags, backend-specific")

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

    @model_validator(mode="after")
    def _binds_outside_workdir(self) -> ImageSandboxConfig:
        for b in self.binds:
            dest = parse_bind(b)[1]
            if dest == self.workdir or dest.startswith(self.workdir.rstrip("/") + "/"):
                raise ValueError(f"bind {b!r}: {dest} is inside the workdir, which the writable area covers")
        return self


class DockerSandboxConfig(ImageSandboxConfig):
    """``docker`` / ``podman``: the engine's container; the engine owns the writable layer and its size."""

    backend: Literal["docker", "podman"] = "docker"


class NamespaceSandboxConfig(ImageSandboxConfig):
    """What raas's own namespace backends (bwrap, apptainer) add: the writable area, ptys, seeds."""

    disk_mb: int | None = Field(
        1024,
        gt=0,
        description="size of the sandbox's writable area (tmpfs, all writable dirs together); None: no cap",
    )
    max_ptys: int = Field(64, ge=4, le=4096, description="pseudo-terminals the sandbox may hold at once")
    writable: list[str] = Field(
        default_factory=list,
        description="image dirs besides workdir that become writable copies (copied into the writable area)",
    )
    root_writes: Literal["tmpfs", "host"] = Field(
        default="tmpfs",
        description="the writable area: a size-capped tmpfs (RAM), or a host dir under the scratch dir "
        "(disk, not capped by disk_mb)",
    )
    seed: dict[str, str] = Field(
        default_factory=dict,
        description="populated dir (the workdir or one of `writable`) -> host dir bound read-only over the "
        "image there, so the sandbox's private writable copy is made from it instead of the image "
        "(a prepared layer shared by a group of jobs)",
    )

    @field_validator("writable")
    @classmethod
    def _check_writable(cls, v: list[str]) -> list[str]:
        for p in v:
            if not p.startswith("/") or p.rstrip("/") in ("", "/.raas") or p.startswith("/.raas/"):
                raise ValueError(f"writable dir {p!r} must be an absolute path outside /.raas")
        return v

    @model_validator(mode="after")
    def _seed_targets(self) -> NamespaceSandboxConfig:
        populated = {self.workdir.rstrip("/") or "/", *(w.rstrip("/") or "/" for w in self.writable)}
        for dest, host in self.seed.items():
            if dest.rstrip("/") not in populated:
                raise ValueError(f"seed {dest!r} is neither the workdir nor one of the writable dirs")
            if not host.startswith("/"):
                raise ValueError(f"seed {dest!r}: {host!r} is not an absolute host path")
        return self


class BwrapSandboxConfig(NamespaceSandboxConfig):
    """``bwrap``: bubblewrap over a rootfs dir."""

    backend: Literal["bwrap"] = "bwrap"


class ApptainerSandboxConfig(NamespaceSandboxConfig):
    """``apptainer`` / ``singularity``: a SIF or rootfs dir, or an image converted from docker/OCI."""

    backend: Literal["apptainer", "singularity"] = "apptainer"
    fakeroot: bool = Field(True, description="uid 0 inside (a user namespace; never host root)")


SandboxConfig = Annotated[
    LocalSandboxConfig | BwrapSandboxConfig | ApptainerSandboxConfig | DockerSandboxConfig,
    Field(discriminator="backend"),
]
"""Any backend's config; ``backend`` picks the class."""

_ADAPTER: TypeAdapter[SandboxConfig] = TypeAdapter(SandboxConfig)
_CLASSES: dict[str, type[CommonSandboxConfig]] = {
    "local": LocalSandboxConfig,
    "bwrap": BwrapSandboxConfig,
    "apptainer": ApptainerSandboxConfig,
    "singularity": ApptainerSandboxConfig,
    "docker": DockerSandboxConfig,
    "podman": DockerSandboxConfig,
}


def make_config(**fields: Any) -> SandboxConfig:
    """The config class of ``backend`` (default ``local``) built from ``fields``; raises ValidationError.

    A field the backend does not have is an error, except when it is ``None`` (not set), so callers that
    handle several backends can pass e.g. ``image=None`` for ``local``."""
    fields.setdefault("backend", "local")
    cls = _CLASSES.get(fields["backend"])
    if cls is not None:
        fields = {k: v for k, v in fields.items() if v is not None or k in cls.model_fields}
    return _ADAPTER.validate_python(fields)


def with_overrides(config: SandboxConfig, **overrides: Any) -> SandboxConfig:
    """``config`` with ``overrides`` applied and validated again (``model_copy`` would not validate)."""
    if not overrides:
        return config
    return config_from_dict({**config.model_dump(), **overrides})


def image_of(config: SandboxConfig) -> str | None:
    """The config's image (None for ``local``, which runs none)."""
    return config.image if isinstance(config, ImageSandboxConfig) else None


def python_of(config: SandboxConfig) -> str:
    """The interpreter task code runs with inside the sandbox (``local``: the host's ``python3``)."""
    return config.python if isinstance(config, ImageSandboxConfig) else "python3"


def writable_of(config: SandboxConfig) -> list[str]:
    """The image dirs besides the workdir that the sandbox gets writable copies of (namespace backends)."""
    return list(config.writable) if isinstance(config, NamespaceSandboxConfig) else []


def config_from_dict(data: dict[str, Any]) -> SandboxConfig:
    """Validate user-supplied config data; a bad field is a ``bad_request`` that names the field."""
    try:
        return make_config(**data)
    except ValidationError as e:
        raise RaasError(
            f"invalid sandbox config: {explain(e, data.get('backend', 'local'))}", kind="bad_request"
        ) from e


def explain(error: ValidationError, backend: object) -> str:
    """One line per problem, named by field (pydantic's own text names the whole tagged union)."""
    lines = []
    for err in error.errors():
        loc = [str(x) for x in err["loc"]][1:]  # the first element is the backend tag
        field = ".".join(loc)
        if err["type"] == "union_tag_invalid":
            lines.append(f"backend: unknown backend {backend!r}; known: {', '.join(_CLASSES)}")
        elif err["type"] == "extra_forbidden":
            lines.append(f"{field}: not a setting of the {backend} backend")
        else:
            lines.append(f"{field or 'config'}: {err['msg']}")
    return "; ".join(lines)


def parse_bind(spec: str) -> tuple[str, str, bool]:
    """``HOST:DEST[:ro|rw]`` → (host, dest, read_only); raises ValueError on a malformed spec."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0].startswith("/") or not parts[1].startswith("/"):
        raise ValueError(f"bind {spec!r} is not HOST:DEST[:ro|rw] with absolute paths")
    mode = parts[2] if len(parts) == 3 else "rw"
    if mode not in ("ro", "rw"):
        raise ValueError(f"bind {spec!r}: mode must be ro or rw")
    return parts[0], parts[1], mode == "ro"
