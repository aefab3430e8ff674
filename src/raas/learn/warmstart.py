"""Warm start through raas: trajectories a scripted teacher acts out through the real task, graded by EVAL.

Rejection-sampling fine-tuning's sampling half for a policy too weak to find any reward itself: the
teacher (:class:`~raas.tasks.swe.mini.teacher.TeacherBook`, a vLLM-protocol server) answers every turn of
every job with the instance's gold fix typed through the scaffold's tools, and the jobs go through a raas
service in this process exactly as a policy's would (INIT in a sandbox, the tools, EVAL in a fresh
sandbox with the hidden tests). The results are written in ``raas run -o``'s format once all are in, and
:func:`raas.learn.sft.sft` keeps the resolved ones. Nothing about a trajectory is invented: the tokens are
what the teacher's server sent, the observations what the sandbox returned, the reward what EVAL said.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raas.learn.local import local_service
from raas.llm.scripted import ScriptedLLM
from raas.llm.tokenizer import ChatTokenizer
from raas.tasks.swe.mini.teacher import TeacherBook
from raas.trainer.rollout import FailurePolicy, RolloutClient
from raas.trainer.types import is_valid


@dataclass
class WarmStats:
    instances: int
    scripted: int
    """Instances the teacher has a script for (a single contiguous gold edit)."""
    results: int = 0
    resolved: int = 0
    filtered: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    path: str = ""


async def teacher_trajectories(
    instances: Sequence[dict[str, Any]],
    tokenizer: Path,
    out: str | Path,
    *,
    sandbox: str = "bwrap",
    workers: int = 8,
    on_result: Callable[[WarmStats], None] | None = None,
) -> WarmStats:
    """Act out every instance once through a raas service in this process; write each result as a JSON
    line to ``out``; return the counts."""
    started = time.monotonic()
    tok = await asyncio.to_thread(ChatTokenizer.from_pretrained, tokenizer)
    book = TeacherBook(tok)
    kept = await asyncio.to_thread(book.add, instances)
    stats = WarmStats(instances=len(instances), scripted=len(kept), path=str(out))
    outcomes: collections.Counter[str] = collections.Counter()
    path = Path(out)
    await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
    async with (
        ScriptedLLM(book) as llm,
        local_service([llm.url], tokenizer, run_workers=workers, sandbox={"backend": sandbox}) as url,
        RolloutClient(
            url, policy=FailurePolicy(resubmit=False, min_group_size=1), run_id="warmstart"
        ) as client,
    ):
        groups = [client.new_group(inst, 1, sampling_params={"temperature": 1.0}) for inst in kept]
        await client.submit_groups(groups)
        lines: list[str] = []
        for _ in groups:
            g = await client.next_group()
            for r in [*g.samples, *g.failures]:
                lines.append(r.model_dump_json())
                stats.results += 1
                if not is_valid(r):
                    stats.filtered += 1
                    continue
                if r.reward is not None and r.reward >= 1.0:
                    stats.resolved += 1
                outcomes[str(r.artifacts.get("outcome", "unknown"))] += 1
            if on_result is not None:
                on_result(stats)
    await asyncio.to_thread(path.write_text, "".join(line + "\n" for line in lines), "utf-8")
    stats.outcomes = dict(outcomes)
    stats.wall_s = time.monotonic() - started
    return stats
