"""Code task benchmark; prints one JSON document and writes it to bench/results/code_tasks.json.

1. ``humaneval_eval``: every HumanEval problem's canonical solution, and a stub that returns None, judged by
   the code handler's EVAL stage exactly as in production (a fresh bwrap sandbox per evaluation, the
   harness, the hidden ``check``): how many pass, and the time one evaluation takes (sandbox start
   included).
2. ``service``: HumanEval jobs through the real service (HTTP, bwrap sandboxes) with a scripted policy
   (vLLM wire protocol, in-process) that inserts the canonical body with the editor, runs the function
   once with bash and submits: rewards, and the per-stage times the service reports (queue, INIT, RUN,
   EVAL, total).

Usage: ``python bench/code_tasks.py [--problems 164] [--jobs 8] [--concurrency 2] [--out FILE]``
(run from the repository root, as root or an unprivileged user; the test image must be built).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.agent.scripted import completions, tool_call  # noqa: E402
from tests.conftest import TEST_IMAGE_SPEC  # noqa: E402
from tests.doubles.scripted_llm import Completion, CompletionRequest, ScriptedLLM  # noqa: E402

from raas.agent.config import AgentConfig  # noqa: E402
from raas.core.trajectory import RunOutput  # noqa: E402
from raas.llm.models import prepare_tokenizer  # noqa: E402
from raas.llm.tokenizer import ChatTokenizer  # noqa: E402
from raas.pipeline.config import ServiceConfig  # noqa: E402
from raas.sandbox import SandboxManager  # noqa: E402
from raas.sandbox.config import make_config  # noqa: E402
from raas.sandbox.images import rootfs_path  # noqa: E402
from raas.tasks.base import Env, Job, JobSandboxes  # noqa: E402
from raas.tasks.code import CodeHandler  # noqa: E402
from raas.tasks.code.humaneval import humaneval  # noqa: E402
from raas.tasks.verify import shutdown as shutdown_verifiers  # noqa: E402

OUT = Path(__file__).parent / "results" / "code_tasks.json"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50": pct(values, 0.5),
        "p95": pct(values, 0.95),
        "max": round(max(values), 4),
        "mean": round(statistics.fmean(values), 4),
    }


async def humaneval_eval(image: Path, n: int, concurrency: int) -> dict[str, Any]:
    problems = humaneval(n)
    state = Path(tempfile.mkdtemp(prefix="raas-bench-code-"))
    manager = SandboxManager(state / "sandboxes")
    config = make_config(backend="bwrap", image=str(image), start_timeout_s=120)
    handler = CodeHandler()
    gate = asyncio.Semaphore(concurrency)

    async def judge(problem: dict[str, Any], solution: str) -> tuple[float | None, float, str]:
        async with gate:
            sandboxes = JobSandboxes(manager, config, owner=f"bench-{problem['task_id']}")
            job = Job(job_id="bench", instance=problem, trajectory_id="t")
            env = Env(job=job, sandboxes=sandboxes)
            env.run_output = RunOutput(finish_reason="finish_tool", artifacts={"solution": solution})
            started = time.monotonic()
            try:
                out = await handler.eval(job, env)
            finally:
                await sandboxes.close_all()
            return out.reward, time.monotonic() - started, str(out.details.get("detail", ""))

    try:
        started = time.monotonic()
        gold = await asyncio.gather(*(judge(p, p["prompt"] + p["canonical_solution"]) for p in problems))
        stub = await asyncio.gather(*(judge(p, p["prompt"] + "    return None\n") for p in problems))
        wall = time.monotonic() - started
    finally:
        await manager.close_all()
    return {
        "problems": len(problems),
        "canonical_passed": sum(1 for r, _, _ in gold if r == 1.0),
        "canonical_failures": {
            p["task_id"]: d for p, (r, _, d) in zip(problems, gold, strict=True) if r != 1.0
        },
        "stub_passed": sum(1 for r, _, _ in stub if r == 1.0),
        "eval_s": summary([t for _, t, _ in gold + stub]),
        "evaluations_per_s": round(2 * len(problems) / wall, 3),
        "concurrency": concurrency,
    }


def scripted_gold(tok: ChatTokenizer, problems: list[dict[str, Any]]) -> Any:
    """A responder that plays each problem's gold solution through the tools (keyed by its task id)."""
    scripts: dict[str, list[Completion]] = {}
    for p in problems:
        marker = f"# task {p['task_id']}"
        call = f"from solution import {p['entry_point']} as f; print(f.__name__)"
        scripts[marker] = completions(
            tok,
            [
                tool_call(
                    "str_replace_editor",
                    command="insert",
                    path="/workspace/solution.py",
                    insert_line=p["prompt"].count("\n"),
                    new_str=p["canonical_solution"].rstrip("\n"),
                ),
                tool_call("bash", command=f'cd /workspace && python3 -c "{call}"'),
                tool_call("submit"),
            ],
        )

    def respond(req: CompletionRequest) -> Completion:
        prompt = tok.decode(req.prompt_ids)
        marker = next(m for m in scripts if m + "\n" in prompt)
        return scripts[marker][prompt.count("<|im_start|>assistant") - 1]

    return respond


async def service_jobs(image: Path, n: int) -> dict[str, Any]:
    import httpx

    from raas.cli.inprocess import service_in_process

    tok = ChatTokenizer.from_pretrained(prepare_tokenizer())
    problems = [{**p, "prompt": f"# task {p['task_id']}\n{p['prompt']}"} for p in humaneval(n)]
    state = Path(tempfile.mkdtemp(prefix="raas-bench-code-svc-"))
    config = ServiceConfig(
        state_dir=state,
        sandbox={"backend": "bwrap", "image": str(image), "start_timeout_s": 120},
        tokenizer_dir=prepare_tokenizer(),
        agent=AgentConfig(max_turns=4, max_tokens_per_turn=2048),
        init_workers=2,
        run_workers=4,
        eval_workers=2,
        shutdown_grace_s=0.0,
    )
    async with ScriptedLLM(scripted_gold(tok, problems)) as llm, service_in_process(config) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            (await c.post("/v1/llm/servers", json={"address": llm.url})).raise_for_status()
            started = time.monotonic()
            jobs = [{"job_id": f"he-{i}", "instance": p} for i, p in enumerate(problems)]
            (await c.post("/v1/jobs:batch", json={"jobs": jobs})).raise_for_status()
            results = []
            for job in jobs:
                while True:
                    r = await c.get(f"/v1/jobs/{job['job_id']}/result", params={"wait": 60})
                    if r.status_code == 200:
                        results.append(r.json())
                        break
            wall = time.monotonic() - started
    timing = {
        k: summary([r["timing"][k] for r in results])
        for k in ("queue_s", "init_s", "run_s", "eval_s", "total_s")
    }
    return {
        "jobs": n,
        "completed": sum(1 for r in results if r["status"] == "completed"),
        "reward_1": sum(1 for r in results if r["reward"] == 1.0),
        "timing_s": timing,
        "jobs_per_s": round(n / wall, 3),
        "workers": {"init": 2, "run": 4, "eval": 2},
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=164)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    image = rootfs_path(TEST_IMAGE_SPEC)
    if not (image / "usr").is_dir():
        raise SystemExit(f"the test image {image} is not built (run the sandbox tests as root once)")
    doc: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "uid": os.geteuid()},
        "command": f"python bench/code_tasks.py --problems {args.problems} --jobs {args.jobs} "
        f"--concurrency {args.concurrency}",
    }
    try:
        doc["humaneval_eval"] = await humaneval_eval(image, args.problems, args.concurrency)
        doc["service"] = await service_jobs(image, args.jobs)
    finally:
        await shutdown_verifiers()
    text = json.dumps(doc, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    asyncio.run(main())
