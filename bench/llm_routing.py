"""Prefix-cache hits per routing policy: GRPO groups over two real llama.cpp servers.

G groups x n samples. A group's samples share one long prompt (the chat template with a ~P-token problem
statement of their own); each sample runs T turns: the shared prompt, then (T > 1) the previous prompt +
its sampled output + a short tool result. Samples are started by ``--concurrency`` workers in group order,
as the service's RUN workers take jobs, and each is one balancer trajectory (``trajectory_id``, released
at its end) of its group (``group_id``). For each policy of :class:`raas.llm.RoutingConfig` the two
embedded llama-servers (SmolLM2-135M, 1 thread each) are started fresh, so no policy inherits another's
cache.

llama.cpp reports per request how many prompt tokens it took from its cache (``timings.cache_n``) and how
many it evaluated (``timings.prompt_n``); the sums over all requests are ``cached_tokens`` (prefill saved)
and ``prefill_tokens``. ``hit_rate`` = cached / prompt tokens; ``min_prefill_tokens`` is what a single
server with an unbounded cache would still have to evaluate (each group's prompt once, each later turn's
new tokens once).

Writes ``bench/results/llm_routing.json`` and prints it. Usage:
``python bench/llm_routing.py [--groups 4] [--samples 8] [--prompt-tokens 600] [--turns 1]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from raas.llm import ChatTokenizer, LLMBalancer, RoutingConfig, SamplingParams
from raas.llm.embedded import EmbeddedServer
from raas.llm.models import default_tokenizer_dir

OUT = Path(__file__).parent / "results" / "llm_routing.json"
POLICIES = ("group", "trajectory", "round_robin")


def problem(tok: ChatTokenizer, group: int, tokens: int) -> str:
    """A problem statement of about ``tokens`` tokens, different for every group from its first words."""
    lines = [
        f"Problem {group}. A warehouse tracks crates on numbered shelves; answer the question at the end."
    ]
    i = 0
    while len(tok.encode("\n".join(lines))) < tokens:
        lines.append(
            f"Shelf {i} of aisle {group} holds {(group * 31 + i * 7) % 97} crates of item {i * 3 + group}."
        )
        i += 1
    lines.append("How many crates are on the shelves with an even number?")
    return "\n".join(lines)


async def sample(
    bal: LLMBalancer, tok: ChatTokenizer, text: str, group: int, index: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    tid = f"g{group}-s{index}"
    conv = tok.conversation([{"role": "user", "content": text}])
    rows = []
    try:
        for turn in range(args.turns):
            prompt = list(conv.prompt_ids)
            sampling = SamplingParams(max_tokens=args.max_tokens, seed=group * 1000 + index * 10 + turn)
            res = await bal.generate(prompt, sampling, trajectory_id=tid, group_id=f"g{group}")
            timings = res.extra.get("timings") or {}
            rows.append(
                {
                    "group": group,
                    "turn": turn,
                    "server": res.server,
                    "prompt": len(prompt),
                    "cached": int(timings.get("cache_n") or 0),
                    "prefill": int(timings.get("prompt_n") or 0),
                    "new": len(prompt) - (rows[-1]["prompt"] + rows[-1]["output"] if rows else 0),
                    "output": len(res.output_ids),
                }
            )
            conv.add_assistant(res.output_ids, res.logprobs)
            conv.add_messages([{"role": "user", "content": f"Tool output {index}.{turn}: ok. Continue."}])
    finally:
        bal.release(tid)
    return rows


def summarize(rows: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    prompt = sum(r["prompt"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    first = [r for r in rows if r["turn"] == 0]
    later = [r for r in rows if r["turn"] > 0]
    first_prompt = {r["group"]: r["prompt"] for r in first}
    servers_per_group: dict[int, set[str]] = {}
    for r in first:
        servers_per_group.setdefault(r["group"], set()).add(r["server"])
    per_server: dict[str, int] = {}
    for r in rows:
        per_server[r["server"]] = per_server.get(r["server"], 0) + 1
    return {
        "requests": len(rows),
        "prompt_tokens": prompt,
        "prefill_tokens": sum(r["prefill"] for r in rows),
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 3) if prompt else None,
        "first_turn_hit_rate": round(
            sum(r["cached"] for r in first) / max(1, sum(r["prompt"] for r in first)), 3
        ),
        "later_turn_hit_rate": round(sum(r["cached"] for r in later) / sum(r["prompt"] for r in later), 3)
        if later
        else None,
        "min_prefill_tokens": sum(first_prompt.values()) + sum(r["new"] for r in later),
        "servers_per_group_mean": round(
            sum(len(s) for s in servers_per_group.values()) / max(1, len(servers_per_group)), 2
        ),
        "requests_per_server": sorted(per_server.values(), reverse=True),
        "wall_s": round(wall_s, 2),
    }


async def run_policy(
    policy: str, tok: ChatTokenizer, texts: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    servers = [
        EmbeddedServer(parallel=args.parallel, ctx_per_slot=args.ctx_per_slot, threads=args.threads)
        for _ in range(2)
    ]
    routing = RoutingConfig(
        mode=policy, group_slack=args.group_slack, group_load_factor=args.group_load_factor
    )
    try:
        for s in servers:
            await s.start()
        async with LLMBalancer(health_interval_s=0, routing=routing) as bal:
            for s in servers:
                bal.add(s.url)
            queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
            for g in range(args.groups):
                for i in range(args.samples):
                    queue.put_nowait((g, i))
            rows: list[dict[str, Any]] = []

            async def worker() -> None:
                while not queue.empty():
                    g, i = queue.get_nowait()
                    rows.extend(await sample(bal, tok, texts[g], g, i, args))

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            wall = time.perf_counter() - start
            counts = bal.group_counts()
    finally:
        for s in servers:
            await s.stop()
    return {**summarize(rows, wall), "groups_left": counts}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tok = ChatTokenizer.from_pretrained(default_tokenizer_dir())
    texts = [problem(tok, g, args.prompt_tokens) for g in range(args.groups)]
    result: dict[str, Any] = {
        "benchmark": "llm_routing",
        "groups": args.groups,
        "samples": args.samples,
        "turns": args.turns,
        "prompt_tokens_first_turn": len(tok.conversation([{"role": "user", "content": texts[0]}]).prompt_ids),
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "servers": 2,
        "parallel_per_server": args.parallel,
        "threads_per_server": args.threads,
        "group_slack": args.group_slack,
        "group_load_factor": args.group_load_factor,
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in os.getloadavg()],
        "policies": {},
    }
    for policy in args.policies:
        result["policies"][policy] = await run_policy(policy, tok, texts, args)
        print(json.dumps({policy: result["policies"][policy]}), flush=True)
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    base = result["policies"].get("round_robin")
    if base:
        for stats in result["policies"].values():
            stats["prefill_saved_vs_round_robin"] = base["prefill_tokens"] - stats["prefill_tokens"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--turns", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16, help="samples in flight (RUN workers)")
    parser.add_argument("--parallel", type=int, default=4, help="llama.cpp slots per server")
    parser.add_argument("--ctx-per-slot", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--group-slack", type=int, default=RoutingConfig().group_slack)
    parser.add_argument("--group-load-factor", type=float, default=RoutingConfig().group_load_factor)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
