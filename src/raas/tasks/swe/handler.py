"""The SWE task handler (``data_source`` ``swebench``, ``swe-gym``, ``r2e`` and aliases).

* INIT: the instance's image (converted once into the image cache; starts gated per image and per node),
  a sandbox whose workdir (``/testbed``) is a private writable copy of the image's repository, brought to
  the base commit with a clean tree; hidden paths removed. That preparation is shared by the samples of
  one instance (:meth:`~raas.tasks.base.TaskHandler.shared_init_key`): the first prepares and publishes
  it, the others start from private copies of the prepared dirs (:mod:`raas.sandbox.layers`).
* RUN: the agent (bash, the editor, submit; IPython optional) with a prompt built from the problem
  statement. When it ends, the patch (``git diff --binary`` against the base commit, without the files the
  hidden test patch writes) is taken from the RUN sandbox, before the pipeline closes it, and returned as
  the ``git_patch`` artifact (the ProRL field).
* EVAL: a **fresh** sandbox from the same image, started while RUN is still going (the pipeline's prewarm
  hook; ``Timing.prewarm_s``): apply the patch, the hidden tests, grade with SWE-bench's code
  (:mod:`.evaluation` lists the outcomes). Reward 1 iff resolved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
from typing import Any, ClassVar

from raas.agent.loop import run_agent
from raas.agent.tools import ToolSet
from raas.core.policy import StagePolicy, StageShares, StageTimeouts
from raas.core.trajectory import EvalOutput, Message, RunOutput
from raas.errors import RaasError
from raas.sandbox.base import Sandbox
from raas.sandbox.config import NamespaceSandboxConfig
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler

from .config import AGENT_DEFAULTS, SweConfig, load_config
from .evaluation import Verdict, evaluate_task
from .images import SWE_SOURCES, ImageGates, gates_for_loop, image_reference
from .instance import SweTask, parse_task
from .patch import extract_patch
from .workspace import RepoState, prepare_repo

_warm = threading.Event()


def _import_swebench_in_background() -> None:
    """Import swebench (~3 s) in a background thread once per process, so the first SWE job's
    validation at submit, which runs on the service's event loop, finds it loaded."""
    if _warm.is_set():
        return
    _warm.set()

    def load() -> None:
        with contextlib.suppress(Exception):
            from swebench.harness import infra_failure, utils  # noqa: F401

            from . import grading, specs

            grading.known_parser("parse_log_pytest")
            specs.parser_for_repo("")

    threading.Thread(target=load, name="raas-swebench-import", daemon=True).start()


CONTAINER_BACKENDS = ("bwrap", "apptainer", "singularity", "docker", "podman")
ALIASES = tuple(sorted(SWE_SOURCES - {"swebench", "swe-mini"}))


class SweHandler(TaskHandler):
    """See the module docstring. Settings: :class:`~raas.tasks.swe.config.SweConfig` (``RAAS_SWE_CONFIG``)."""

    name: ClassVar[str] = "swebench"
    needs_tokenizer: ClassVar[bool] = True
    policy: ClassVar[StagePolicy] = StagePolicy(
        stage_timeouts=StageTimeouts(init=1800, eval=2400),
        max_share=StageShares(init=0.5, eval=0.5),
    )
    """INIT may convert a multi-GB image once; a test suite may take many minutes. Half of the INIT and
    EVAL pools at most, so SWE jobs never starve other tasks' sandbox starts and evaluations."""
    agent_defaults: ClassVar[dict[str, int]] = AGENT_DEFAULTS
    config: ClassVar[SweConfig | None] = None
    """Fixed settings for a subclass; None: :func:`~raas.tasks.swe.config.load_config`."""

    def __init__(self) -> None:
        self.settings = self.config if self.config is not None else load_config()

    @classmethod
    def warm_up(cls) -> None:
        _import_swebench_in_background()

    # -- submit ----------------------------------------------------------------------------------------

    def validate_instance(self, instance: dict[str, Any]) -> None:
        image_reference(parse_task(instance), self.settings.image_template)

    # -- sandboxes -------------------------------------------------------------------------------------

    def _gates(self) -> ImageGates:
        return gates_for_loop(self.settings.starts_per_image, self.settings.starts_per_node)

    async def _image(self, task: SweTask) -> tuple[str, Any]:
        ref = image_reference(task, self.settings.image_template)
        return ref, await self._gates().resolve(ref)

    async def _overrides(
        self, task: SweTask, sandboxes: JobSandboxes, *, hide: bool
    ) -> tuple[str, dict[str, Any]]:
        default = sandboxes.default
        if default.backend not in CONTAINER_BACKENDS:
            raise RaasError(
                f"SWE tasks need a container sandbox backend ({', '.join(CONTAINER_BACKENDS[:3])}); this service "
                f"runs {default.backend!r}: start it with --sandbox bwrap (or apptainer)",
                kind="sandbox_start_failed",
            )
        ref, image_dir = await self._image(task)
        s = self.settings
        repo_mb = await self._gates().repo_mb(image_dir, task.workdir)
        in_ram = repo_mb <= s.tmpfs_max_repo_mb
        prefix = task.workdir.rstrip("/") + "/"
        overrides: dict[str, Any] = {
            "image": str(image_dir),
            "workdir": task.workdir,
            "network": False,
            "memory_mb": s.memory_mb,
            "max_procs": s.max_procs,
            "start_timeout_s": s.start_timeout_s,
            "command_timeout_s": s.command_timeout_s,
        }
        if not isinstance(default, NamespaceSandboxConfig):
            return ref, overrides  # docker/podman: the engine's own writable layer holds every change
        writable = list(default.writable)
        if hide:  # hidden dirs outside the repository become writable copies, removed before RUN
            writable += [
                p
                for p in task.hidden_paths
                if not p.startswith(prefix) and (image_dir / p.lstrip("/")).is_dir()
            ]
        return ref, {
            **overrides,
            "writable": writable,
            "root_writes": "tmpfs" if in_ram else "host",
            "disk_mb": int(s.disk_mb_base + s.disk_mb_per_repo_mb * repo_mb) if in_ram else None,
        }

    async def _open(
        self, task: SweTask, sandboxes: JobSandboxes, *, hide: bool, overrides: dict[str, Any] | None = None
    ) -> Sandbox:
        if overrides is None:
            ref, overrides = await self._overrides(task, sandboxes, hide=hide)
        else:
            ref = image_reference(task, self.settings.image_template)
        async with self._gates().start_slot(ref):
            return await sandboxes.open(**overrides)

    # -- stages ----------------------------------------------------------------------------------------

    def shared_init_key(self, job: Job) -> str | None:
        """INIT's preparation depends on the image (part of every layer's key), the base commit, the
        workdir and the hidden paths: samples of one instance share it."""
        if not self.settings.share_init:
            return None
        task = parse_task(job.instance)
        return json.dumps(["swe-init-1", task.base_commit, task.workdir, sorted(task.hidden_paths)])

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        task = parse_task(job.instance)
        _, overrides = await self._overrides(task, sandboxes, hide=True)
        async with self.group_share(job, sandboxes, **overrides) as share:
            if share.preparing:  # in a throwaway sandbox on disk, copied from the host, then closed
                prep = await self._open(
                    task, sandboxes, hide=True, overrides={**overrides, "root_writes": "host"}
                )
                try:
                    state = await prepare_repo(
                        prep, task.workdir, task.base_commit, hidden=task.hidden_paths, stage="init"
                    )
                    await share.publish(prep, dataclasses.asdict(state))
                finally:
                    await prep.close()
            if share.shared:
                sandbox = await self._open(
                    task, sandboxes, hide=True, overrides={**overrides, "seed": share.seed}
                )
                state = RepoState(**share.meta)
            else:  # no sharing in this service
                sandbox = await self._open(task, sandboxes, hide=True, overrides=overrides)
                state = await prepare_repo(
                    sandbox, task.workdir, task.base_commit, hidden=task.hidden_paths, stage="init"
                )
        env = Env(job=job, sandboxes=sandboxes, sandbox=sandbox)
        env.data.update(task=task, base=state.base)
        env.data["init"] = {
            "reset": state.reset,
            "excluded_untracked": len(state.excluded),
            "hidden": state.hidden,
            "shared": share.shared,
        }
        return env

    def tool_set(self) -> ToolSet:
        """The agent's tools (a hook: a scaffold of a subclass brings its own)."""
        return ToolSet(self.settings.tools)

    def examples(self) -> list[Message]:
        """A scripted exchange shown before the issue (none here; a subclass's scaffold may demonstrate)."""
        return []

    def prompt(self, task: SweTask) -> str:
        return self.settings.prompt_template.format(
            problem_statement=task.problem_statement, workdir=task.workdir, instance_id=task.instance_id
        )

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        if env.sandbox is None:
            raise RaasError("the SWE run stage has no sandbox", kind="handler_error", stage="run")
        task: SweTask = env.data["task"]
        out = await run_agent(
            job,
            env.sandbox,
            llm,
            self.tool_set(),
            llm.agent,
            system_prompt=llm.agent.system_prompt or self.settings.system_prompt,
            user_prompt=self.prompt(task),
            examples=self.examples(),
        )
        started = time.monotonic()
        patch = await self.extract_patch(env.sandbox, task, env.data["base"])
        out.artifacts.update(
            git_patch=patch.text,
            patch_files=patch.files,
            patch_bytes=patch.size,
            patch_extract_s=round(time.monotonic() - started, 3),
        )
        if patch.too_large:
            out.artifacts["patch_too_large"] = True
        if patch.binary_fallback:
            out.artifacts["patch_binary_fallback"] = True
        if patch.problem:
            out.artifacts["patch_problem"] = patch.problem
        return out

    async def extract_patch(self, sandbox: Sandbox, task: SweTask, base: str) -> Any:
        """The policy's patch (:func:`.patch.extract_patch`); a hook for tests and subclasses."""
        return await extract_patch(
            sandbox,
            workdir=task.workdir,
            base=base,
            exclude=task.protected_files,
            cap_bytes=self.settings.patch_cap_bytes,
        )

    async def prewarm_eval(self, job: Job, sandboxes: JobSandboxes) -> Sandbox | None:
        if not self.settings.prewarm:
            return None
        task = parse_task(job.instance)
        sandbox = await self._open(task, sandboxes, hide=False)
        await prepare_repo(sandbox, task.workdir, task.base_commit, hidden=[], stage="eval")
        return sandbox

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        run = env.run_output
        if run is None:
            raise RaasError("the SWE eval stage has no run output", kind="handler_error", stage="eval")
        task: SweTask = env.data.get("task") or parse_task(job.instance)
        patch = str(run.artifacts.get("git_patch") or "")
        verdict = self._without_tests(run.artifacts, patch)
        source = "none"
        if verdict is None:
            sandbox, source = await self._eval_sandbox(task, env)
            verdict = await evaluate_task(
                sandbox,
                task,
                patch,
                timeout_s=self.settings.test_timeout_s,
                log_cap=self.settings.test_log_cap_bytes,
                grader=self._gates().grading,
            )
        details = {"outcome": verdict.outcome, "eval_sandbox": source, **verdict.details}
        if env.prewarm_error:
            details["prewarm_error"] = env.prewarm_error
        artifacts: dict[str, Any] = {"outcome": verdict.outcome}
        if verdict.test_log is not None:
            artifacts["test_log"] = verdict.test_log
        resolved = verdict.resolved
        return EvalOutput(
            reward=1.0 if resolved else 0.0, resolved=resolved, artifacts=artifacts, details=details
        )

    def _without_tests(self, artifacts: dict[str, Any], patch: str) -> Verdict | None:
        """Outcomes decided without running anything."""
        if artifacts.get("patch_too_large"):
            return Verdict("patch_too_large", {"patch_bytes": artifacts.get("patch_bytes")})
        if artifacts.get("patch_problem"):
            return Verdict("no_patch", {"problem": str(artifacts["patch_problem"])[:2000]})
        if not patch.strip() and not self.settings.run_empty_patch:
            return Verdict("empty_patch")
        return None

    async def _eval_sandbox(self, task: SweTask, env: Env) -> tuple[Sandbox, str]:
        prewarmed = env.prewarmed
        if isinstance(prewarmed, Sandbox) and prewarmed.alive:
            return prewarmed, "prewarmed"
        sandbox = await self._open(task, env.sandboxes, hide=False)
        await prepare_repo(sandbox, task.workdir, task.base_commit, hidden=[], stage="eval")
        return sandbox, "fresh"
