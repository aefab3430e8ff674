"""Pass rate of the embedded SmolLM2-135M on every one-digit addition, through the real service.

Each of the 81 problems ``a + b`` (``math_final`` task: one reply, graded on its last number) is sampled
``--samples`` times at temperature 1 by the embedded llama.cpp server (CPU). The problems solved in
``[--low, --high]`` of their samples are the ``builtin:addition`` set (``ADDITION_PAIRS`` in
``raas/tasks/datasets.py``): a group of rollouts of such a problem has reward variance.

Usage: ``python bench/addition_pass_rate.py [--samples 12] [--max-tokens 32] [--only 3+5,7+8] [--out FILE]``;
prints JSON and writes ``bench/results/addition_pass_rate.json``. ``--set kept`` re-measures the kept set
with fresh samples (the selection itself favours lucky draws) into ``addition_pass_rate_kept.json``;
``--pool`` pools both files per problem and keeps the problems whose pooled rate is in the band
(``addition_pass_rate_pooled.json``): that is the final ``builtin:addition`` set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from raas.cli.inprocess import embedded_llm, service_in_process
from raas.llm.models import default_tokenizer_dir
from raas.pipeline.config import ServiceConfig
from raas.tasks.datasets import ADDITION_CANDIDATES, ADDITION_PAIRS, addition_instance
from raas.trainer.rollout import FailurePolicy, RolloutClient

REPO = Path(__file__).resolve().parents[1]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    pairs = list(ADDITION_PAIRS if args.set == "kept" else ADDITION_CANDIDATES)
    if args.only:
        pairs = [tuple(int(x) for x in p.split("+")) for p in args.only.split(",")]  # type: ignore[misc]
    results: list[Any] = []
    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        llm = await stack.enter_async_context(embedded_llm(1024, args.slots))
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="raas-addition-")))
        config = ServiceConfig(
            state_dir=state,
            llm_servers=[llm],
            tokenizer_dir=default_tokenizer_dir(),
            run_workers=args.slots,
            max_pending=4096,
            shutdown_grace_s=0.0,
            default_timeout_s=600,
        )
        url = await stack.enter_async_context(service_in_process(config))
        # No resubmission: every sample's own outcome is what is measured (failures are counted).
        policy = FailurePolicy(resubmit=False, min_group_size=1)
        client = await stack.enter_async_context(RolloutClient(url, policy=policy, on_result=results.append))
        sampling = {"temperature": 1.0, "max_tokens": args.max_tokens}
        groups = [
            client.new_group(addition_instance(a, b), args.samples, sampling_params=sampling)
            for a, b in pairs
        ]
        await client.submit_groups(groups)
        for _ in groups:
            await client.next_group()
    wall = time.monotonic() - started
    per: dict[str, dict[str, Any]] = {
        addition_instance(a, b)["instance_id"]: {"rewards": [], "replies": []} for a, b in pairs
    }
    tokens: list[int] = []
    failed = 0
    for res in results:
        row = per[str(res.instance_id)]
        if res.status != "completed" or res.filter:
            failed += 1
            continue
        row["rewards"].append(res.reward)
        replies = [m.content for m in res.messages if m.role == "assistant"]
        if len(row["replies"]) < 3 and replies:
            row["replies"].append(replies[-1])
        tokens.append(sum(len(t.output_ids) for t in res.turns))
    table = []
    for (a, b), row in zip(pairs, per.values(), strict=True):
        problem = addition_instance(a, b)["problem"]
        rate = statistics.fmean(row["rewards"]) if row["rewards"] else None
        table.append({"a": a, "b": b, "problem": problem, "pass_rate": rate, "n": len(row["rewards"]), **row})
    kept = [
        (r["a"], r["b"])
        for r in table
        if r["pass_rate"] is not None and args.low <= r["pass_rate"] <= args.high
    ]
    rates = [r["pass_rate"] for r in table if r["pass_rate"] is not None]
    return {
        "model": "SmolLM2-135M-Instruct Q4_1 (llama.cpp, CPU)",
        "samples_per_problem": args.samples,
        "max_tokens": args.max_tokens,
        "temperature": 1.0,
        "problems": len(pairs),
        "rollouts": len(results),
        "failed": failed,
        "wall_s": round(wall, 1),
        "mean_output_tokens": round(statistics.fmean(tokens), 1) if tokens else None,
        "mean_pass_rate": round(statistics.fmean(rates), 3) if rates else None,
        "band": [args.low, args.high],
        "kept": kept,
        "kept_mean_pass_rate": round(
            statistics.fmean(r["pass_rate"] for r in table if (r["a"], r["b"]) in kept), 3
        )
        if kept
        else None,
        # P(a group of n samples has reward variance) = 1 - p^n - (1-p)^n, averaged over the problems
        "groups_with_variance": {
            str(n): round(statistics.fmean(1 - r**n - (1 - r) ** n for r in rates), 3) if rates else None
            for n in (4, 8)
        },
        "load_average_at_start": os.getloadavg()[0],
        "per_problem": table,
    }


def pool(results: Path, low: float, high: float) -> dict[str, Any]:
    """Pool the selection run (all candidates) with the fresh re-measurement of the kept set: a problem
    stays in ``builtin:addition`` when its pooled pass rate is within ``[low, high]``."""
    first = json.loads((results / "addition_pass_rate.json").read_text())
    fresh = json.loads((results / "addition_pass_rate_kept.json").read_text())
    by_pair = {(r["a"], r["b"]): r for r in first["per_problem"]}
    rows = []
    for r in fresh["per_problem"]:
        rewards = by_pair[(r["a"], r["b"])]["rewards"] + r["rewards"]
        rate = statistics.fmean(rewards)
        rows.append({"a": r["a"], "b": r["b"], "pooled_rate": round(rate, 3), "n": len(rewards),
                     "fresh_rate": r["pass_rate"]})  # fmt: skip
    kept = [r for r in rows if low <= r["pooled_rate"] <= high]
    rates = [r["pooled_rate"] for r in kept]
    return {
        "kept": [(r["a"], r["b"]) for r in kept],
        "kept_pooled_mean_pass_rate": round(statistics.fmean(rates), 3),
        "kept_fresh_mean_pass_rate": round(statistics.fmean(r["fresh_rate"] for r in kept), 3),
        "groups_with_variance": {
            str(n): round(statistics.fmean(1 - p**n - (1 - p) ** n for p in rates), 3) for n in (4, 8)
        },
        "per_problem": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--low", type=float, default=0.2)
    p.add_argument("--high", type=float, default=0.8)
    p.add_argument("--only", default="", help="comma-separated a+b problems (default: all 81)")
    p.add_argument(
        "--set",
        choices=("candidates", "kept"),
        default="candidates",
        help="all 81 problems (selects the kept ones), or re-measure the kept set (builtin:addition)",
    )
    p.add_argument("--out", type=Path)
    p.add_argument(
        "--pool",
        action="store_true",
        help="no sampling: pool the two result files into addition_pass_rate_pooled.json (the final set)",
    )
    args = p.parse_args()
    if args.pool:
        out = pool(REPO / "bench" / "results", args.low, args.high)
        text = json.dumps(out, indent=1)
        print(text)
        (REPO / "bench" / "results" / "addition_pass_rate_pooled.json").write_text(text + "\n")
        return
    name = "addition_pass_rate.json" if args.set == "candidates" else "addition_pass_rate_kept.json"
    args.out = args.out or REPO / "bench" / "results" / name
    out = asyncio.run(measure(args))
    text = json.dumps(out, indent=1)
    print(text)
    if not args.only:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
