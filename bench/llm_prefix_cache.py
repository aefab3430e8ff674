"""Prefix-cache hits with sticky routing vs per-request round robin across two real llama-servers.

K trajectories run T turns each against two embedded llama-server processes. Each turn's prompt is the
previous prompt + the sampled output + a tool result, so a server that saw the previous turn has all
but the new tokens in its KV cache. llama.cpp reports how many prompt tokens it reused
(``timings.cache_n``); the hit rate is reused / prompt tokens over all turns after the first.

* ``sticky``: :class:`raas.llm.LLMBalancer` with ``trajectory_id`` (pinned per trajectory).
* ``round_robin``: each request goes to the next server in turn, regardless of trajectory.

Writes ``bench/results/prefix_cache.json`` and prints it. Usage:
``python bench/llm_prefix_cache.py [--trajectories 8] [--turns 4] [--max-tokens 16]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

import httpx

from raas.llm import ChatTokenizer, LLMBalancer, SamplingParams
from raas.llm.embedded import EmbeddedServer
from raas.llm.models import default_tokenizer_dir
from raas.llm.servers import LlamaCppClient

OUT = Path(__file__).parent / "results" / "prefix_cache.json"


async def trajectory(
    tid: str, tok: ChatTokenizer, turns: int, sampling: SamplingParams, send: Any
) -> list[dict[str, int]]:
    conv = tok.conversation(
        [
            {"role": "system", "content": "You are an agent with a shell."},
            {"role": "user", "content": f"Task {tid}: find the largest file in /var/log."},
        ]
    )
    rows = []
    reusable = 0  # what a server that saw the previous turn could reuse: previous prompt + output
    for turn in range(turns):
        res = await send(tid, list(conv.prompt_ids), sampling)
        rows.append(
            {
                "turn": turn,
                "prompt": len(conv.prompt_ids),
                "cached": int(res.cached_tokens or 0),
                "reusable": reusable,
            }
        )
        reusable = len(conv.prompt_ids) + len(res.output_ids)
        conv.add_assistant(res.output_ids, res.logprobs)
        conv.add_messages(
            [{"role": "tool", "content": f"-rw-r--r-- 1 root root {1000 + turn} syslog.{turn}"}]
        )
    return rows


def summarize(rows: list[list[dict[str, int]]]) -> dict[str, Any]:
    later = [r for traj in rows for r in traj if r["turn"] > 0]
    prompt = sum(r["prompt"] for r in later)
    cached = sum(r["cached"] for r in later)
    reusable = sum(r["reusable"] for r in later)
    return {
        "turns_after_first": len(later),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 3) if prompt else None,
        "best_possible_hit_rate": round(reusable / prompt, 3) if prompt else None,
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    tok = ChatTokenizer.from_pretrained(default_tokenizer_dir())
    sampling = SamplingParams(max_tokens=args.max_tokens, seed=0)
    servers = [
        EmbeddedServer(parallel=args.parallel, ctx_per_slot=2048, threads=args.threads) for _ in range(2)
    ]
    result: dict[str, Any] = {
        "benchmark": "llm_prefix_cache",
        "trajectories": args.trajectories,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
    }
    try:
        for s in servers:
            await s.start()
        urls = [s.url for s in servers]
        async with LLMBalancer(health_interval_s=0) as bal, httpx.AsyncClient() as http:
            for u in urls:
                bal.add(u)

            async def sticky(tid: str, prompt: list[int], sp: SamplingParams) -> Any:
                return await bal.generate(prompt, sp, trajectory_id=tid)

            clients = [LlamaCppClient(u, http) for u in urls]
            rotation = itertools.cycle(clients)

            async def round_robin(tid: str, prompt: list[int], sp: SamplingParams) -> Any:
                return await next(rotation).generate(prompt, sp)

            for name, send in (("sticky", sticky), ("round_robin", round_robin)):
                start = time.perf_counter()
                rows = await asyncio.gather(
                    *(
                        trajectory(f"{name}-{i}", tok, args.turns, sampling, send)
                        for i in range(args.trajectories)
                    )
                )
                result[name] = {**summarize(list(rows)), "wall_s": round(time.perf_counter() - start, 2)}
    finally:
        for s in servers:
            await s.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
