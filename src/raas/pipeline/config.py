"""Service configuration: one pydantic model, loadable from JSON/TOML and overridable from the CLI."""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from raas.agent.config import AGENT_ALIASES, AgentConfig, agent_overrides
from raas.core.policy import StagePolicy, StageTimeouts
from raas.errors import RaasError
from raas.llm.routing import RoutingConfig
from raas.sandbox.layers import LayerPolicy
from raas.sandbox.pool import PoolSettings

__all__ = ["AGENT_ALIASES", "ServiceConfig", "agent_overrides"]


def agent_config_for(
    base: AgentConfig, sampling_params: dict[str, Any], handler_defaults: Mapping[str, Any] | None = None
) -> AgentConfig:
    """A job's agent settings: what its ``sampling_params`` carry, else what the service's operator
    changed in ``base``, else the task handler's ``agent_defaults`` (a SWE prompt alone outgrows the generic
    budget), else :class:`AgentConfig`'s defaults. "Changed" compares values, not pydantic's set-fields,
    so a configuration that went through JSON (a cluster node's) behaves the same. ``bad_request`` when
    invalid."""
    fields = AgentConfig.model_fields
    overrides = {
        k: v
        for k, v in (handler_defaults or {}).items()
        if k in fields and getattr(base, k) == fields[k].default
    }
    overrides.update(agent_overrides(sampling_params))
    if not overrides:
        return base
    try:
        return AgentConfig.model_validate({**base.model_dump(), **overrides})
    except ValueError as exc:
        raise RaasError(f"invalid agent settings in sampling_params: {exc}", kind="bad_request") from exc


Workers = Annotated[int, Field(ge=1, le=4096)] | Literal["auto"]
WORKERS_HELP = (
    "Jobs inside this stage at once, or 'auto': sized from the CPUs and memory, then adjusted to measured "
    "CPU headroom (see raas.pipeline.autosize)"
)


def _default_home() -> Path:
    return Path(os.environ.get("RAAS_HOME") or Path.home() / ".cache" / "raas")


class ServiceConfig(BaseModel):
    """Everything ``raas serve`` needs. Defaults run a small local service."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8008, ge=0, le=65535)
    state_dir: Path = Field(default_factory=lambda: _default_home() / "service")
    ledger_path: Path | None = Field(None, description="SQLite ledger; default <state_dir>/ledger.sqlite3")
    sandbox: dict[str, Any] = Field(
        default_factory=lambda: {"backend": "local"}, description="Default SandboxConfig fields for every job"
    )
    llm_servers: list[str] = Field(default_factory=list, description="Inference server URLs to start with")
    tokenizer_dir: Path | None = Field(None, description="Chat tokenizer dir for the policy model")
    llm_health_interval_s: float = Field(
        5.0, ge=0, description="Probe inference servers this often, so unhealthy ones come back (0 = never)"
    )
    llm_routing: RoutingConfig = Field(
        default_factory=RoutingConfig,
        description="How new trajectories pick an inference server (GRPO groups share a home by default)",
    )
    agent: AgentConfig = Field(default_factory=AgentConfig)
    group_layers: LayerPolicy = Field(
        default_factory=LayerPolicy,
        description="Group-shared INIT (handlers that opt in): lifetime and disk budget of prepared layers",
    )

    init_workers: Workers = Field(4, description=WORKERS_HELP)
    run_workers: Workers = Field(8, description=WORKERS_HELP)
    eval_workers: Workers = Field(4, description=WORKERS_HELP)
    warm_pool: PoolSettings = Field(
        default_factory=PoolSettings,
        description="Warm pools of pre-started sandboxes for the default sandbox config (and warm_pool.configs)",
    )
    max_pending: int = Field(
        1024, ge=1, description="Jobs accepted but unfinished; beyond this submit gets 429"
    )
    retry_after_s: float = Field(1.0, gt=0, description="Retry-After sent with 429")

    default_timeout_s: float = Field(600.0, gt=0, description="Per-job budget of in-stage time")
    stage_timeouts: StageTimeouts = Field(
        default_factory=StageTimeouts, description="Per-stage ceilings for handlers that set none"
    )
    handler_policies: dict[str, StagePolicy] = Field(
        default_factory=dict,
        description="data_source -> stage policy (stage_timeouts, max_share) overriding the handler's own",
    )
    hook_timeout_s: float = Field(10.0, gt=0, description="Ceiling for a handler's on_error hook")
    cancel_grace_s: float = Field(5.0, gt=0, description="How long an interrupted stage may take to unwind")
    shutdown_grace_s: float = Field(10.0, ge=0, description="How long shutdown lets in-flight jobs finish")

    result_ttl_s: float | None = Field(
        7 * 24 * 3600.0, gt=0, description="Drop finished jobs older than this"
    )
    max_results: int | None = Field(100_000, ge=1, description="Keep at most this many finished jobs")
    prune_interval_s: float = Field(60.0, gt=0)
    result_cache_size: int = Field(
        64, ge=0, description="Finished results kept in memory for fast polling (the ledger has them all)"
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Restarts a job inside RUN may survive (retry_on_restart, resume: replay/restart)",
    )
    checkpoints: bool = Field(
        True,
        description="Commit RUN's output and each of its turns, so a restart resumes a job at EVAL or replays "
        "its turns; False: a restart fails (or, with retry_on_restart, restarts) every job past INIT",
    )

    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024, description="Larger request bodies get 413")
    max_instance_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="Larger job instances (as JSON) get 413; pending jobs stay in memory",
    )
    max_batch_jobs: int = Field(1024, ge=1, description="Batches with more jobs get 413")
    max_batch_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Larger batch bodies (POST /v1/jobs:batch) get 413"
    )
    max_wait_s: float = Field(300.0, gt=0, description="Longest long-poll a request may ask for")
    api_token: str | None = Field(None, description="Bearer token; RAAS_API_TOKEN overrides when set")
    insecure: bool = Field(
        False, description="Allow serving a non-loopback address without a token (anyone there can submit)"
    )

    http_header_timeout_s: float = Field(
        10.0, gt=0, description="A connection must send complete request headers within this time"
    )
    http_body_timeout_s: float = Field(
        120.0, gt=0, description="A request body must arrive within this time (else 408)"
    )
    http_keep_alive_s: float = Field(30.0, gt=0, description="Idle keep-alive connections close after this")
    http_max_connections: int = Field(
        2048, ge=8, description="Open connections; over it the longest-idle one is closed, or a 503 is sent"
    )

    extra_handlers: dict[str, str] = Field(
        default_factory=dict, description="data_source -> 'module:Class' task handlers to register at start"
    )

    def ledger_file(self) -> Path:
        return self.ledger_path or self.state_dir / "ledger.sqlite3"

    def token(self) -> str | None:
        return os.environ.get("RAAS_API_TOKEN") or self.api_token

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> ServiceConfig:
        """Read a JSON or TOML file (if given) and apply keyword overrides that are not None."""
        data: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            try:
                text = p.read_text()
                data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
            except (OSError, ValueError) as exc:
                raise RaasError(f"cannot read config {p}: {exc}", kind="bad_request") from exc
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(data)
        except ValueError as exc:
            raise RaasError(f"invalid service config: {exc}", kind="bad_request") from exc
