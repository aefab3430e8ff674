"""DAPO dynamic sampling: batch-by-batch generate-then-filter vs the asynchronous sampler vs carry-over.

One simulated workload through the real stack (a raas service process, the trainer-side RolloutClient over
HTTP, and a capacity-limited vLLM-protocol policy double in a process of its own):

* a stream of prompts whose pass rates make about half of the groups all-0 or all-1 (25% never solved,
  25% always solved, 50% solved with probability uniform in [0.2, 0.8]);
* each rollout makes ``turns`` LLM calls with log-normal lengths and log-normal tool time in between;
  its reward is a Bernoulli draw with the prompt's pass rate. Lengths, tool times and rewards are seeded by
  (prompt, sample), so every variant sees the same outcomes for the same prompt;
* the policy server double holds ``capacity`` sequences at ``tokens_per_s`` each (a GPU's batch slots);
* each training step needs ``target`` informative groups of ``group_size``; between steps the trainer
  "trains" for ``train_s`` seconds and syncs weights (pause → ``sync_s`` → new version → resume).

Variants, all with the same budget of ``inflight`` groups: (a) ``batch``: submit ``inflight`` groups, wait
for all of them, keep the informative ones, repeat until ``target`` are in (the surplus of the last round
is discarded); (b) ``async``: DynamicSampler with ``max_inflight_groups=inflight`` without carry-over
(surplus cancelled); (c) ``carry``: the same with carry-over (work keeps running through training and the
sync). Reported per variant: the time the trainer waited for its batches over all steps, end-to-end wall
time, rollouts finished / used / wasted, jobs cancelled, LLM slot utilization, the CPU time of the service,
the policy double and the trainer process (on a busy machine a CPU-bound run measures contention, not
sampling).
``speedup`` = (a) wait time / (b) wait time; ``speedup_carry`` = (a) / (c), from the means over ``repeats``
interleaved runs of each variant.

Usage: ``python bench/dapo.py [--quick] [--set KEY=VALUE ...] [--out FILE]``; prints JSON and writes
bench/results/dapo.json (not for ``--quick`` or ``--set`` runs).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import platform
import random
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import httpx

from raas.core.trajectory import EvalOutput, RunOutput, TokenTrajectory, Turn
from raas.llm import SamplingParams
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler
from raas.trainer.types import version_number

REPO = Path(__file__).resolve().parents[1]


def lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


class DapoBenchTask(TaskHandler):
    """The simulated rollout (runs inside the service process): see the module docstring."""

    name: ClassVar[str] = "bench.dapo"

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        return Env(job=job, sandboxes=sandboxes)

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        inst = job.instance
        rng = random.Random(f"{inst['instance_id']}:{job.trajectory_id}")
        seq = [1, 2, 3, 4]
        response: list[int] = []
        mask: list[int] = []
        turns: list[Turn] = []
        try:
            for t in range(int(inst["turns"])):
                n = max(8, min(int(lognormal(rng, inst["tok_median"], inst["tok_sigma"])), 4096))
                res = await llm.balancer.generate(seq, SamplingParams(max_tokens=n), trajectory_id=job.job_id)
                turns.append(
                    Turn(
                        index=t,
                        prompt_ids=seq if t == 0 else [5],
                        prompt_is_delta=t > 0,
                        prompt_len=len(seq),
                        output_ids=res.output_ids,
                        logprobs=res.logprobs,
                        finish_reason=str(res.finish_reason),
                        weight_version=res.weight_version,
                        server=res.server,
                    )
                )
                seq = seq + res.output_ids + [5]
                response += [*res.output_ids, 5]
                mask += [1] * len(res.output_ids) + [0]
                await asyncio.sleep(lognormal(rng, inst["tool_median_s"], inst["tool_sigma"]))
        finally:
            llm.balancer.release(job.job_id)
        env.data["reward"] = float(rng.random() < float(inst["p"]))
        return RunOutput(
            turns=turns,
            token_trajectory=TokenTrajectory(
                prompt_ids=[1, 2, 3, 4], response_ids=response, loss_mask=mask, logprobs=[0.0] * len(mask)
            ),
            finish_reason="finish_tool",
        )

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        return EvalOutput(reward=env.data["reward"])


class LearningDapoTask(DapoBenchTask):
    """:class:`DapoBenchTask` whose pass rate rises with the weight version that sampled the rollout."""

    name: ClassVar[str] = "bench.dapo.learning"

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        inst = job.instance
        run = env.run_output
        versions = [version_number(t.weight_version) or 0 for t in (run.turns if run else [])]
        p = min(1.0, float(inst["p"]) + float(inst["drift"]) * (max(versions) if versions else 0))
        rng = random.Random(f"reward:{inst['instance_id']}:{job.trajectory_id}:{max(versions, default=0)}")
        return EvalOutput(reward=float(rng.random() < p))


def prompts(p: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The same endless prompt stream for every variant."""
    for k in itertools.count():
        r = random.Random(1000 + k)
        kind = r.random()
        rate = 0.0 if kind < 0.25 else 1.0 if kind < 0.5 else r.uniform(0.2, 0.8)
        yield {
            "data_source": DapoBenchTask.name,
            "instance_id": f"q{k}",
            "p": rate,
            "turns": p["turns"],
            "tok_median": p["tok_median"],
            "tok_sigma": p["tok_sigma"],
            "tool_median_s": p["tool_median_s"],
            "tool_sigma": p["tool_sigma"],
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """The policy double and one raas service, each a process of its own (own GIL, own event loop)."""

    def __init__(self, p: dict[str, Any], state: Path, handler: type[TaskHandler] = DapoBenchTask) -> None:
        self.p, self.state, self.handler = p, state, handler
        self.procs: list[asyncio.subprocess.Process] = []
        self.llm_url = ""
        self.url = ""
        self.http = httpx.AsyncClient(timeout=30)

    async def __aenter__(self) -> Processes:
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        p = self.p
        llm = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.doubles.scripted_llm", "--port", str(free_port()), "--tokens", "100000",
            "--capacity", str(p["capacity"]), "--tokens-per-s", str(p["tokens_per_s"]),
            "--prefill-s", str(p["prefill_s"]), cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        self.procs.append(llm)
        assert llm.stdout is not None
        line = (await asyncio.wait_for(llm.stdout.readline(), 60)).decode()
        if not line.startswith("SCRIPTED_LLM_READY"):
            raise RuntimeError(f"policy double did not start: {line!r}")
        self.llm_url = line.split()[1]
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        svc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "raas.api", "--port", str(port), "--state-dir", str(self.state),
            "--llm", self.llm_url, "--init-workers", "64", "--run-workers", "512", "--eval-workers", "64",
            "--max-pending", "8192", "--shutdown-grace", "0", "--log-level", "warning",
            "--handler", f"{self.handler.name}=bench.dapo:{self.handler.__name__}", cwd=REPO, env=env,
        )  # fmt: skip
        self.procs.append(svc)
        for _ in range(600):
            if svc.returncode is not None:
                raise RuntimeError("the raas service exited during start-up")
            try:
                if (await self.http.get(self.url + "/healthz")).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("the raas service did not come up")

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()
        for proc in reversed(self.procs):
            if proc.returncode is None:
                proc.terminate()
                await proc.wait()

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds used so far by the service, the policy double and this (trainer) process."""
        tick = os.sysconf("SC_CLK_TCK")

        def of(pid: int) -> float:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / tick

        return {
            "service": of(self.procs[1].pid),
            "policy": of(self.procs[0].pid),
            "trainer": time.process_time(),
        }

    async def llm_stats(self, reset: bool = False) -> dict[str, float]:
        r = await self.http.post(self.llm_url + "/_scripted/reset") if reset else None
        r = await self.http.get(self.llm_url + "/_scripted/stats")
        return r.json()  # type: ignore[no-any-return]


async def run_variant(name: str, procs: Processes, p: dict[str, Any]) -> dict[str, Any]:
    from raas.trainer.dapo import DynamicSampler
    from raas.trainer.rollout import RolloutClient

    B, G = p["target"], p["group_size"]
    data = prompts(p)
    waits: list[float] = []
    used = wasted = cancelled = finished_groups = 0
    staleness: dict[int, int] = {}
    version = 0
    await procs.llm_stats(reset=True)
    cpu0 = procs.cpu_s()
    started = time.monotonic()
    async with RolloutClient(procs.url, run_id=f"{name}{int(started)}") as client:
        await client.set_weight_version("0")
        sampler = DynamicSampler(
            client, data, G, B, max_inflight_groups=p["inflight"], carry_over=name == "carry", max_staleness=1
        )
        for _ in range(p["steps"]):
            t0 = time.monotonic()
            if name == "batch":
                accepted = []
                while len(accepted) < B:
                    groups = [client.new_group(next(data), G, version=version) for _ in range(p["inflight"])]
                    await client.submit_groups(groups)
                    done = [await client.next_group() for _ in groups]
                    finished_groups += len(done)
                    for g in done:
                        if g.informative:
                            accepted.append(g)
                        else:
                            wasted += len(g.results)
                wasted += sum(len(g.results) for g in accepted[B:])
                batch = accepted[:B]
            else:
                batch, stats = await sampler.next_step()
                wasted += stats.rollouts_wasted
                cancelled += stats.cancelled_jobs
                for s, n in stats.staleness.items():
                    staleness[s] = staleness.get(s, 0) + n
            waits.append(time.monotonic() - t0)
            used += sum(len(g.results) for g in batch)
            await asyncio.sleep(p["train_s"])  # the trainer's optimizer step

            async def sync() -> None:
                await asyncio.sleep(p["sync_s"])  # loading the new weights into the inference servers

            if name == "batch":
                version += 1
                await client.weight_sync(str(version), sync)
            else:
                version = await sampler.update_weights(sync)
        await sampler.close()
        wall = time.monotonic() - started
        llm = await procs.llm_stats()
        results = client.stats.results
    cpu = {k: round(v - cpu0[k], 1) for k, v in procs.cpu_s().items()}
    return {
        "wait_s": round(sum(waits), 2),
        "wait_per_step_s": [round(w, 2) for w in waits],
        "wall_s": round(wall, 2),
        "rollouts_finished": results,
        "rollouts_used": used,
        "rollouts_wasted": wasted,
        "jobs_cancelled": cancelled,
        "llm_utilization": round(llm["utilization"], 4),
        "llm_idle_fraction": round(1 - llm["utilization"], 4),
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "cpu_s": cpu,
        "load_average": round(os.getloadavg()[0], 2),
    }


async def main_async(p: dict[str, Any]) -> dict[str, Any]:
    """Every variant ``repeats`` times, interleaved (a, b, c, a, b, c, ...), so a change in the machine's
    load during the run hits all three alike."""
    runs: dict[str, list[dict[str, Any]]] = {"batch": [], "async": [], "carry": []}
    with tempfile.TemporaryDirectory(prefix="raas-bench-dapo-") as tmp:
        async with Processes(p, Path(tmp) / "svc") as procs:
            for _ in range(p["repeats"]):
                for name, done in runs.items():
                    done.append(await run_variant(name, procs, p))
                    print(name, json.dumps(done[-1]), file=sys.stderr, flush=True)
    out: dict[str, Any] = {}
    for name, done in runs.items():
        numeric = [k for k, v in done[0].items() if isinstance(v, int | float)]
        mean = {k: round(sum(r[k] for r in done) / len(done), 4) for k in numeric}
        out[name] = {**mean, "runs": done}
    return out


def apply_overrides(ap: argparse.ArgumentParser, p: dict[str, Any], items: list[str]) -> None:
    """``--set KEY=VALUE`` items onto the parameters ``p``, each converted to its default's type."""
    for item in items:
        key, _, value = item.partition("=")
        if key not in p:
            ap.error(f"unknown parameter {key!r}")
        p[key] = type(p[key])(value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps and smaller batches")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "dapo.json")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a parameter")
    args = ap.parse_args()
    p: dict[str, Any] = {
        "steps": 4,
        "target": 8,
        "group_size": 8,
        "inflight": 16,
        "turns": 2,
        "tok_median": 50,
        "tok_sigma": 0.8,
        "tool_median_s": 0.6,
        "tool_sigma": 1.0,
        "capacity": 16,
        "tokens_per_s": 50.0,
        "prefill_s": 0.02,
        "train_s": 3.0,
        "sync_s": 0.5,
        "repeats": 2,
    }
    if args.quick:
        p.update(steps=2, target=4, inflight=8, group_size=4, repeats=1)
    apply_overrides(ap, p, args.set)
    load = os.getloadavg()[0]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # killed: stop the service and double too
    variants = asyncio.run(main_async(p))
    out = {
        "params": p,
        "speedup": round(variants["batch"]["wait_s"] / variants["async"]["wait_s"], 2),
        "speedup_carry": round(variants["batch"]["wait_s"] / variants["carry"]["wait_s"], 2),
        "speedup_wall": round(variants["batch"]["wall_s"] / variants["async"]["wall_s"], 2),
        "speedup_wall_carry": round(variants["batch"]["wall_s"] / variants["carry"]["wall_s"], 2),
        "variants": variants,
        "load_average_at_start": load,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    text = json.dumps(out, indent=1)
    print(text)
    if not args.quick and not args.set:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
