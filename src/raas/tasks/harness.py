"""The ``harness`` task: an unmodified third-party agent works on a repository in a sandbox, talking to the
policy through the agent gateway; the repository's final state is graded.

Instance (``data_source: "harness"``)::

    {"agent": "mini-swe-agent" | "openai-tools" | "command",
     "command": "...",                 # agent "command": any shell command (run in the workdir)
     "task": "the problem statement",
     "files": {"path/in/repo": "text", ...},   # the repository, committed with git at INIT
     "check": "python3 -m pytest -q",  # EVAL: run on a fresh copy with the agent's changes; exit 0 = solved
     "tests": {"path": "text", ...},   # optional: written only for EVAL (hidden from the agent)
     "timeout_s": 600,                 # the agent command's wall-clock limit
     "max_steps": 30,                  # the agent's own step limit (mini-swe-agent, openai-tools)
     "env": {"NAME": "value"}}         # optional: more environment for the agent

RUN: the gateway opens a session for the job and exposes it inside the sandbox (``OPENAI_BASE_URL``,
``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``, ``RAAS_MODEL``, ...; the sandbox
reaches nothing else); the agent's command runs in the workdir with the instance as JSON on stdin and in
``$RAAS_INSTANCE``, the task text in ``$RAAS_TASK_FILE``, under ``timeout_s``. Its record is the gateway's
(turns, segments, drift report); the repository's changes are kept as a patch (``artifacts.patch``).
EVAL: a fresh sandbox gets the original files, the patch, then the ``tests`` files, and runs ``check``.

Agents: ``mini-swe-agent`` (PyPI ``mini-swe-agent``, its ``mini`` CLI pointed at the gateway through
LiteLLM's OpenAI provider) and ``openai-tools`` (a minimal OpenAI-SDK tool-calling agent, the example of
the contract: ``raas/tasks/agents/openai_tool_agent.py``) run from the harness image, a Debian image with a
venv holding both (:data:`HARNESS_IMAGE`, built once by root: ``raas image build --packages
git,python3,python3-venv --pip anthropic==2.10.0,mini-swe-agent==2.4.6,openai==3.51.0``). With the ``local`` backend they run
from the service's own Python environment.

An infrastructure failure the gateway answered to the agent (inference server down, a timeout) fails the
job: what the agent did next is not the policy's doing, so it is never scored.
"""

from __future__ import annotations

import json
import shlex
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from raas.core.trajectory import EvalOutput, RunOutput
from raas.errors import RaasError
from raas.gateway import Gateway
from raas.sandbox.config import image_of
from raas.sandbox.images import PIP_VENV, ImageSpec, rootfs_path
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler

if TYPE_CHECKING:
    from raas.sandbox import Sandbox

HARNESS_IMAGE = ImageSpec(
    suite="bookworm",
    packages=("git", "python3", "python3-venv"),
    pip=("anthropic==2.10.0", "mini-swe-agent==2.4.6", "openai==3.51.0"),
)
"""The image the harness agents run in (bwrap, apptainer)."""

AGENTS = ("mini-swe-agent", "openai-tools", "command")
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_STEPS = 30
TASK_DIR = ".raas-task"
EXIT_MARK = "__RAAS_AGENT_EXIT__="
LOG_TAIL = 20000
GIT = "git -c user.name=raas -c user.email=raas@localhost -c commit.gpgsign=false"


def _mini_command(max_steps: int) -> str:
    """mini-swe-agent's own CLI, unattended, its LiteLLM model pointed at the gateway."""
    specs = [
        "mini.yaml",
        f"agent.step_limit={max_steps}",
        "model.model_kwargs.api_base=$OPENAI_BASE_URL",
        "model.model_kwargs.api_key=$OPENAI_API_KEY",
        "environment.cwd=$PWD",
    ]
    conf = " ".join(f'-c "{s}"' for s in specs)
    return (
        "MSWEA_CONFIGURED=true MSWEA_SILENT_STARTUP=1 MSWEA_COST_TRACKING=ignore_errors "
        'MSWEA_GLOBAL_CONFIG_DIR="$RAAS_TASK_DIR/mswea" LITELLM_LOCAL_MODEL_COST_MAP=True '
        f'"$RAAS_AGENT_BIN/mini" -y --exit-immediately -m "openai/$RAAS_MODEL" {conf} '
        '-t "$(cat "$RAAS_TASK_FILE")" -o "$RAAS_TASK_DIR/mini.traj.json"'
    )


class HarnessHandler(TaskHandler):
    """See the module docstring."""

    name: ClassVar[str] = "harness"
    needs_tokenizer: ClassVar[bool] = True
    image_spec: ClassVar[ImageSpec] = HARNESS_IMAGE

    # -- submit ---------------------------------------------------------------------------------------------

    def validate_instance(self, instance: dict[str, Any]) -> None:
        agent = instance.get("agent")
        if agent not in AGENTS:
            raise RaasError(f"harness instance needs 'agent', one of {', '.join(AGENTS)}", kind="bad_request")
        if agent == "command" and not (
            isinstance(instance.get("command"), str) and instance["command"].strip()
        ):
            raise RaasError("harness agent 'command' needs a non-empty 'command'", kind="bad_request")
        self.validate_external_instance(instance)

    def validate_external_instance(self, instance: dict[str, Any]) -> None:
        """The repository, task and check; ``agent`` and ``command`` say how raas runs one, so an agent
        outside raas needs neither."""
        if not isinstance(instance.get("task"), str) or not instance["task"].strip():
            raise RaasError("harness instance needs a non-empty string 'task'", kind="bad_request")
        if not isinstance(instance.get("check"), str) or not instance["check"].strip():
            raise RaasError("harness instance needs a 'check' command (exit 0 = solved)", kind="bad_request")
        for field in ("files", "tests"):
            files = instance.get(field, {})
            if not isinstance(files, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in files.items()
            ):
                raise RaasError(f"harness '{field}' must map relative paths to text", kind="bad_request")
            for path in files:
                parts = Path(path).parts
                if not path or path.startswith("/") or ".." in parts or (parts and parts[0] == ".git"):
                    raise RaasError(
                        f"harness {field} path {path!r} must stay inside the repository", kind="bad_request"
                    )
        env = instance.get("env", {})
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and k.isidentifier() and isinstance(v, str) for k, v in env.items()
        ):
            raise RaasError("harness 'env' must map variable names to strings", kind="bad_request")
        timeout = instance.get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise RaasError("harness 'timeout_s' must be a positive number", kind="bad_request")
        steps = instance.get("max_steps", DEFAULT_MAX_STEPS)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise RaasError("harness 'max_steps' must be a positive integer", kind="bad_request")

    # -- INIT -------------------------------------------------------------------------------------------------

    def sandbox_overrides(self, sandboxes: JobSandboxes) -> dict[str, Any]:
        """The harness image for container backends, unless the service's image already has a harness venv."""
        default = sandboxes.default
        if default.backend in ("local", "docker", "podman"):
            return {}
        image = image_of(default)
        if image and (Path(image) / PIP_VENV.lstrip("/") / "bin" / "python").exists():
            return {}
        path = rootfs_path(self.image_spec)
        if not (path / "usr").is_dir():
            raise RaasError(
                f"the harness image {path} is not built; build it once as root: raas image build --packages "
                f"{','.join(self.image_spec.packages)} --pip {','.join(self.image_spec.pip)}",
                kind="sandbox_start_failed",
                stage="init",
            )
        return {"image": str(path)}

    async def open_repo(self, job: Job, sandboxes: JobSandboxes, files: dict[str, str]) -> Sandbox:
        """A sandbox whose workdir holds ``files`` committed as one git commit."""
        sandbox = await sandboxes.open(**self.sandbox_overrides(sandboxes))
        if files:
            await sandbox.tools.upload_bytes(_tar(files), _workdir(sandbox))
        r = await sandbox.tools.bash(
            f"cd {shlex.quote(_workdir(sandbox))} && git init -q && git add -A && {GIT} commit -q --allow-empty -m raas-task",
            timeout=120,
        )
        if r.exit_code != 0:
            raise RaasError(
                f"preparing the repository failed: {r.output[-2000:]}", kind="handler_error", stage="init"
            )
        return sandbox

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        self.validate_external_instance(
            job.instance
        )  # the agent's fields: RUN (an external rollout has none)
        sandbox = await self.open_repo(job, sandboxes, job.instance.get("files", {}))
        return Env(job=job, sandboxes=sandboxes, sandbox=sandbox)

    # -- RUN ---------------------------------------------------------------------------------------------------

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        self.validate_instance(job.instance)
        sandbox = env.sandbox
        if sandbox is None:
            raise RaasError("harness run stage has no sandbox", kind="handler_error", stage="run")
        inst = job.instance
        gateway = llm.gateway if isinstance(llm.gateway, Gateway) else None
        own = gateway is None
        if gateway is None:
            gateway = Gateway(llm.balancer, llm.require_tokenizer())
        session = gateway.open_session(job, agent=llm.agent)
        try:
            gateway_env = await gateway.expose(session, sandbox)
            exit_code, timed_out, log = await self._run_agent(job, sandbox, gateway_env, inst)
        finally:
            await gateway.close_session(session)
            if own:
                await gateway.aclose()
            release = getattr(llm.balancer, "release", None)
            if release is not None:
                release(job.job_id)
        if session.infra_error is not None:
            err = session.infra_error
            raise RaasError(
                f"the gateway could not serve the agent ({err.kind}): {err.message}",
                kind=err.kind,
                stage="run",
            )
        finish = session.finish_reason or ("agent_timeout" if timed_out else "agent_exit")
        out = session.run_output(finish)
        out.artifacts["agent"] = {
            "name": inst["agent"],
            "exit_code": exit_code,
            "timed_out": timed_out,
            "log_tail": log.replace(session.key, "<rollout key>"),
        }
        out.artifacts["patch"] = await self._patch(sandbox)
        return out

    def external_output(self, job: Job, env: Env, out: RunOutput, final: dict[str, Any]) -> RunOutput:
        """An agent outside raas worked on its own copy of the repository: EVAL applies the ``patch`` it
        sent at close (a ``git diff`` against the instance's files) exactly as it applies a sandboxed
        agent's changes."""
        out = super().external_output(job, env, out, final)
        out.artifacts["patch"] = str(final.get("patch") or "")
        return out

    async def _run_agent(
        self, job: Job, sandbox: Sandbox, gateway_env: dict[str, str], inst: dict[str, Any]
    ) -> tuple[int | None, bool, str]:
        home = (await sandbox.tools.bash('printf %s "$HOME"', timeout=30)).output.strip() or "/root"
        task_dir = f"{home}/{TASK_DIR}"
        await sandbox.tools.write_file(f"{task_dir}/instance.json", json.dumps(inst, ensure_ascii=False))
        await sandbox.tools.write_file(f"{task_dir}/task.md", str(inst["task"]))
        agent = inst["agent"]
        if agent == "openai-tools":
            code = resources.files("raas.tasks.agents").joinpath("openai_tool_agent.py").read_bytes()
            await sandbox.tools.write_file(f"{task_dir}/agent.py", code)
        bin_dir = str(Path(sys.executable).parent) if sandbox.backend_name == "local" else f"{PIP_VENV}/bin"
        env = {
            **inst.get("env", {}),
            **gateway_env,
            "RAAS_TASK_DIR": task_dir,
            "RAAS_INSTANCE": f"{task_dir}/instance.json",
            "RAAS_TASK_FILE": f"{task_dir}/task.md",
            "RAAS_AGENT_BIN": bin_dir,
            "RAAS_MAX_STEPS": str(int(inst.get("max_steps", DEFAULT_MAX_STEPS))),
        }
        command = self.agent_command(agent, inst)
        exports = "; ".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
        timeout = float(inst.get("timeout_s", DEFAULT_TIMEOUT_S))
        script = (
            f"cd {shlex.quote(_workdir(sandbox))}; {exports}; "
            f'( {command} ) < "$RAAS_INSTANCE" > "$RAAS_TASK_DIR/agent.log" 2>&1; echo "{EXIT_MARK}$?"'
        )
        r = await sandbox.tools.bash(script, session="raas-agent", timeout=timeout, output_cap=4096)
        exit_code: int | None = None
        for line in r.output.splitlines():
            if line.startswith(EXIT_MARK) and line[len(EXIT_MARK) :].strip().isdigit():
                exit_code = int(line[len(EXIT_MARK) :].strip())
        tail = await sandbox.tools.bash(
            f'tail -c {LOG_TAIL} "{task_dir}/agent.log" 2>/dev/null', timeout=30, output_cap=LOG_TAIL + 1024
        )
        return exit_code, bool(r.timed_out), tail.output

    def agent_command(self, agent: str, inst: dict[str, Any]) -> str:
        """The shell command that starts ``agent`` (run in the workdir, the gateway in its environment)."""
        if agent == "mini-swe-agent":
            return _mini_command(int(inst.get("max_steps", DEFAULT_MAX_STEPS)))
        if agent == "openai-tools":
            return '"$RAAS_AGENT_BIN/python" "$RAAS_TASK_DIR/agent.py"'
        return str(inst["command"])

    async def _patch(self, sandbox: Sandbox) -> str:
        """Everything the agent changed in the repository, as one binary-safe git diff."""
        r = await sandbox.tools.bash(
            f"cd {shlex.quote(_workdir(sandbox))} && git add -A >/dev/null && git diff --cached --binary HEAD",
            timeout=120,
            output_cap=8 * 1024 * 1024,
        )
        if r.exit_code != 0:
            raise RaasError(
                f"collecting the agent's changes failed: {r.output[-2000:]}",
                kind="handler_error",
                stage="run",
            )
        if r.truncated:
            raise RaasError("the agent's changes are larger than 8 MiB", kind="handler_error", stage="run")
        return r.output

    # -- EVAL --------------------------------------------------------------------------------------------------

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        run = env.run_output
        if run is None:
            raise RaasError("harness eval stage has no run output", kind="handler_error", stage="eval")
        inst = job.instance
        sandbox = await self.open_repo(job, env.sandboxes, inst.get("files", {}))
        workdir = shlex.quote(_workdir(sandbox))
        patch = str(run.artifacts.get("patch") or "")
        details: dict[str, Any] = {"patch_bytes": len(patch.encode())}
        if patch.strip():
            await sandbox.tools.write_file(
                "/tmp/raas-agent.patch", patch if patch.endswith("\n") else patch + "\n"
            )
            r = await sandbox.tools.bash(
                f"cd {workdir} && git apply --binary /tmp/raas-agent.patch", timeout=120
            )
            if r.exit_code != 0:  # the agent's own diff always applies to the commit it started from
                raise RaasError(
                    f"the agent's patch does not apply: {r.output[-2000:]}",
                    kind="handler_error",
                    stage="eval",
                )
        if inst.get("tests"):
            await sandbox.tools.upload_bytes(_tar(inst["tests"]), _workdir(sandbox))
        timeout = float(inst.get("check_timeout_s", 300))
        r = await sandbox.tools.bash(
            f"cd {workdir} && {inst['check']}", session="raas-check", timeout=timeout
        )
        details.update(
            check_exit_code=r.exit_code, check_timed_out=r.timed_out, check_output=r.output[-4000:]
        )
        solved = r.exit_code == 0 and not r.timed_out
        return EvalOutput(reward=1.0 if solved else 0.0, resolved=solved, details=details)


def _workdir(sandbox: Sandbox) -> str:
    return str(sandbox.workspace) if sandbox.backend_name in ("local",) else sandbox.config.workdir


def _tar(files: dict[str, str]) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            info.mode = 0o755 if text.startswith("#!") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
