"""The task-handler interface: adding a task to raas is one subclass of :class:`TaskHandler`.

A handler sees a job in three stages, each run by its own worker pool:

* ``init``: prepare the environment (open a sandbox, upload files). Returns an :class:`Env`.
* ``run``: the agent acts (usually :func:`raas.agent.loop.run_agent`). The pipeline closes the RUN sandbox
  as soon as this returns, before EVAL.
* ``eval``: score the result; open a fresh sandbox through ``env.sandboxes`` when tests must run.

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
