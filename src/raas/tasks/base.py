"""The task-handler interface: adding a task to raas is one subclass of :class:`TaskHandler`.

A handler sees a job in three stages, each run by its own worker pool:

* ``init``: prepare the environment (open a sandbox, upload files). Returns an :class:`Env`.
* ``run``: the agent acts (usually :func:`raas.agent.loop.run_agent`). The pipeline closes the RUN sandbox
  as soon as this returns, before EVAL.
* ``eval``: score the result; open a fresh sandbox through ``env.sandboxes`` when tests must run.

Optionally, :meth:`TaskHandler.prewarm_eval` starts what EVAL needs (a fresh sandbox) while RUN is still
going; EVAL receives it as ``env.prewarmed``.

Optionally, INIT work that is the same for every sample of a group runs once (:meth:`TaskHandler.shared_init_key`
and :meth:`TaskHandler.group_share`; :mod:`raas.sandbox.layers`): the first sample prepares its sandbox and
publishes it, the others start from a private copy of what it prepared.

The pipeline owns lifetimes: every sandbox opened through ``env.sandboxes`` is closed on success, error,
timeout and cancel, whatever the handler does.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from raas.agent.context import LLMContext
from raas.core.jobs import Job
from raas.core.policy import StagePolicy
from raas.core.trajectory import EvalOutput, RunOutput
from raas.sandbox.base import backend_class
from raas.sandbox.config import with_overrides
from raas.sandbox.layers import LayerStore, Share, layer_key

if TYPE_CHECKING:
    from raas.sandbox import Sandbox, SandboxConfig, SandboxManager

__all__ = [
    "Env",
    "EvalOutput",
    "Job",
    "JobSandboxes",
    "LLMContext",
    "RunOutput",
    "Share",
    "StagePolicy",
    "TaskHandler",
]
"""The handler contract in one import: what a handler subclasses, receives and returns."""


class JobSandboxes:
    """Opens sandboxes on behalf of one job and closes every one of them when asked.

    Handlers call :meth:`open`; the pipeline calls :meth:`close_all` after RUN and after EVAL (and on any
    error, timeout or cancel), so a handler can never leak a sandbox.
    """

    def __init__(
        self,
        manager: SandboxManager,
        default: SandboxConfig,
        owner: str,
        layers: LayerStore | None = None,
        on_open: Callable[[Sandbox], None] | None = None,
    ) -> None:
        self.manager = manager
        self.default = default
        self.owner = owner
        self.layers = layers
        """The service's prepared layers (None: no group sharing in this service)."""
        self.on_open = on_open
        """Told of every sandbox this job opens (the service records it for the job's page)."""
        self._open: list[Sandbox] = []
        self._shares: list[Share] = []

    def config(self, **overrides: Any) -> SandboxConfig:
        """The default sandbox settings with ``overrides`` applied."""
        return with_overrides(self.default, **overrides)

    async def open(self, **overrides: Any) -> Sandbox:
        sandbox = await self.manager.start(self.config(**overrides), owner=self.owner)
        self._open.append(sandbox)
        if self.on_open is not None:
            self.on_open(sandbox)
        seed = overrides.get("seed")
        for share in self._shares:
            if seed and share.seed == seed:
                share.hold_while_open(sandbox)  # the layer stays while this sandbox lives
        return sandbox

    @contextlib.asynccontextmanager
    async def shared(self, key: str | None, *, group: str, **overrides: Any) -> AsyncIterator[Share]:
        """This job's share of the environment prepared for ``key`` (see :mod:`raas.sandbox.layers`).

        Inside the block: when ``share.shared``, open the sandbox with ``seed=share.seed`` (it starts as a
        private copy of what the preparing job published; ``share.meta`` is what it published alongside);
        otherwise prepare as usual and call ``await share.publish(sandbox, meta)`` before the policy may
        touch the sandbox. Without a key, a layer store, or a backend that takes seeds, every job prepares
        for itself (``publish`` does nothing). An error leaving the block while this job prepares fails
        every job of the key (infrastructure: ``sandbox_start_failed``)."""
        config = self.config(**overrides)
        store = self.layers
        if (
            key is None
            or store is None
            or not store.policy.enabled
            or not backend_class(config.backend).supports_seed
        ):
            yield Share(None, None, self.owner)
            return
        async with store.claim(layer_key(key, config), group=group, job_id=self.owner) as share:
            self._shares.append(share)
            try:
                yield share
            finally:
                self._shares.remove(share)

    async def close_all(self) -> None:
        sandboxes, self._open = self._open, []
        # Shield: closing must finish even when the stage that asked for it is being cancelled.
        await asyncio.shield(asyncio.gather(*(s.close() for s in sandboxes), return_exceptions=True))


@dataclass
class Env:
    """A job's environment across stages."""

    job: Job
    sandboxes: JobSandboxes
    sandbox: Sandbox | None = None
    run_output: RunOutput | None = None
    data: dict[str, Any] = field(default_factory=dict)
    prewarmed: Any = None
    """In EVAL: what :meth:`TaskHandler.prewarm_eval` returned (None when the handler has none, it
    returned None, or it failed: EVAL then sets up on its own)."""
    prewarm_error: str | None = None
    """In EVAL: why the prewarm failed, if it did."""


class TaskHandler(ABC):
    """One kind of task, registered under ``name`` (the instances' ``data_source``)."""

    name: ClassVar[str]
    needs_tokenizer: ClassVar[bool] = False
    """True when :meth:`run` reads ``llm.tokenizer`` (e.g. through :func:`raas.agent.loop.run_agent`): a
    service without a chat tokenizer then refuses this handler's jobs at submit (400, naming the handler)
    instead of failing each one in RUN."""
    policy: ClassVar[StagePolicy] = StagePolicy()
    """Per-stage timeouts and pool shares for this handler's jobs (see :class:`raas.core.policy.StagePolicy`);
    ``ServiceConfig.handler_policies[data_source]`` overrides it setting by setting."""
    agent_defaults: ClassVar[dict[str, int]] = {}
    """Agent settings (``max_turns``, ``max_tokens_per_turn``, ``context_budget``) that fit this task better
    than the generic ones. A service applies them to the handler's jobs where neither the job's
``sampling_params`` nor the service's ``agent`` settings chose otherwise; ``raas run`` also sends them with
each job (its own generic settings differ from the service's)."""

    @abstractmethod
    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env: ...

    @abstractmethod
    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput: ...

    @abstractmethod
    async def eval(self, job: Job, env: Env) -> EvalOutput: ...

    @classmethod  # noqa: B027 - optional hook
    def warm_up(cls) -> None:
        """Optional: start loading what this handler's first job would otherwise wait for (a slow import),
        in the background. A service calls it once per handler class when it starts, never at import or
        registry construction: a background import racing the importer's own parsing is unsafe on some
        CPython 3.11 releases (their AST recursion counter is shared between threads)."""

    def validate_instance(self, instance: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Raise ``RaasError(kind="bad_request")`` for an instance this handler cannot run (checked at submit)."""

    def validate_external_instance(self, instance: dict[str, Any]) -> None:
        """The same for an external rollout's instance (``POST /v1/gateway/rollouts``): its agent runs
        outside raas, so fields that only say how raas runs one (a harness's ``agent``) are not needed.
        By default the checks of :meth:`validate_instance`."""
        self.validate_instance(instance)

    def external_output(self, job: Job, env: Env, out: RunOutput, final: dict[str, Any]) -> RunOutput:
        """An external rollout's RUN record (the gateway's turns; :mod:`raas.gateway.external`) completed
        with what its agent sent when it closed (``final``: ``answer``, ``patch``, ``metadata``), so that
        :meth:`eval` finds what this handler's own RUN would have left. By default ``answer`` (else the
        text of the last reply) becomes ``out.answer``; override where EVAL reads something else."""
        answer = final.get("answer")
        if answer is None:
            replies = [m for m in out.messages if m.role == "assistant"]
            answer = replies[-1].content if replies else None
        out.answer = answer
        return out

    async def on_error(self, stage: str, job: Job, env: Env | None, exc: BaseException) -> None:  # noqa: B027
        """Called once when a stage fails, times out or is cancelled, before sandboxes are closed."""

    async def prewarm_eval(self, job: Job, sandboxes: JobSandboxes) -> Any:
        """Optional: prepare EVAL while RUN is still going (e.g. start the fresh sandbox the tests run in),
        so EVAL does not pay for it after RUN. Why a hook: RUN's sandboxes are closed before EVAL, and a
        sandbox opened here must outlive them.

        The pipeline calls it when RUN starts, only for handlers that override it, in a task of its own.
        ``sandboxes`` is a :class:`JobSandboxes` of its own: it stays open through EVAL and is closed when
        the job ends, on every path (success, failure, timeout, cancel), and the task is cancelled if it
        is still running then. The return value is EVAL's ``env.prewarmed``; EVAL waits for it (that wait
        counts as EVAL time). An exception is logged and EVAL gets None (and ``env.prewarm_error``)."""
        return None

    def shared_init_key(self, job: Job) -> str | None:
        """Opt-in to group-shared INIT: a key naming the preparation :meth:`init` does, equal for every job
        whose prepared sandbox would be the same (e.g. the instance's image, commit and hidden paths); None
        (the default) prepares every job on its own. :meth:`init` then wraps its preparation in
        :meth:`group_share`. Jobs share a prepared layer only when their keys, images and populated dirs
        are equal; the key need not name the group."""
        return None

    def group_share(self, job: Job, sandboxes: JobSandboxes, **overrides: Any) -> Any:
        """``async with self.group_share(job, sandboxes, **overrides) as share:`` — the job's
        :class:`~raas.sandbox.layers.Share` under :meth:`shared_init_key` (see :meth:`JobSandboxes.shared`);
        ``overrides`` are the sandbox settings :meth:`init` opens its sandbox with."""
        return sandboxes.shared(self.shared_init_key(job), group=job.group_key, **overrides)

    @classmethod
    def prewarms_eval(cls) -> bool:
        """True when this handler overrides :meth:`prewarm_eval`."""
        return cls.prewarm_eval is not TaskHandler.prewarm_eval
