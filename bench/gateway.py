"""Latency the agent gateway adds to a model call: an OpenAI Chat Completions request through the gateway
vs the direct token call raas's own agent loop makes (``LLMBalancer.generate``), per request, p50/p99,
with 1 and 64 rollouts at once.

Setup: the scripted policy (``tests.doubles.scripted_llm``: the vLLM wire protocol, ``--tokens`` fixed IDs
per reply, no compute) in a process of its own; the balancer and the gateway in this process (one Unix
socket endpoint per rollout, as in a sandbox); the agents in another process (``--client``), raw HTTP
over the rollouts' sockets with httpx, each re-sending its whole growing history every turn as agents do
(``turns`` per rollout, so every request after the first is an append-only continuation). The direct
baseline runs the same conversations (same prompt lengths, same sampled tokens) as token calls from this
process. ``added`` is gateway minus direct at the same percentile; it includes the client's own HTTP and
JSON work, which an agent pays with any OpenAI-compatible server. On these 2-core machines the three
processes share the cores (and other work on the machine: ``load_before``), so wall-clock numbers include
CPU contention; ``service_cpu_ms_per_request`` (this process's CPU time per request: balancer, plus the
gateway's HTTP, rendering, parsing and recording on the gateway path) is the cost that does not depend on
it.

``--sandbox bwrap`` adds one more path for 1 rollout: the client inside a bwrap sandbox (stdlib urllib),
through the in-sandbox loopback forwarder to the rollout's socket.

Usage: ``python bench/gateway.py [--turns 20] [--tokens 32] [--sandbox bwrap]``; writes
``bench/results/gateway.json`` and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "gateway.json"
SYSTEM = "You are a helpful assistant working in a sandbox."
USER = "Please look at the repository and fix the failing test."
CLIENT_CPU: list[float] = []
"""CPU seconds each client process spent in its conversations (the agents' own HTTP and JSON work)."""


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "requests": len(samples),
        "p50_ms": round(pct(samples, 0.5) * 1e3, 3),
        "p99_ms": round(pct(samples, 0.99) * 1e3, 3),
        "mean_ms": round(statistics.fmean(samples) * 1e3, 3),
    }


# -- the agents (a process of their own) ---------------------------------------------------------------------


async def client_main(config: dict[str, Any]) -> None:
    import httpx

    latencies: list[float] = []
    warm = config["warmup"]

    async def rollout(path: str, key: str) -> None:
        transport = httpx.AsyncHTTPTransport(uds=path)
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://gw", timeout=120, headers=headers
        ) as http:
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": USER},
            ]
            for turn in range(config["turns"]):
                body = {"model": "policy", "messages": messages, "max_tokens": config["tokens"]}
                start = time.perf_counter()
                r = await http.post("/v1/chat/completions", json=body)
                elapsed = time.perf_counter() - start
                if r.status_code != 200:
                    raise RuntimeError(r.text)
                reply = r.json()["choices"][0]["message"]
                if turn >= warm:
                    latencies.append(elapsed)
                messages += [reply, {"role": "user", "content": "Continue."}]

    cpu = time.process_time()
    await asyncio.gather(*(rollout(p, k) for p, k in config["endpoints"]))
    print(json.dumps({"latencies": latencies, "cpu_s": time.process_time() - cpu}))


# -- the service side -----------------------------------------------------------------------------------------


async def start_policy(tokens: int) -> tuple[asyncio.subprocess.Process, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.doubles.scripted_llm", "--port", str(port), "--tokens", str(tokens),
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    if not line.startswith("SCRIPTED_LLM_READY"):
        raise RuntimeError(f"scripted policy did not start: {line!r}")
    return proc, line.split()[1]


async def direct(balancer: Any, tok: Any, rollouts: int, turns: int, tokens: int, warmup: int) -> list[float]:
    """The same conversations as token calls: prompt(t+1) = prompt(t) + sampled + the next user turn."""
    from raas.llm import SamplingParams

    first = tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}], add_generation_prompt=True
    )
    conv0 = tok.conversation([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
    latencies: list[float] = []
    sampling = SamplingParams(max_tokens=tokens)

    async def rollout(i: int) -> None:
        conv = tok.conversation([{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}])
        assert conv.prompt_ids == first == conv0.prompt_ids
        for turn in range(turns):
            start = time.perf_counter()
            res = await balancer.generate(conv.prompt_ids, sampling, trajectory_id=f"direct-{i}")
            elapsed = time.perf_counter() - start
            if turn >= warmup:
                latencies.append(elapsed)
            conv.add_assistant(res.output_ids, res.logprobs)
            conv.add_messages([{"role": "user", "content": "Continue."}])
        balancer.release(f"direct-{i}")

    await asyncio.gather(*(rollout(i) for i in range(rollouts)))
    return latencies


async def through_gateway(
    gateway: Any, rollouts: int, turns: int, tokens: int, warmup: int, tmp: Path
) -> tuple[list[float], list[Any]]:
    from raas.agent.config import AgentConfig
    from raas.core.jobs import Job

    sessions, endpoints = [], []
    agent = AgentConfig(max_turns=turns + 1, max_tokens_per_turn=tokens, context_budget=1_000_000)
    for i in range(rollouts):
        session = gateway.open_session(Job(job_id=f"b{i}", instance={}, trajectory_id=f"gw-{i}"), agent=agent)
        path = str(tmp / f"{rollouts}-{i}.sock")
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        sock.listen(64)
        await gateway.serve_socket(session, sock, path)
        sessions.append(session)
        endpoints.append((path, session.key))
    config = {"endpoints": endpoints, "turns": turns, "tokens": tokens, "warmup": warmup}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", json.dumps(config), stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )  # fmt: skip
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the client process failed ({proc.returncode})")
    reply = json.loads(out)
    CLIENT_CPU.append(reply["cpu_s"])
    outputs = [s.run_output() for s in sessions]
    for s in sessions:
        await gateway.close_session(s)
    return reply["latencies"], outputs


async def in_sandbox(gateway: Any, backend: str, turns: int, tokens: int, warmup: int) -> list[float]:
    """One rollout whose agent (stdlib urllib) runs inside a sandbox, through the loopback forwarder."""
    from raas.agent.config import AgentConfig
    from raas.core.jobs import Job
    from raas.sandbox import SandboxManager, make_config
    from raas.sandbox.images import ImageSpec, rootfs_path

    image = rootfs_path(ImageSpec(packages=("python3", "python3-ipykernel", "python3-jupyter-client")))
    manager = SandboxManager(Path(tempfile.mkdtemp(prefix="raas-bench-", dir="/var/tmp")))
    agent = AgentConfig(max_turns=turns + 1, max_tokens_per_turn=tokens, context_budget=1_000_000)
    session = gateway.open_session(Job(job_id="sb", instance={}, trajectory_id="gw-sb"), agent=agent)
    script = f"""
import json, os, time, urllib.request
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
messages = [{{"role": "system", "content": {SYSTEM!r}}}, {{"role": "user", "content": {USER!r}}}]
out = []
for turn in range({turns}):
    body = json.dumps({{"model": "policy", "messages": messages, "max_tokens": {tokens}}}).encode()
    req = urllib.request.Request(base + "/chat/completions", data=body,
                                 headers={{"Authorization": "Bearer " + key, "Content-Type": "application/json"}})
    start = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        reply = json.loads(r.read())["choices"][0]["message"]
    if turn >= {warmup}:
        out.append(time.perf_counter() - start)
    messages += [reply, {{"role": "user", "content": "Continue."}}]
print(json.dumps(out))
"""
    try:
        async with manager.sandbox(make_config(backend=backend, image=str(image)), owner="bench") as sb:
            env = await gateway.expose(session, sb)
            await sb.tools.write_file("/tmp/agent.py", script)
            exports = " ".join(f"{k}={v}" for k, v in env.items())
            r = await sb.tools.bash(
                f"env {exports} python3 /tmp/agent.py", timeout=600, output_cap=10_000_000
            )
            if r.exit_code != 0:
                raise RuntimeError(r.output[-2000:])
            return list(json.loads(r.output.strip().splitlines()[-1]))
    finally:
        await gateway.close_session(session)
        await manager.close_all()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from raas.gateway import Gateway
    from raas.llm import ChatTokenizer, LLMBalancer
    from raas.llm.models import prepare_tokenizer

    load_before = round(os.getloadavg()[0], 2)
    tok = ChatTokenizer.from_pretrained(prepare_tokenizer())
    proc, url = await start_policy(args.tokens)
    tmp = Path(tempfile.mkdtemp(prefix="raas-gw-bench-"))
    results: dict[str, Any] = {}
    try:
        async with LLMBalancer(health_interval_s=0) as balancer:
            balancer.add(url)
            gateway = Gateway(balancer, tok)
            for rollouts in (1, 64):
                turns = args.turns if rollouts == 1 else max(6, args.turns // 2)
                repeat = 5 if rollouts == 1 else 1  # 1 rollout: several conversations for enough samples
                direct_s: list[float] = []
                gateway_s: list[float] = []
                cpu = {"direct": 0.0, "gateway": 0.0}
                CLIENT_CPU.clear()
                for _ in range(repeat):
                    t0 = time.process_time()
                    direct_s += await direct(balancer, tok, rollouts, turns, args.tokens, args.warmup)
                    t1 = time.process_time()
                    lat, outputs = await through_gateway(
                        gateway, rollouts, turns, args.tokens, args.warmup, tmp
                    )
                    t2 = time.process_time()
                    cpu["direct"] += t1 - t0
                    cpu["gateway"] += t2 - t1
                    gateway_s += lat
                    assert all(len(o.turns) == turns and o.segments == [] for o in outputs)
                d, g = summary(direct_s), summary(gateway_s)
                calls = repeat * rollouts * turns
                results[f"rollouts_{rollouts}"] = {
                    "turns_per_rollout": turns,
                    "direct": d,
                    "gateway": g,
                    "added_p50_ms": round(g["p50_ms"] - d["p50_ms"], 3),
                    "added_p99_ms": round(g["p99_ms"] - d["p99_ms"], 3),
                    "service_cpu_ms_per_request": {
                        "direct": round(cpu["direct"] / calls * 1e3, 3),
                        "gateway": round(cpu["gateway"] / calls * 1e3, 3),
                    },
                    "client_cpu_ms_per_request": round(sum(CLIENT_CPU) / calls * 1e3, 3),
                }
            if args.sandbox:
                samples: list[float] = []
                for _ in range(3):
                    samples += await in_sandbox(gateway, args.sandbox, args.turns, args.tokens, args.warmup)
                one = results["rollouts_1"]["direct"]
                s = summary(samples)
                results[f"rollouts_1_in_{args.sandbox}_sandbox"] = {
                    "gateway": s,
                    "added_p50_ms": round(s["p50_ms"] - one["p50_ms"], 3),
                    "added_p99_ms": round(s["p99_ms"] - one["p99_ms"], 3),
                }
            await gateway.aclose()
    finally:
        proc.terminate()
        await proc.wait()
    return {
        "benchmark": "gateway",
        "load_before": load_before,
        "tokens_per_reply": args.tokens,
        "warmup_turns_dropped": args.warmup,
        "cpus": os.cpu_count(),
        **results,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sandbox", choices=["bwrap", "apptainer"], default=None)
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if args.client is not None:
        asyncio.run(client_main(json.loads(args.client)))
        return
    result = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
