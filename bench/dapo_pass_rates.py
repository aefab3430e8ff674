"""DAPO on a training set the policy is learning: the sampler with and without per-prompt pass-rate tracking.

The starvation a real run showed (``raas train`` on ``builtin:addition``: the informative fraction fell from
1.0 to 0.03-0.05 and the trainer's wait per step rose from 36 s to 250-516 s) comes from a fixed training set
whose prompts the policy solves, one after another, in every sample. This benchmark reproduces that shape
with the simulated rollouts of ``bench/dapo.py`` (a raas service process, the trainer-side client over
HTTP, a capacity-limited policy double), on a pool of ``pool`` prompts cycled epoch after epoch:

* a prompt's pass rate starts at its own value (a quarter never solved, the rest in [0.1, 0.9]) and rises
  by ``drift`` with every weight version (a policy that learns), capped at 1;
* each step needs ``target`` informative groups of ``group_size``; the trainer "trains" ``train_s`` seconds
  and syncs weights between steps; carry-over on in both variants.

Variants: ``plain`` (the data's order) and ``tracked`` (:class:`~raas.trainer.pass_rates.PassRateFilter`:
prompts all solved or all failed in their last ``group_size`` samples deferred, those near 50% preferred).
Reported per variant and step: the trainer's wait, the informative fraction, rollouts finished; totals and
the wait saved. Seeds fix every outcome: both variants see the same pass rate for the same prompt, sample
and version.

Usage: ``python bench/dapo_pass_rates.py`` (writes ``bench/results/dapo_pass_rates.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dapo import REPO, LearningDapoTask, Processes, apply_overrides


def pool(p: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The fixed training set, cycled (epochs in a fixed order)."""
    items = []
    for k in range(p["pool"]):
        r = random.Random(2000 + k)
        rate = 0.0 if r.random() < 0.25 else r.uniform(0.1, 0.9)
        items.append(
            {
                "data_source": LearningDapoTask.name,
                "instance_id": f"q{k}",
                "p": rate,
                "drift": 0.0 if rate == 0.0 else p["drift"],
                "turns": p["turns"],
                "tok_median": p["tok_median"],
                "tok_sigma": p["tok_sigma"],
                "tool_median_s": p["tool_median_s"],
                "tool_sigma": p["tool_sigma"],
            }
        )
    return itertools.cycle(items)


async def run_variant(name: str, procs: Processes, p: dict[str, Any]) -> dict[str, Any]:
    from raas.trainer.dapo import DynamicSampler
    from raas.trainer.pass_rates import PassRateFilter
    from raas.trainer.rollout import RolloutClient

    G = p["group_size"]
    steps: list[dict[str, Any]] = []
    started = time.monotonic()
    async with RolloutClient(procs.url, run_id=f"{name}{int(started)}") as client:
        await client.set_weight_version("0")
        sampler = DynamicSampler(
            client,
            pool(p),
            G,
            p["target"],
            max_inflight_groups=p["inflight"],
            carry_over=True,
            max_staleness=1,
            pass_rates=PassRateFilter(window=2 * G, min_samples=G) if name == "tracked" else None,
        )
        stopped = None
        for step in range(p["steps"]):
            left = p["variant_max_s"] - (time.monotonic() - started)
            try:
                _, stats = await asyncio.wait_for(sampler.next_step(), max(left, 1.0))
            except TimeoutError:
                # every prompt solved or never: a plain sampler can wait for ever; say so, do not hang
                stopped = f"time cap ({p['variant_max_s']:g} s) reached waiting for step {step + 1}"
                break
            steps.append(
                {
                    "wait_s": round(stats.time_waiting_s, 2),
                    "informative_fraction": round(stats.informative_fraction, 3),
                    "uninformative_groups": stats.uninformative_groups,
                    "skipped_prompts": stats.skipped_prompts,
                }
            )
            await asyncio.sleep(p["train_s"])

            async def sync() -> None:
                await asyncio.sleep(p["sync_s"])

            await sampler.update_weights(sync)
        await sampler.close()
        finished = client.stats.results
    return {
        "wait_s": round(sum(s["wait_s"] for s in steps), 2),
        "wall_s": round(time.monotonic() - started, 2),
        "rollouts_finished": finished,
        "uninformative_groups": sum(s["uninformative_groups"] for s in steps),
        "skipped_prompts": sum(s["skipped_prompts"] for s in steps),
        "steps_done": len(steps),
        "stopped": stopped,
        "steps": steps,
    }


async def main_async(p: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="raas-bench-dapo-pr-") as tmp:
        async with Processes(p, Path(tmp) / "svc", handler=LearningDapoTask) as procs:
            for name in ("plain", "tracked"):
                out[name] = await run_variant(name, procs, p)
                print(
                    name,
                    json.dumps({k: v for k, v in out[name].items() if k != "steps"}),
                    file=sys.stderr,
                    flush=True,
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "dapo_pass_rates.json")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a parameter")
    args = ap.parse_args()
    p: dict[str, Any] = {
        "steps": 20,
        "pool": 48,
        "drift": 0.025,
        "target": 4,
        "group_size": 8,
        "inflight": 8,
        "turns": 2,
        "tok_median": 40,
        "tok_sigma": 0.6,
        "tool_median_s": 0.3,
        "tool_sigma": 0.8,
        "capacity": 16,
        "tokens_per_s": 50.0,
        "prefill_s": 0.02,
        "train_s": 2.0,
        "sync_s": 0.5,
        "variant_max_s": 900.0,
    }
    apply_overrides(ap, p, args.set)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # killed: stop the service and double too
    load = os.getloadavg()[0]
    variants = asyncio.run(main_async(p))
    # compared over the steps both variants finished (one may have hit the time cap)
    common = min(v["steps_done"] for v in variants.values())
    plain, tracked = (sum(s["wait_s"] for s in variants[n]["steps"][:common]) for n in ("plain", "tracked"))
    result = {
        "params": p,
        "cpu_cores": os.cpu_count(),
        "load_average_at_start": round(load, 2),
        "steps_compared": common,
        "wait_s_compared": {"plain": round(plain, 2), "tracked": round(tracked, 2)},
        "wait_saved_fraction": round(1 - tracked / plain, 3) if plain else None,
        "variants": variants,
    }
    print(json.dumps(result, indent=1))
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
