"""Per-call cost of running a verifier in a killable worker process vs in a thread (the old path).

``thread``: ``asyncio.to_thread(fn, ...)`` in the service process, as math-verify ran before (a hung call
could not be stopped). ``process``: :class:`raas.tasks.verify.VerifierPool` (JSON lines over a pipe to a
warm worker; a hung call is killed). Measured for a no-op (``builtins:len``: the pure transport cost) and
for real math-verify checks of typical answers; ``cold_start_s`` is a new worker's first call (spawn +
importing math-verify/sympy), which the pool pays once per worker, not per call.

Writes ``bench/results/verify_overhead.json`` and prints it. Usage:
``python bench/verify_overhead.py [--calls 300]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from raas.tasks.math import MATH_VERIFY
from raas.tasks.verify import VerifierPool

OUT = Path(__file__).parent / "results" / "verify_overhead.json"
ANSWERS = [("42", "42"), ("\\frac{3}{4}", "0.75"), ("29.4", "147/5"), ("41", "42"), ("x^2+1", "1+x^2")]


def _stats(samples: list[float]) -> dict[str, float]:
    samples = sorted(samples)
    return {
        "median_us": round(statistics.median(samples), 1),
        "p90_us": round(samples[int(0.9 * (len(samples) - 1))], 1),
        "n": len(samples),
    }


async def _pair(
    n: int, thread: Callable[[int], Awaitable[Any]], process: Callable[[int], Awaitable[Any]]
) -> tuple[dict[str, float], dict[str, float]]:
    """Time both paths interleaved call by call, so a shared machine's load drifts into both alike."""
    for i in range(min(n, 20)):  # warm-up
        await thread(i)
        await process(i)
    a: list[float] = []
    b: list[float] = []
    for i in range(n):
        for call, samples in ((thread, a), (process, b)):
            t0 = time.perf_counter()
            await call(i)
            samples.append((time.perf_counter() - t0) * 1e6)
    return _stats(a), _stats(b)


async def main(calls: int) -> dict[str, Any]:
    from raas.tasks.mathverify import verify_answer

    pool = VerifierPool(size=1)
    try:
        t0 = time.perf_counter()
        await pool.call(MATH_VERIFY, "1", "1", timeout_s=120)
        cold = time.perf_counter() - t0
        result: dict[str, Any] = {"calls": calls, "cold_start_s": round(cold, 3)}
        result["noop_thread"], result["noop_process"] = await _pair(
            calls,
            lambda i: asyncio.to_thread(len, "x" * i),
            lambda i: pool.call("builtins:len", "x" * i, timeout_s=30),
        )

        def pick(i: int) -> tuple[str, str]:
            return ANSWERS[i % len(ANSWERS)]

        result["math_thread"], result["math_process"] = await _pair(
            calls,
            lambda i: asyncio.to_thread(verify_answer, *pick(i)),
            lambda i: pool.call(MATH_VERIFY, *pick(i), timeout_s=30),
        )
    finally:
        await pool.aclose()
    result["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    data = asyncio.run(main(args.calls))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=2))
