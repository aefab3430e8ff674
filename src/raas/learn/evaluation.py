"""Held-out evaluation through raas: the pass rate of the current policy on problems it never trained on."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from raas.trainer.rollout import FailurePolicy, RolloutClient
from raas.trainer.types import JobResult, is_valid


def used_tool(result: JobResult) -> bool:
    """Whether the policy called a tool in this rollout: an assistant message it sampled (``output_ids``;
    a prompt's scripted examples have none) that carries a parsed tool call."""
    return any(m.role == "assistant" and m.tool_calls and m.output_ids for m in result.messages)


async def evaluate(
    url: str,
    problems: list[dict[str, Any]],
    samples: int,
    sampling: dict[str, Any],
    on_progress: Callable[[int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Held-out pass rate: every problem ``samples`` times with the current policy, mean reward of the
    valid results (a filtered result is an infrastructure failure: counted, never a 0). ``on_progress``
    gets (problems done, problems, rewards of 1 so far) as each problem's samples finish."""
    results: list[JobResult] = []
    started = time.monotonic()
    policy = FailurePolicy(resubmit=True, min_group_size=1)
    async with RolloutClient(url, policy=policy, run_id="eval" + str(int(started))) as client:
        groups = [client.new_group(p, samples, sampling_params=sampling) for p in problems]
        await client.submit_groups(groups)
        for done in range(1, len(groups) + 1):
            g = await client.next_group()
            results.extend(g.samples)
            if on_progress is not None:
                on_progress(
                    done, len(groups), sum(1 for r in results if is_valid(r) and (r.reward or 0) >= 1)
                )
    valid = [r for r in results if is_valid(r)]
    rewards = [float(r.reward) for r in valid if r.reward is not None]
    return {
        "pass_rate": statistics.fmean(rewards) if rewards else None,  # all filtered: no verdict, not a 0
        "tool_call_fraction": statistics.fmean(used_tool(r) for r in valid) if valid else 0.0,
        "turns_mean": statistics.fmean(len(r.turns) for r in valid) if valid else None,
        "rollouts": len(valid),
        "filtered": len(problems) * samples - len(valid),
        "eval_s": time.monotonic() - started,
    }
