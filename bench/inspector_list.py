"""How fast the inspector lists a big ledger; prints one JSON document and writes
bench/results/inspector_list.json.

Builds a ledger of ``--jobs`` finished jobs (the ledger's own schema and indexes; results of ``--turns``
turns with tool observations, about 6 kB each, in GRPO groups of 8, rewards 0/0.5/1, weight versions
0..9, 5% failed), then times each list query the job list page makes — through
:class:`raas.api.inspector_data.LedgerJobs`, what ``/dashboard/api/jobs`` runs: the first page, a status,
an outcome, a data source, a group, a reward range, a substring of an id, a weight version (which reads
every result it considers), and a page deep in the list. Median of ``--repeat`` runs each.

Usage: ``python bench/inspector_list.py [--jobs 100000] [--repeat 5] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from raas.api.inspector_data import JobQuery, LedgerJobs
from raas.core.jobs import ErrorInfo, JobResult
from raas.core.trajectory import Message, TokenTrajectory, Turn
from raas.pipeline.ledger import Ledger


def make_result(i: int, rng: random.Random, turns: int) -> tuple[JobResult, str]:
    group, k = divmod(i, 8)
    job_id = f"run1-g{group}.{k}.0"
    if rng.random() < 0.05:
        err = ErrorInfo(stage="run", kind="llm_timeout", message="no answer in 300 s")
        return JobResult(
            job_id=job_id, instance_id=f"inst-{group}", status="failed", filter=True, error=err
        ), "lookup"
    version = str(group // 500 % 10)
    out: list[int] = []
    mask: list[int] = []
    recs = []
    for t in range(turns):
        obs = [rng.randrange(50000) for _ in range(40)] if t else []
        sample = [rng.randrange(50000) for _ in range(60)]
        out += obs + sample
        mask += [0] * len(obs) + [1] * len(sample)
        recs.append(
            Turn(index=t, prompt_ids=obs or [1] * 200, prompt_is_delta=t > 0, prompt_len=0, output_ids=sample,
                 logprobs=[-0.5] * len(sample), finish_reason="stop", weight_version=version)
        )  # fmt: skip
    result = JobResult(
        job_id=job_id,
        instance_id=f"inst-{group}",
        trajectory_id=str(k),
        status="completed",
        reward=rng.choice([0.0, 0.5, 1.0]),
        filter=False,
        messages=[Message(role="user", content="What is the secret number in answer.txt?")],
        turns=recs,
        token_trajectory=TokenTrajectory(
            prompt_ids=[1] * 200,
            response_ids=out,
            loss_mask=mask,
            logprobs=[-0.5 if m else 0.0 for m in mask],
        ),
    )
    return result, "lookup" if group % 2 else "math"


async def build(path: Path, jobs: int, turns: int) -> float:
    ledger = Ledger(path)
    await ledger.open()  # the schema and its indexes
    await ledger.close()
    rng = random.Random(0)
    started = time.perf_counter()
    conn = sqlite3.connect(path)
    now = time.time() - jobs
    rows = []
    for i in range(jobs):
        r, source = make_result(i, rng, turns)
        body = r.model_dump_json()
        error = r.error.model_dump_json() if r.error else None
        rows.append(
            (
                r.job_id,
                r.status,
                source,
                r.instance_id,
                r.trajectory_id,
                "{}",
                body,
                error,
                now + i,
                now + i,
                now + i,
            )
        )
        if len(rows) == 5000:
            conn.executemany(
                "INSERT INTO jobs (job_id, status, data_source, instance_id, trajectory_id, request, result, error,"
                " created_at, updated_at, finished_at) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                rows,
            )
            conn.commit()
            rows = []
    conn.close()
    return time.perf_counter() - started


async def measure(path: Path, jobs: int, repeat: int) -> dict[str, Any]:
    source = LedgerJobs(path)
    queries = {
        "first_page": JobQuery(),
        "status_failed": JobQuery(status="failed"),
        "outcome_resolved": JobQuery(outcome="resolved"),
        "data_source": JobQuery(data_source="math"),
        "group": JobQuery(group=f"run1-g{jobs // 16}"),
        "reward_range": JobQuery(min_reward=0.4, max_reward=0.6),
        "id_substring": JobQuery(text="g1234."),
        "weight_version_scan": JobQuery(weight_version="3"),
        "page_at_offset_90000": JobQuery(offset=min(90_000, jobs - 50)),
    }
    out: dict[str, Any] = {}
    for name, q in queries.items():
        times = []
        total = 0
        for _ in range(repeat):
            t = time.perf_counter()
            page = await source.page(q)
            times.append(time.perf_counter() - t)
            total = page["total"]
        out[name] = {
            "median_s": round(statistics.median(times), 4),
            "max_s": round(max(times), 4),
            "total": total,
        }
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="raas-inspect-") as tmp:
        path = Path(tmp) / "ledger.db"
        build_s = await build(path, args.jobs, args.turns)
        size_mb = path.stat().st_size / 1e6
        return {
            "jobs": args.jobs,
            "turns_per_job": args.turns,
            "ledger_mb": round(size_mb, 1),
            "build_s": round(build_s, 1),
            "queries": await measure(path, args.jobs, args.repeat),
            "cpu": os.cpu_count(),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "inspector_list.json")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    text = json.dumps(result, indent=2)
    print(text)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
