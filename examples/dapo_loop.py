"""A DAPO trainer loop against raas, with the embedded CPU model standing in for the policy (no GPU).

It starts the embedded llama.cpp SmolLM2-135M server and a raas service in this process (or uses a running
service with ``--server``), then for a few steps:

1. collects ``--target`` informative groups (``builtin:addition``: one-digit sums the tiny model solves
   sometimes, so some groups have reward variance and others are filtered) with the asynchronous
   :class:`~raas.trainer.dapo.DynamicSampler`;
2. assembles the GRPO batch (numpy arrays) and converts it for verl;
3. hands the batch to a trainer (here: none — this example shows the sampling side alone), then goes
   through the weight update: pause every service (running turns finish), "load" new weights, stamp the
   next weight version on the inference servers, resume. With carry-over, unfinished groups keep running
   through it.

The same loop with a real optimizer step and a real weight sync into llama.cpp is the reference trainer,
``raas train`` (:mod:`raas.learn.reference`); read that one to see a policy learn.

It prints each step's statistics. Run: ``python examples/dapo_loop.py [--steps 3] [--no-carry-over]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from raas.cli.inprocess import embedded_llm, service_in_process
from raas.llm.models import default_tokenizer_dir
from raas.pipeline.config import ServiceConfig
from raas.tasks.datasets import load_dataset
from raas.trainer.adapters import to_verl
from raas.trainer.dapo import DynamicSampler, StepStats
from raas.trainer.rollout import RolloutClient

PAD_ID = 2  # SmolLM2's <|im_end|>


def shuffled_forever(items: list[dict[str, Any]], seed: int) -> Iterator[dict[str, Any]]:
    """Epochs of the dataset, each in a new order (what a trainer's data loader does)."""
    rng = random.Random(seed)
    while True:
        order = list(items)
        rng.shuffle(order)
        yield from order


def print_stats(s: StepStats, batch_rows: int, train_tokens: int) -> None:
    hist = " ".join(f"{k}:{v}" for k, v in sorted(s.staleness.items())) or "-"
    f = s.failures
    print(
        f"step {s.step} (policy v{s.policy_version}): {s.accepted_groups}/{s.target_groups} groups in "
        f"{s.time_waiting_s:.1f}s | informative {s.informative_fraction:.0%} "
        f"(uninformative {s.uninformative_groups}, stale {s.stale_dropped_groups}, failed {s.failed_groups}) | "
        f"rollouts used {s.rollouts_used}, wasted {s.rollouts_wasted} | cancelled {s.cancelled_jobs} jobs | "
        f"carried over {s.carried_over_groups}, carried in {s.carried_in_groups} | staleness {hist} | "
        f"filtered {f['filtered']} resubmitted {f['resubmitted']} | batch {batch_rows} rows, "
        f"{train_tokens} trained tokens"
    )


async def train(args: argparse.Namespace) -> None:
    data = shuffled_forever(load_dataset("builtin:addition"), seed=args.seed)
    sampling = {"temperature": 1.0, "max_tokens": args.max_tokens}
    async with contextlib.AsyncExitStack() as stack:
        url = args.server
        if url is None:
            print("starting the embedded model (llama.cpp, SmolLM2-135M) and a raas service ...", flush=True)
            llm = await stack.enter_async_context(embedded_llm(1024, args.slots))
            state = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="raas-dapo-")))
            config = ServiceConfig(
                state_dir=state,
                llm_servers=[llm],
                tokenizer_dir=default_tokenizer_dir(),
                run_workers=args.slots,
                shutdown_grace_s=0.0,
            )
            url = await stack.enter_async_context(service_in_process(config))
        client = await stack.enter_async_context(RolloutClient(url))
        await client.set_weight_version("0")
        sampler = DynamicSampler(
            client,
            data,
            group_size=args.group_size,
            target_groups=args.target,
            max_inflight_groups=args.inflight,
            carry_over=not args.no_carry_over,
            max_staleness=1,
            sampling_params=sampling,
            mask_stale_turns=False,
        )
        started = time.monotonic()
        for _ in range(args.steps):
            groups, stats = await sampler.next_step()
            batch = sampler.assemble(groups, PAD_ID, max_prompt_len=96, max_response_len=args.max_tokens + 4)
            verl_batch = to_verl(batch, meta_info={"step": stats.step})
            assert verl_batch is not None  # hand it to the trainer here
            print_stats(stats, batch.size, int(batch.loss_mask.sum()))

            async def load_weights() -> None:
                await asyncio.sleep(0.2)  # a real trainer pushes its new weights to the inference servers

            await sampler.update_weights(load_weights)
        cancelled = await sampler.close()
        print(
            f"{args.steps} steps in {time.monotonic() - started:.1f}s; {cancelled} unfinished jobs cancelled; "
            f"client totals: {client.stats.snapshot()}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--target", type=int, default=4, help="informative groups per step")
    ap.add_argument("--inflight", type=int, default=8, help="most groups running at once")
    ap.add_argument(
        "--no-carry-over", action="store_true", help="cancel unfinished groups at each step's end"
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--slots", type=int, default=8, help="embedded model decoding slots")
    ap.add_argument("--server", help="use a running raas service instead of starting one")
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(train(ap.parse_args()))


if __name__ == "__main__":
    main()
