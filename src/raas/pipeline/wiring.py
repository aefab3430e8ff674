"""The layers one service runs on: the sandbox manager, the LLM balancer, the chat tokenizer, the agent
gateway and the task handler registry, built from the config unless the caller injects them.

What this module builds it also closes (the sandbox manager's sandboxes, the balancer's health checks and
HTTP client, the verifier worker pool); an injected manager or balancer belongs to its caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

from raas.agent.context import LLMContext
from raas.core.jobs import Job
from raas.core.policy import StagePolicy
from raas.errors import RaasError
from raas.gateway import Gateway
from raas.llm import ChatTokenizer, LLMBalancer
from raas.pipeline.config import ServiceConfig, agent_config_for
from raas.sandbox import SandboxConfig, SandboxManager, config_from_dict
from raas.sandbox.base import Sandbox
from raas.sandbox.layers import LayerStore
from raas.tasks import verify
from raas.tasks.base import JobSandboxes, TaskHandler
from raas.tasks.registry import HandlerRegistry

log = logging.getLogger("raas.pipeline")

NO_TOKENIZER_HINT = (
    "start the service with a chat tokenizer: `raas serve --tokenizer DIR`, `tokenizer_dir` in the "
    "service config, or RolloutService(..., tokenizer=ChatTokenizer.from_pretrained(DIR))"
)


class Layers:
    """Owner of the layers below the pipeline for one service (see the module docstring)."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        sandbox_manager: SandboxManager | None = None,
        balancer: LLMBalancer | None = None,
        tokenizer: ChatTokenizer | None = None,
        handlers: HandlerRegistry | None = None,
    ) -> None:
        self.config = config
        self.sandbox_manager = sandbox_manager
        self._owns_manager = sandbox_manager is None
        self.balancer = balancer
        self._owns_balancer = balancer is None
        self.tokenizer = tokenizer
        self.handlers = handlers if handlers is not None else HandlerRegistry()
        self.gateway: Gateway | None = None
        self._sandbox_default: SandboxConfig | None = None
        self._policies: dict[str, StagePolicy] = {}
        self._pools_configured = False
        self.init_backlog: Callable[[], int] = lambda: 0
        """Jobs waiting for an INIT worker (set by the service): warm pools grow with it."""
        self.layer_store: LayerStore | None = None
        """Prepared layers of group-shared INIT (built at start, removed at close)."""
        self.group_pending: Callable[[set[str], set[str]], bool] | None = None
        """Set by the service: does a job of these groups, not among these job ids, still wait for INIT?"""
        self.sandbox_opened: Callable[[str, Sandbox], None] | None = None
        """Set by the service: a job (its id) opened this sandbox."""
        self.commit_turn: Callable[[str, int, str], None] | None = None
        """Set by the service: commit a job's RUN turn (its id, the turn's index, the record)."""

    async def start(self) -> None:
        """Register ``extra_handlers`` and build what was not injected."""
        for name, target in self.config.extra_handlers.items():
            self.handlers.register_target(name, target)
        self._sandbox_default = config_from_dict(self.config.sandbox)
        pooled = self._pooled_configs()
        if self.sandbox_manager is None:
            self.sandbox_manager = SandboxManager(self.config.state_dir / "sandboxes")
            await self.sandbox_manager.reap_stale()
        if pooled:
            self.sandbox_manager.pools.configure(self.config.warm_pool, pooled, backlog=self.init_backlog)
            self._pools_configured = True
        if self.config.group_layers.enabled:
            self.layer_store = await asyncio.to_thread(
                LayerStore,
                self.sandbox_manager.scratch_root / "layers",
                self.config.group_layers,
                pending=self.group_pending,
            )
        if self.balancer is None:
            # Health checks run for the service's lifetime: a server marked unhealthy after a failed
            # request comes back once it answers again. ``close`` stops them and closes the client.
            self.balancer = LLMBalancer(
                health_interval_s=self.config.llm_health_interval_s, routing=self.config.llm_routing
            )
            self.balancer.start_health_checks()
        for url in self.config.llm_servers:
            self.balancer.add(url)
        if self.tokenizer is None and self.config.tokenizer_dir is not None:
            self.tokenizer = await asyncio.to_thread(ChatTokenizer.from_pretrained, self.config.tokenizer_dir)
        # Third-party agents reach the policy through it (per-rollout endpoints; see raas.gateway).
        self.gateway = Gateway(self.balancer, self.tokenizer)
        if self.tokenizer is None:
            needing = sorted(n for n, cls in self.handlers.classes().items() if cls.needs_tokenizer)
            if needing:
                log.warning(
                    "no chat tokenizer: jobs for %s will be refused at submit; %s",
                    ", ".join(needing),
                    NO_TOKENIZER_HINT,
                )

    def _pooled_configs(self) -> list[SandboxConfig]:
        """The default sandbox config and each of ``warm_pool.configs`` (overrides of it), when enabled."""
        settings = self.config.warm_pool
        if not settings.enabled:
            return []
        configs = [config_from_dict({**self.config.sandbox, **extra}) for extra in settings.configs]
        assert self._sandbox_default is not None
        return [self._sandbox_default, *configs]

    def warm_pools(self) -> dict[str, Any]:
        """Warm-pool settings and per-pool numbers (``/status``, ``/metrics``)."""
        if self.sandbox_manager is None or not self._pools_configured:
            return {"enabled": False, "pools": []}
        return self.sandbox_manager.pools.snapshot()

    async def close(self) -> None:
        """Close what this service built, and the verifier workers of this event loop."""
        if self.gateway is not None:
            with contextlib.suppress(Exception):
                await self.gateway.aclose()
        if self._pools_configured and self.sandbox_manager is not None:
            # The service's pools go with it, also from a manager the caller injected.
            with contextlib.suppress(Exception):
                await self.sandbox_manager.pools.stop()
        if self._owns_manager and self.sandbox_manager is not None:
            with contextlib.suppress(Exception):
                await self.sandbox_manager.close_all()
        if self.layer_store is not None:
            with contextlib.suppress(Exception):
                await self.layer_store.close()
        if self._owns_balancer and self.balancer is not None:
            with contextlib.suppress(Exception):
                await self.balancer.aclose()
        with contextlib.suppress(Exception):
            await verify.shutdown()

    # -- handlers ----------------------------------------------------------------------------------------

    def handler_for(self, data_source: str) -> TaskHandler:
        """The handler for ``data_source``, or ``bad_request`` (unknown or broken)."""
        try:
            handler = self.handlers.get(data_source)
        except RaasError as exc:
            raise RaasError(exc.message, kind="bad_request", stage="api") from exc
        except Exception as exc:
            raise RaasError(
                f"unknown data_source {data_source!r}: {exc}", kind="bad_request", stage="api"
            ) from exc
        return handler

    def check_can_run(self, data_source: str, handler: TaskHandler) -> None:
        """``bad_request`` when ``handler`` needs a chat tokenizer and this service has none."""
        if handler.needs_tokenizer and self.tokenizer is None:
            raise RaasError(
                f"data_source {data_source!r} ({type(handler).__module__}.{type(handler).__qualname__}) "
                f"needs a chat tokenizer and this service has none: {NO_TOKENIZER_HINT}",
                kind="bad_request",
                stage="api",
            )

    def policy_for(self, data_source: str, handler: TaskHandler) -> StagePolicy:
        """The handler's stage policy, overridden by ``handler_policies[data_source]``, with the
        service-wide ``stage_timeouts`` filling what neither sets."""
        policy = self._policies.get(data_source)
        if policy is None:
            policy = handler.policy
            override = self.config.handler_policies.get(data_source)
            if override is not None:
                policy = policy.overridden_by(override)
            policy = policy.with_default_timeouts(self.config.stage_timeouts)
            self._policies[data_source] = policy
        return policy

    def resume_in_run(self, data_source: str | None) -> str:
        """What a restart does with a job of ``data_source`` inside RUN (its stage policy's ``resume``;
        ``fail`` for a data source no handler serves any more)."""
        try:
            handler = self.handlers.get(str(data_source or ""))
        except RaasError:
            return "fail"
        resume = self.policy_for(str(data_source), handler).resume
        return "fail" if resume == "replay" and not self.config.checkpoints else resume

    # -- what stages get ---------------------------------------------------------------------------------

    @property
    def manager(self) -> SandboxManager:
        if self.sandbox_manager is None:
            raise RaasError("the service has not started", kind="unavailable")
        return self.sandbox_manager

    def sandboxes_for(self, job_id: str) -> JobSandboxes:
        """A job's sandbox opener, with the service's default sandbox settings."""
        if self._sandbox_default is None:
            raise RaasError("the service has not started", kind="unavailable")
        opened = self.sandbox_opened
        on_open = None if opened is None else functools.partial(opened, job_id)
        return JobSandboxes(self.manager, self._sandbox_default, job_id, self.layer_store, on_open)

    def llm_context(self, job: Job) -> LLMContext:
        """What a RUN stage gets: the balancer, the tokenizer and the agent settings with the job's
        overrides (``bad_request`` for invalid ones)."""
        return LLMContext(
            balancer=self.require_balancer(),
            tokenizer=self.tokenizer,
            agent=agent_config_for(self.config.agent, job.sampling_params, self._agent_defaults(job)),
            gateway=self.gateway,
        )

    def _agent_defaults(self, job: Job) -> dict[str, int]:
        cls = self.handlers.classes().get(job.data_source)
        return dict(cls.agent_defaults) if cls is not None else {}

    async def release(self, job: Job) -> None:
        """After a job: unpin its trajectory, then close anything the manager still holds for it."""
        if self.balancer is not None:
            self.balancer.release(job.job_id)
        if self.sandbox_manager is None:
            return
        try:
            await asyncio.shield(self.sandbox_manager.close_owner(job.job_id))
        except Exception:
            log.exception("close_owner failed for job %s", job.job_id)

    # -- inference servers -------------------------------------------------------------------------------

    def require_balancer(self) -> LLMBalancer:
        if self.balancer is None:
            raise RaasError("the LLM layer is not available in this service", kind="unavailable", stage="api")
        return self.balancer

    def llm_servers(self) -> list[dict[str, Any]]:
        return [] if self.balancer is None else self.balancer.servers()

    def add_llm_server(self, address: str, *, weight_version: str | None = None, kind: str = "auto") -> None:
        self.require_balancer().add(address, weight_version=weight_version, kind=kind)

    def remove_llm_server(self, address: str) -> None:
        self.require_balancer().remove(address)

    def clear_llm_servers(self) -> None:
        self.require_balancer().clear()
