"""The built-in ``code`` task: write a Python solution in a sandbox; hidden tests judge it in a fresh one.

INIT opens the RUN sandbox (for a function problem, ``solution.py`` starts as the prompt: signature and
docstring). RUN is the agent with bash, the editor and ``submit``; when it ends, the solution file is read
out of the sandbox before the pipeline closes it. EVAL opens a **fresh** sandbox, uploads the solution and
:mod:`raas.tasks.code.sandbox_harness`, and runs the hidden tests there: the tests never enter the RUN
sandbox, and stdin/stdout expected outputs never enter any sandbox (the host compares).

Rewards: a function problem scores 1.0 when ``check(candidate)`` returns, else 0.0. A stdin/stdout
problem scores 1.0 when every test passes (``reward_mode = "all"``, the default) or the fraction of tests
passed (``"fraction"``). A program that times out, crashes or prints the wrong thing fails that test (a
policy failure, reward 0 for it); a dead sandbox or a broken harness raises a typed error, so the job is
filtered instead.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import re
import secrets
import shlex
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from raas.agent.loop import run_agent
from raas.agent.tools import ToolSet
from raas.core.policy import StagePolicy, StageTimeouts
from raas.core.trajectory import EvalOutput, RunOutput
from raas.errors import RaasError, is_infrastructure
from raas.sandbox.config import python_of
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler
from raas.tasks.code.grading import decode_output, outputs_match
from raas.tasks.code.instances import CodeSpec, IOTest, parse, reward_mode_of

SOLUTION_NAME = "solution.py"
EVAL_DIR = ".raas-eval"
"""Where EVAL puts the harness, the solution and the test inputs: a dir in the fresh sandbox's workdir."""
MAX_SOLUTION_BYTES = 256 * 1024
HARNESS_SLACK_S = 15.0
"""Extra seconds the host waits for the harness beyond the candidate's own limits (interpreter start,
sandbox load) before declaring the run stuck."""
PER_TEST_SLACK_S = 2.0
MAX_BATCH = 32
DETAIL_TESTS = 50
"""Per-test entries kept in ``eval_details.tests`` (the counts cover every test)."""

SYSTEM_FUNCTION = (
    "You are a careful Python programmer working in a sandbox with bash and a file editor. Implement the "
    "function the user describes in {path}: the file already holds its signature and docstring. Keep the "
    "signature, replace the body with your implementation, and test it by running Python with bash. When "
    "the implementation is complete, call the submit tool."
)
SYSTEM_STDIO = (
    "You are a careful competitive programmer working in a sandbox with bash and a file editor. Write a "
    "complete Python 3 program to {path} that reads the input from standard input and prints the answer "
    "to standard output, exactly in the format the problem asks for. Test it with bash on the examples. "
    "When the program is complete, call the submit tool."
)

_FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def last_code_block(text: str | None) -> str | None:
    """The last fenced code block of ``text`` (a policy that answers in prose instead of writing the file)."""
    if not text:
        return None
    blocks = _FENCED.findall(text)
    return blocks[-1] if blocks else None


def sandbox_workdir(sandbox: Any) -> str:
    """The absolute path the sandbox's tools work in: its configured workdir, except for the ``local``
    backend, which works in a private host dir of its own (and ignores ``workdir``)."""
    if getattr(sandbox, "backend_name", "") == "local":
        return str(sandbox.workspace)
    return str(sandbox.config.workdir)


def harness_source() -> bytes:
    return importlib.resources.files("raas.tasks.code").joinpath("sandbox_harness.py").read_bytes()


@dataclass
class _TestResult:
    index: int
    status: str
    time_s: float | None = None
    stderr: str = ""

    def as_detail(self) -> dict[str, Any]:
        out: dict[str, Any] = {"test": self.index, "status": self.status}
        if self.time_s is not None:
            out["time_s"] = self.time_s
        if self.stderr and self.status not in ("passed", "wrong_answer"):
            out["stderr"] = self.stderr
        return out


def _verdict(text: str, nonce: str) -> dict[str, Any] | None:
    prefix = f"RAAS-VERDICT {nonce} "
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith(prefix):
            try:
                data = json.loads(line[len(prefix) :])
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


def _command(sandbox: Any, root: str, mode: str, spec_path: str) -> str:
    """The shell command that runs the harness with the image's python3."""
    parts = [python_of(sandbox.config), f"{root}/harness.py", mode, spec_path]
    return " ".join(shlex.quote(p) for p in parts)


def _killed(exit_code: int | None) -> bool:
    """The harness died of a signal (128 + n in the shell): only the program under test can do that."""
    return exit_code is not None and exit_code > 128


class CodeHandler(TaskHandler):
    """Instances: a function problem (HumanEval: ``prompt``, ``entry_point``, ``test``) or a stdin/stdout
    problem (statement + test cases); see :mod:`raas.tasks.code.instances` and docs/tasks/code.md."""

    name: ClassVar[str] = "code"
    needs_tokenizer: ClassVar[bool] = True
    policy: ClassVar[StagePolicy] = StagePolicy(stage_timeouts=StageTimeouts(init=180, eval=600))
    tools: ClassVar[list[str]] = ["bash", "str_replace_editor", "submit"]
    eval_budget_s: ClassVar[float] = 300.0
    """Time EVAL spends running stdin/stdout tests; tests left when it runs out count as failed (a slow
    program must not turn into a stage timeout, which would be filtered rather than scored 0)."""

    def validate_instance(self, instance: dict[str, Any]) -> None:
        parse(instance)

    # -- INIT / RUN ---------------------------------------------------------------------------------------

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        spec = parse(job.instance)
        if job.external_rollout:  # its agent runs outside raas: no sandbox for it (EVAL opens its own)
            return Env(job=job, sandboxes=sandboxes)
        sandbox = await sandboxes.open()
        env = Env(job=job, sandboxes=sandboxes, sandbox=sandbox)
        if spec.kind == "function":
            await sandbox.tools.write_file(self._solution_path(env), spec.prompt)
        return env

    def _solution_path(self, env: Env) -> str:
        if env.sandbox is None:
            raise RaasError("code task stage has no sandbox", kind="handler_error")
        return f"{sandbox_workdir(env.sandbox).rstrip('/')}/{SOLUTION_NAME}"

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        if env.sandbox is None:
            raise RaasError("code run stage has no sandbox", kind="handler_error", stage="run")
        spec = parse(job.instance)
        path = self._solution_path(env)
        if spec.kind == "function":
            system = SYSTEM_FUNCTION.format(path=path)
            user = f"Complete the function `{spec.entry_point}` in {path}:\n\n```python\n{spec.prompt}\n```"
        else:
            system = SYSTEM_STDIO.format(path=path)
            user = f"{spec.statement.strip()}\n\nWrite your program to {path}."
        out = await run_agent(
            job,
            env.sandbox,
            llm,
            ToolSet(self.tools),
            llm.agent,
            system_prompt=llm.agent.system_prompt or system,
            user_prompt=user,
        )
        source, origin = await self._harvest(env, spec, out)
        out.artifacts["solution_source"] = origin
        if source is not None and len(source.encode("utf-8")) > MAX_SOLUTION_BYTES:
            out.artifacts["solution_source"] = "too_large"
            source = None
        out.artifacts["solution"] = source
        return out

    async def _harvest(self, env: Env, spec: CodeSpec, out: RunOutput) -> tuple[str | None, str | None]:
        """The solution: the file the policy wrote, else the last code block of its answer or last message."""
        assert env.sandbox is not None
        path = self._solution_path(env)
        text: str | None = None
        try:
            size = await self._file_size(env.sandbox, path)
            if size is not None and size > MAX_SOLUTION_BYTES:
                return None, "too_large"  # never pulled into the service (a runaway write can be a GB)
            raw = await env.sandbox.tools.read_file(path)
            text = raw.decode("utf-8", errors="replace")
        except RaasError as exc:
            if is_infrastructure(exc.kind):
                exc.stage = exc.stage or "run"
                raise
            if exc.kind == "payload_too_large":
                return None, "too_large"
        untouched = text is None or not text.strip() or (spec.kind == "function" and text == spec.prompt)
        if not untouched:
            return text, "file"
        last = next((m.content for m in reversed(out.messages) if m.role == "assistant"), None)
        for where, candidate in (("answer", out.answer), ("message", last)):
            block = last_code_block(candidate)
            if block and block.strip():
                return block, where
        return (text, "file") if text and text.strip() else (None, None)

    async def _file_size(self, sandbox: Any, path: str) -> int | None:
        """The size of ``path`` in bytes (None when it cannot be told), from a shell of the handler's own."""
        session = "raas-harvest"
        try:
            result = await sandbox.tools.bash(
                f"stat -L -c %s -- {shlex.quote(path)} 2>/dev/null", session=session, timeout=30
            )
        finally:
            with contextlib.suppress(RaasError):
                await sandbox.tools.bash_close(session)
        words = result.output.split()
        return int(words[-1]) if words and words[-1].isdigit() else None

    # -- EVAL ---------------------------------------------------------------------------------------------

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        run = env.run_output
        if run is None:
            raise RaasError("code eval stage has no run output", kind="handler_error", stage="eval")
        spec = parse(job.instance)
        mode = spec.reward_mode
        if "reward_mode" in job.sampling_params:
            mode = reward_mode_of(job.sampling_params["reward_mode"], "sampling_params.reward_mode")
        source = run.artifacts.get("solution")
        if not isinstance(source, str) or not source.strip():
            why = run.artifacts.get("solution_source")
            reason = (
                f"the solution is larger than {MAX_SOLUTION_BYTES} bytes"
                if why == "too_large"
                else f"no solution was written to {SOLUTION_NAME}"
            )
            return EvalOutput(reward=0.0, resolved=False, details={"reason": reason, "reward_mode": mode})
        try:
            sandbox = await env.sandboxes.open()
            root = f"{sandbox_workdir(sandbox).rstrip('/')}/{EVAL_DIR}"
            await sandbox.tools.write_file(f"{root}/harness.py", harness_source())
            await sandbox.tools.write_file(f"{root}/{SOLUTION_NAME}", source)
            if spec.kind == "function":
                return await self._judge_function(sandbox, spec, root)
            return await self._run_stdio(sandbox, spec, mode, root)
        except RaasError as exc:
            exc.stage = exc.stage or "eval"
            raise

    async def _bash(self, sandbox: Any, command: str, timeout_s: float) -> Any:
        return await sandbox.tools.bash(command, session="raas-eval", timeout=timeout_s)

    async def _judge_function(self, sandbox: Any, spec: CodeSpec, root: str) -> EvalOutput:
        nonce = secrets.token_hex(16)
        spec_path = f"{root}/judge.json"
        job_spec = {
            "nonce": nonce,
            "prompt": spec.prompt,
            "test": spec.test,
            "entry_point": spec.entry_point,
            "solution": f"{root}/{SOLUTION_NAME}",
            "timeout": spec.time_limit_s,
            "memory_mb": spec.memory_mb,
            "workdir": f"{root}/work",
        }
        await sandbox.tools.write_file(spec_path, json.dumps(job_spec))
        started = time.monotonic()
        result = await self._bash(
            sandbox,
            _command(sandbox, root, "judge", spec_path),
            spec.time_limit_s + HARNESS_SLACK_S,
        )
        elapsed = round(time.monotonic() - started, 4)
        verdict = _verdict(result.output, nonce)
        details: dict[str, Any] = {"kind": "function", "entry_point": spec.entry_point, "eval_s": elapsed}
        if verdict is None:
            if result.timed_out:
                verdict = {"status": "timeout", "detail": "the judge did not finish (the candidate hung it)"}
            elif _killed(result.exit_code):
                verdict = {"status": "failed", "detail": f"the judge was killed (exit {result.exit_code})"}
            else:
                raise RaasError(
                    f"the evaluation harness failed (exit {result.exit_code}): {result.output[-500:]}",
                    kind="handler_error",
                    stage="eval",
                )
        status = str(verdict.get("status"))
        details.update(status=status, detail=str(verdict.get("detail", ""))[:500])
        if "calls" in verdict:
            details["calls"] = verdict["calls"]
        if status == "timeout":
            details["timed_out"] = True
        passed = status == "passed"
        return EvalOutput(reward=1.0 if passed else 0.0, resolved=passed, details=details)

    async def _run_stdio(self, sandbox: Any, spec: CodeSpec, mode: str, root: str) -> EvalOutput:
        tests = spec.tests
        results: dict[int, _TestResult] = {}
        started = time.monotonic()
        stop = mode == "all"
        batch_size, next_index, batch_no = 1, 0, 0
        out_of_budget = False
        while next_index < len(tests):
            if time.monotonic() - started > self.eval_budget_s:
                out_of_budget = True
                break
            batch = list(range(next_index, min(len(tests), next_index + batch_size)))
            next_index = batch[-1] + 1
            batch_no += 1
            for r in await self._run_batch(sandbox, spec, root, batch, batch_no, stop):
                results[r.index] = r
            if stop and any(results[i].status != "passed" for i in batch if i in results):
                break
            # All-pass mode starts small so a wrong program fails fast; then batches grow.
            batch_size = min(MAX_BATCH, batch_size * 2) if stop else MAX_BATCH
        for i in range(len(tests)):
            if i not in results:
                results[i] = _TestResult(i, "not_run")
        passed = sum(1 for r in results.values() if r.status == "passed")
        total = len(tests)
        reward = (1.0 if passed == total else 0.0) if mode == "all" else passed / total
        counts: dict[str, int] = {}
        for r in results.values():
            counts[r.status] = counts.get(r.status, 0) + 1
        ordered = [results[i] for i in range(total)]
        details: dict[str, Any] = {
            "kind": "stdio",
            "reward_mode": mode,
            "passed": passed,
            "total": total,
            "counts": counts,
            "time_limit_s": spec.time_limit_s,
            "eval_s": round(time.monotonic() - started, 4),
            "tests": [r.as_detail() for r in ordered if r.status != "passed"][:DETAIL_TESTS],
        }
        if counts.get("timeout"):
            details["timed_out"] = True
        if out_of_budget:
            details["reason"] = f"the evaluation budget of {self.eval_budget_s:g}s ran out"
        return EvalOutput(reward=reward, resolved=passed == total, details=details)

    async def _run_batch(
        self, sandbox: Any, spec: CodeSpec, root: str, batch: list[int], batch_no: int, stop_on_error: bool
    ) -> list[_TestResult]:
        base = f"{root}/b{batch_no}"
        entries = []
        for i in batch:
            test: IOTest = spec.tests[i]
            await sandbox.tools.write_file(f"{root}/in/{i}.in", test.input)
            entries.append(
                {
                    "id": i,
                    "input": f"{root}/in/{i}.in",
                    "output": f"{base}/{i}.out",
                    "stderr": f"{base}/{i}.err",
                    "cap": 2 * len(test.output.encode("utf-8")) + 4096,
                }
            )
        run_spec = {
            "solution": f"{root}/{SOLUTION_NAME}",
            "tests": entries,
            "timeout": spec.time_limit_s,
            "memory_mb": spec.memory_mb,
            "workdir": f"{root}/work",
            "stop_on_error": stop_on_error,
            "results": f"{base}/results.json",
        }
        await sandbox.tools.write_file(f"{base}/spec.json", json.dumps(run_spec))
        limit = len(batch) * (spec.time_limit_s + PER_TEST_SLACK_S) + HARNESS_SLACK_S
        result = await self._bash(sandbox, _command(sandbox, root, "run", f"{base}/spec.json"), limit)
        statuses = await self._read_results(sandbox, f"{base}/results.json")
        if statuses is None:
            if result.timed_out or _killed(result.exit_code):
                why = "the test runner was stopped (by the program under test?)"
                return [_TestResult(i, "runner_killed", stderr=why) for i in batch]
            raise RaasError(
                f"the evaluation harness failed (exit {result.exit_code}): {result.output[-500:]}",
                kind="handler_error",
                stage="eval",
            )
        out: list[_TestResult] = []
        for entry in statuses:
            index = entry.get("id")
            if not isinstance(index, int) or isinstance(index, bool) or index not in batch:
                continue
            status = str(entry.get("status"))
            time_s = entry.get("time_s") if isinstance(entry.get("time_s"), int | float) else None
            stderr = str(entry.get("stderr", ""))[-400:]
            if status == "ok":
                got = await self._read_output(sandbox, f"{base}/{index}.out")
                ok = got is not None and outputs_match(got, spec.tests[index].output, spec.float_tolerance)
                status = "passed" if ok else "wrong_answer"
            elif status == "error":
                status = "runtime_error"
            out.append(_TestResult(index, status, time_s, stderr))
        return out

    async def _read_results(self, sandbox: Any, path: str) -> list[dict[str, Any]] | None:
        try:
            data = json.loads(await sandbox.tools.read_file(path))
        except RaasError as exc:
            if is_infrastructure(exc.kind):
                raise
            return None
        except ValueError:
            return None
        return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else None

    async def _read_output(self, sandbox: Any, path: str) -> str | None:
        try:
            return decode_output(await sandbox.tools.read_file(path))
        except RaasError as exc:
            if is_infrastructure(exc.kind):
                raise
            return None
