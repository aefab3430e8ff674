"""How often the embedded SmolLM2-135M calls the bash tool on the ``lookup`` task, and how often it passes.

``builtin:lookup`` instances (read a secret number out of a file with the bash tool, reply with it) are
sampled ``--samples`` times each at temperature 1 by the embedded llama.cpp server (CPU), through the real
in-process service and :class:`~raas.trainer.rollout.RolloutClient`, as a trainer would. Reported: the
fraction of rollouts that make a well-formed bash call (``tool_called``), that read the secret
(``secret_seen``), the pass rate, the pass rate with and without a call, and how many groups have reward
variance (what GRPO needs).

Usage: ``python bench/lookup_task.py [--n 16] [--samples 4] [--split train] [--sandbox auto] [--out FILE]``;
prints JSON and writes ``bench/results/lookup_task_<split>.json``. The numbers in docs/benchmarks.md: ``--n 24`` (train)
and ``--n 16 --split test``.
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
from collections import Counter
from pathlib import Path
from typing import Any

from raas.agent.config import AgentConfig
from raas.cli.common import choose_sandbox
from raas.cli.inprocess import embedded_llm, service_in_process
from raas.llm.models import default_tokenizer_dir
from raas.pipeline.config import ServiceConfig
from raas.tasks import lookup
from raas.tasks.lookup import builtin_lookup, lookup_details
from raas.trainer.rollout import FailurePolicy, RolloutClient

REPO = Path(__file__).resolve().parents[1]
CONTEXT = 1024


def _rate(xs: list[bool]) -> float | None:
    return round(statistics.fmean(xs), 3) if xs else None


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    instances = builtin_lookup(args.n, split=args.split)
    results: list[Any] = []
    sandbox = choose_sandbox(args.sandbox, None)
    started = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        llm = await stack.enter_async_context(embedded_llm(CONTEXT, args.slots))
        state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="raas-lookup-")))
        config = ServiceConfig(
            state_dir=state,
            llm_servers=[llm],
            tokenizer_dir=default_tokenizer_dir(),
            sandbox=sandbox,
            agent=AgentConfig(context_budget=CONTEXT),
            run_workers=args.slots,
            max_pending=4096,
            shutdown_grace_s=0.0,
            default_timeout_s=600,
        )
        url = await stack.enter_async_context(service_in_process(config))
        # No resubmission: every sample's own outcome is what is measured (failures are counted).
        policy = FailurePolicy(resubmit=False, min_group_size=1)
        client = await stack.enter_async_context(RolloutClient(url, policy=policy, on_result=results.append))
        groups = [
            client.new_group(inst, args.samples, sampling_params={"temperature": 1.0}) for inst in instances
        ]
        await client.submit_groups(groups)
        for _ in groups:
            await client.next_group()
    wall = time.monotonic() - started

    rows: list[dict[str, Any]] = []
    failed: Counter[str] = Counter()
    for res in results:
        details = lookup_details(res)
        if res.status != "completed" or res.filter or details is None:
            failed[res.error.kind if res.error else res.status] += 1
            continue
        replies = [m.content for m in res.messages[lookup.PROMPT_MESSAGES :] if m.role == "assistant"]
        metrics = res.artifacts.get("metrics", {})
        rows.append(
            {
                "instance_id": res.instance_id,
                "reward": res.reward,
                **details.model_dump(),
                "turns": len(res.turns),
                "finish_reason": res.artifacts.get("finish_reason"),
                "malformed_tool_calls": int(metrics.get("malformed_tool_calls", 0)),
                "response_tokens": sum(len(t.output_ids) for t in res.turns),
                "replies": replies,
            }
        )
    called = [r for r in rows if r["tool_called"]]
    uncalled = [r for r in rows if not r["tool_called"]]
    by_instance: dict[str, list[float]] = {}
    for r in rows:
        by_instance.setdefault(str(r["instance_id"]), []).append(float(r["reward"]))
    p = _rate([r["reward"] == 1.0 for r in rows])
    return {
        "model": "SmolLM2-135M-Instruct Q4_1 (llama.cpp, CPU)",
        "task": "lookup",
        "split": args.split,
        "sandbox": sandbox.get("backend"),
        "instances": len(instances),
        "samples_per_instance": args.samples,
        "temperature": 1.0,
        "max_turns": lookup.MAX_TURNS,
        "max_tokens_per_turn": lookup.MAX_TOKENS_PER_TURN,
        "user_prompt": lookup.USER_PROMPT,
        "examples": len(lookup.EXAMPLE_SECRETS),
        "rollouts": len(results),
        "failed": dict(failed),
        "wall_s": round(wall, 1),
        "tool_call_fraction": _rate([r["tool_called"] for r in rows]),
        "secret_seen_fraction": _rate([r["secret_seen"] for r in rows]),
        "pass_rate": p,
        "pass_rate_with_tool_call": _rate([r["reward"] == 1.0 for r in called]),
        "pass_rate_without_tool_call": _rate([r["reward"] == 1.0 for r in uncalled]),
        "malformed_call_fraction": _rate([r["malformed_tool_calls"] > 0 for r in rows]),
        "finish_reasons": dict(Counter(str(r["finish_reason"]) for r in rows)),
        "mean_response_tokens": round(statistics.fmean(r["response_tokens"] for r in rows), 1)
        if rows
        else None,
        f"groups_of_{args.samples}_with_reward_variance": _rate(
            [len(set(v)) > 1 for v in by_instance.values()]
        ),
        # P(a group of n samples has reward variance) = 1 - p^n - (1-p)^n at the pooled pass rate
        "expected_groups_with_variance": {
            str(n): round(1 - p**n - (1 - p) ** n, 3) if p is not None else None for n in (4, 8)
        },
        "load_average_at_start": os.getloadavg()[0],
        "replies": {
            "passed": [r["replies"] for r in rows if r["reward"] == 1.0][:4],
            "called_failed": [r["replies"] for r in called if r["reward"] != 1.0][:4],
            "no_call": [r["replies"] for r in uncalled][:4],
        },
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=16, help="instances")
    p.add_argument("--samples", type=int, default=4, help="rollouts per instance")
    p.add_argument("--split", choices=("train", "test"), default="train")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--sandbox", default="auto", help="auto (bwrap if possible, else local), bwrap, local")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    out = asyncio.run(measure(args))
    text = json.dumps(out, indent=1)
    print(text)
    target = args.out or REPO / "bench" / "results" / f"lookup_task_{args.split}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text + "\n")


if __name__ == "__main__":
    main()
