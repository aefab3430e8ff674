"""The task-handler interface: adding a task to raas is one subclass of :class:`TaskHandler`.

A handler sees a job in three stages, each run by its own worker pool:

* ``init``: prepare the environment (open a sandbox, upload files). Returns an :class:`Env`.
* ``run``: the agent acts (usually :func:`raas.agent.loop.run_agent`). The pipeline closes the RUN sandbox
  as soon as this returns, before EVAL.
* ``eval``: score the result; open a fresh sandbox through ``env.sandboxes`` when tests must run.

Optionally, :meth:`TaskHandler.prewarm_eval` starts what EVAL needs (a fresh sandbox) while RUN is still
going; EVAL receives it as ``env.prewarmed``.

The pipeline owns lifetimes: every sandbox opened through ``env.sandboxes`` is closed on success, error,
timeout and cancel, whatever the handler does.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from raas.agent.context import LLMContext
from raas.core.jobs import Job
from raas.core.policy import StagePolicy
from raas.core.trajectory import EvalOutput, RunOutput

if TYPE_CHECKING:
    from raas.sandbox import Sandbox, SandboxConfig, SandboxManager

__all__ = [
    "Env",
    "EvalOutput",
    "Job",
    "JobSandboxes",
    "LLMContext",
    "RunOutput",
    "StagePolicy",
    "TaskHandler",
]
"""The handler contract in one import: what a handler subclasses, receives and returns."""


class JobSandboxes:
    """Opens sandboxes on behalf of one job and closes every one of them when asked.

    Handlers call :meth:`open`; the pipeline calls :meth:`close_all` after RUN and after EVAL (and on any
    error, timeout or cancel), so a handler can never leak a sandbox.
    """

    def __init__(self, manager: SandboxManager, default: SandboxConfig, owner: str) -> None:
        self.manager = manager
        self.default = default
        self.owner = owner
        self._open: list[Sandbox] = []

    async def open(self, **overrides: Any) -> Sandbox:
        config = self.default.model_copy(update=overrides) if overrides else self.default
        sandbox = await self.manager.start(config, owner=self.owner)
        self._open.append(sandbox)
        return sandbox

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

    @abstractmethod
    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env: ...

    @abstractmethod
    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput: ...

    @abstractmethod
    async def eval(self, job: Job, env: Env) -> EvalOutput: ...

    def validate_instance(self, instance: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Raise ``RaasError(kind="bad_request")`` for an instance this handler cannot run (checked at submit)."""

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

    @classmethod
    def prewarms_eval(cls) -> bool:
        """True when this handler overrides :meth:`prewarm_eval`."""
        return cls.prewarm_eval is not TaskHandler.prewarm_eval
