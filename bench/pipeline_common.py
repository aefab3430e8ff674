"""What the pipeline benchmarks share: the benchmark task, a service around it, and the scripted policy
in a process of its own."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from pathlib import Path
from typing import Any, ClassVar

import httpx

from raas.core.jobs import JobRequest
from raas.core.trajectory import EvalOutput, RunOutput, TokenTrajectory
from raas.llm import SamplingParams
from raas.pipeline.config import ServiceConfig
from raas.pipeline.service import RolloutService
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler
from raas.tasks.registry import HandlerRegistry

REPO = Path(__file__).resolve().parents[1]


class BenchHandler(TaskHandler):
    """The benchmark task: instance fields ``sandbox``, ``init_s``, ``turns``, ``tokens``, ``bash``, ``eval_s``."""

    name: ClassVar[str] = "bench.task"

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        env = Env(job=job, sandboxes=sandboxes)
        if job.instance.get("sandbox"):
            env.sandbox = await sandboxes.open()
        if job.instance.get("init_s"):
            await asyncio.sleep(float(job.instance["init_s"]))
        return env

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        prompt = [1, 2, 3, 4]
        response: list[int] = []
        sampling = SamplingParams(max_tokens=int(job.instance.get("tokens", 8)))
        for _ in range(int(job.instance.get("turns", 1))):
            res = await llm.balancer.generate(prompt, sampling, trajectory_id=job.trajectory_id)
            response += res.output_ids
            prompt = prompt + res.output_ids + [5]
        if env.sandbox is not None and job.instance.get("bash", True):
            await env.sandbox.tools.bash("echo ok")
        llm.balancer.release(job.trajectory_id)
        return RunOutput(
            token_trajectory=TokenTrajectory(
                prompt_ids=[1, 2, 3, 4],
                response_ids=response,
                loss_mask=[1] * len(response),
                logprobs=[0.0] * len(response),
            ),
            finish_reason="finish_tool",
        )

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        if job.instance.get("eval_s"):
            await asyncio.sleep(float(job.instance["eval_s"]))
        return EvalOutput(reward=1.0, resolved=True)


async def make_service(state: Path, balancer: Any, sandbox: dict[str, Any], **cfg: Any) -> RolloutService:
    config = ServiceConfig(
        state_dir=state,
        sandbox=sandbox,
        shutdown_grace_s=0.0,
        max_pending=100_000,
        result_ttl_s=None,
        max_results=None,
        **cfg,
    )
    handlers = HandlerRegistry()
    handlers.register(BenchHandler, replace=True)
    service = RolloutService(config, balancer=balancer, handlers=handlers)
    await service.start()
    return service


async def run_all(service: RolloutService, instances: list[dict[str, Any]]) -> list[Any]:
    accepted = await service.submit_many([JobRequest(instance=i) for i in instances])
    return [await service.wait(a.job_id, None) for a in accepted]


class PolicyProcess:
    """The capacity-limited scripted policy in a process of its own, so its timing does not share the
    event loop (or the GIL) with the system under test; statistics are read over HTTP."""

    def __init__(self, p: dict[str, Any]) -> None:
        self.p = p
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""
        self.http = httpx.AsyncClient(timeout=30)

    async def __aenter__(self) -> PolicyProcess:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        args = ["--port", str(port), "--tokens", str(self.p["tokens"])]
        if self.p.get("capacity"):
            args += ["--capacity", str(self.p["capacity"]), "--tokens-per-s", str(self.p["tokens_per_s"])]
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.doubles.scripted_llm", *args, cwd=REPO, env=env,
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = (await asyncio.wait_for(self.proc.stdout.readline(), 60)).decode()
        if not line.startswith("SCRIPTED_LLM_READY"):
            raise RuntimeError(f"scripted policy did not start: {line!r}")
        self.url = line.split()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()

    async def reset(self) -> None:
        (await self.http.post(self.url + "/_scripted/reset")).raise_for_status()

    async def stats(self) -> dict[str, float]:
        r = await self.http.get(self.url + "/_scripted/stats")
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]
