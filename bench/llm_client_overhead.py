"""Per-request overhead of raas's generate client and balancer over a raw httpx call.

The server is a stub that answers llama.cpp's ``/completion`` shape instantly (a real model's time would
drown the difference), served by uvicorn on a real socket. Three ways to send the same request:
``raw`` (httpx post + JSON decode), ``client`` (:class:`LlamaCppClient.generate`: request build, response
validation, retries wrapper) and ``balancer`` (:class:`LLMBalancer.generate` with trajectory pinning).

Writes ``bench/results/client_overhead.json`` and prints it. Usage:
``python bench/llm_client_overhead.py [--requests 500] [--output-tokens 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from raas.llm import LLMBalancer, SamplingParams
from raas.llm.servers import LlamaCppClient

OUT = Path(__file__).parent / "results" / "client_overhead.json"


def stub_app(output_tokens: int) -> Callable[..., Awaitable[None]]:
    tokens = list(range(100, 100 + output_tokens))
    completion = json.dumps(
        {
            "content": "x" * output_tokens,
            "tokens": tokens,
            "stop": True,
            "stop_type": "limit",
            "tokens_evaluated": 100,
            "tokens_cached": 99,
            "completion_probabilities": [
                {"id": t, "token": "x", "bytes": [120], "logprob": -0.5, "top_logprobs": []} for t in tokens
            ],
            "timings": {"cache_n": 99, "prompt_n": 1},
        }
    ).encode()
    props = json.dumps({"default_generation_settings": {"n_ctx": 100000}, "total_slots": 8}).encode()

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            more = (await receive()).get("more_body", False)
        body = props if scope["path"] == "/props" else (b"" if scope["path"] == "/health" else completion)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


async def timed(n: int, call: Callable[[], Awaitable[Any]]) -> list[float]:
    for _ in range(min(20, n)):
        await call()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        out.append(time.perf_counter() - start)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            stub_app(args.output_tokens), host="127.0.0.1", port=port, log_level="warning", lifespan="off"
        )
    )
    task = asyncio.create_task(server.serve())
    for _ in range(1000):
        if server.started or task.done():
            break
        await asyncio.sleep(0.01)
    if not server.started:
        raise RuntimeError("the stub server did not start")
    url = f"http://127.0.0.1:{port}"
    prompt = list(range(1, 101))
    sampling = SamplingParams(max_tokens=args.output_tokens)
    try:
        async with httpx.AsyncClient() as http, LLMBalancer(health_interval_s=0) as bal:
            client = LlamaCppClient(url, http)
            await client.ensure_info()
            _, body = client.build_request(prompt, sampling, args.output_tokens)
            bal.add(url, kind="llamacpp")

            async def raw() -> Any:
                r = await http.post(url + "/completion", json=body)
                return r.json()

            results = {}
            for name, call in (
                ("raw", raw),
                ("client", lambda: client.generate(prompt, sampling)),
                ("balancer", lambda: bal.generate(prompt, sampling, trajectory_id="t")),
            ):
                samples = await timed(args.requests, call)
                results[name] = {
                    "median_us": round(statistics.median(samples) * 1e6, 1),
                    "p90_us": round(sorted(samples)[int(0.9 * len(samples))] * 1e6, 1),
                }
    finally:
        server.should_exit = True
        await task
    return {
        "benchmark": "llm_client_overhead",
        "requests": args.requests,
        "output_tokens": args.output_tokens,
        **results,
        "client_overhead_us": round(results["client"]["median_us"] - results["raw"]["median_us"], 1),
        "balancer_overhead_us": round(results["balancer"]["median_us"] - results["raw"]["median_us"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
