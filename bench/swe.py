"""The SWE task handler, stage by stage, on the built small set (``raas swe build``, 12 instances).

Through the full service (in-process, HTTP): a replay policy (vLLM wire protocol) types each instance's
gold patch with the editor, makes a wrong edit, or submits nothing. Per backend (bwrap, apptainer):

* INIT (image resolved, sandbox started, repository at the base commit), RUN (the scripted turns, the
  tool calls and the patch extraction), EVAL with the prewarmed sandbox and EVAL with prewarming off
  (the fresh sandbox is then started inside EVAL), and the prewarm itself (it overlaps RUN);
* the outcome of gold / wrong / empty per instance.

"Image build once": the small set's build (cached after the first run: see ``bench/swe_build.py`` for the
cost from nothing) and the one-time conversion of an instance image packed as a SIF into the image cache.
Jobs run two at a time per stage (2-core machine). Needs the small set built (root, once).

    python bench/swe.py [--backends bwrap,apptainer] [--no-sif]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.doubles.scripted_llm import ScriptedLLM  # noqa: E402

from raas.agent.config import AgentConfig  # noqa: E402
from raas.cli.inprocess import service_in_process  # noqa: E402
from raas.llm.models import prepare_tokenizer  # noqa: E402
from raas.llm.tokenizer import ChatTokenizer  # noqa: E402
from raas.pipeline.config import ServiceConfig  # noqa: E402
from raas.sandbox.images import build_sif, ensure_sandbox_dir  # noqa: E402
from raas.tasks.registry import HandlerRegistry  # noqa: E402
from raas.tasks.swe.build import BuildOptions, build  # noqa: E402
from raas.tasks.swe.config import SweConfig  # noqa: E402
from raas.tasks.swe.handler import SweHandler  # noqa: E402
from raas.tasks.swe.packages import FAST_PACKAGES  # noqa: E402
from raas.tasks.swe.records import SweRecord  # noqa: E402
from raas.tasks.swe.replay import ScriptBook, gold_by_editor, wrong_edit  # noqa: E402
from raas.trainer.client import RaasClient  # noqa: E402

RESULTS = REPO / "bench" / "results" / "swe.json"
SMALL_SET = {"packages": list(FAST_PACKAGES), "per_package": 4, "seed": 0, "jobs": 2}


class NoPrewarmSwe(SweHandler):
    """The handler with prewarming off: EVAL starts its fresh sandbox itself."""

    name = "swebench-noprewarm"
    config = SweConfig(prewarm=False)


def _p50(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def _in_stages(res: dict[str, Any]) -> float:
    """A job's time inside its stages (INIT + RUN + EVAL; queue waits left out: all jobs are submitted at
    once, so they mostly measure the backlog)."""
    t = res["timing"]
    return float(t["init_s"]) + float(t["run_s"]) + float(t["eval_s"])


def _buggy(r: SweRecord) -> tuple[str, int]:
    path = r.patch.split("diff --git a/", 1)[1].split(" ", 1)[0]
    return path, len((Path(r.image) / "testbed" / path).read_text().splitlines())


async def run_backend(
    backend: str, records: list[SweRecord], tok: ChatTokenizer, state: Path
) -> dict[str, Any]:
    book = ScriptBook(tok)
    jobs: list[dict[str, Any]] = []
    for i, r in enumerate(records):
        inst = r.model_dump(mode="json")
        path, n = _buggy(r)
        for kind, calls, source in (
            ("gold", gold_by_editor(r.patch), "swebench"),
            ("gold-noprewarm", gold_by_editor(r.patch), NoPrewarmSwe.name),
            ("wrong", wrong_edit(path, n), "swebench"),
            ("empty", [], "swebench"),
        ):
            key = f"{backend}-{kind}-{i}"
            jobs.append(
                {
                    "job_id": key,
                    "instance": {**inst, "data_source": source},
                    "sampling_params": book.add(key, calls),
                }
            )
    registry = HandlerRegistry()
    registry.register(NoPrewarmSwe)
    async with ScriptedLLM(book) as llm:
        config = ServiceConfig(
            state_dir=state / backend,
            sandbox={"backend": backend, "image": records[0].image},
            llm_servers=[llm.url],
            tokenizer_dir=prepare_tokenizer(),
            agent=AgentConfig(max_turns=8, max_tokens_per_turn=8192, context_budget=32768),
            init_workers=2,
            run_workers=2,
            eval_workers=2,
            default_timeout_s=900,
            shutdown_grace_s=0.0,
        )
        started = time.monotonic()
        async with (
            service_in_process(config, handlers=registry) as url,
            RaasClient(url, timeout_s=60) as client,
        ):
            await client.submit_batch(jobs)
            results = await asyncio.gather(*(client.wait(j["job_id"], timeout_s=900) for j in jobs))
        wall = time.monotonic() - started
    by_kind: dict[str, list[dict[str, Any]]] = {}
    outcomes: dict[str, dict[str, Any]] = {}
    for res in results:
        kind = res["job_id"].split("-", 1)[1].rsplit("-", 1)[0]
        by_kind.setdefault(kind, []).append(res)
        arts = res.get("artifacts") or {}
        outcome = arts.get("outcome") or f"{res['status']}:{(res.get('error') or {}).get('kind')}"
        outcomes.setdefault(res["instance_id"], {})[kind] = {"outcome": outcome, "reward": res["reward"]}

    def stage(kind: str, key: str) -> float:
        return _p50([float(r["timing"][key]) for r in by_kind.get(kind, [])])

    gold, fresh = by_kind.get("gold", []), by_kind.get("gold-noprewarm", [])
    return {
        "jobs": len(results),
        "wall_s": round(wall, 1),
        "completed": sum(1 for r in results if r["status"] == "completed"),
        "p50": {
            "init_s": _p50([float(r["timing"]["init_s"]) for r in results]),
            "run_s_gold": stage("gold", "run_s"),
            "eval_s_gold_prewarmed": stage("gold", "eval_s"),
            "eval_s_gold_fresh": stage("gold-noprewarm", "eval_s"),
            "prewarm_s": stage("gold", "prewarm_s"),
            "eval_s_wrong": stage("wrong", "eval_s"),
            "eval_s_empty": stage("empty", "eval_s"),
            "test_run_s_gold": _p50([float(r["artifacts"]["eval_details"].get("test_s", 0)) for r in gold]),
            "stages_s_gold_prewarmed": _p50([_in_stages(r) for r in gold]),
            "stages_s_gold_fresh": _p50([_in_stages(r) for r in fresh]),
        },
        "load_avg_end": round(os.getloadavg()[0], 2),
        "prewarmed_evals": sum(
            1 for r in gold if r["artifacts"]["eval_details"].get("eval_sandbox") == "prewarmed"
        ),
        "fresh_evals": sum(1 for r in fresh if r["artifacts"]["eval_details"].get("eval_sandbox") == "fresh"),
        "resolved": {k: sum(1 for r in v if r["resolved"]) for k, v in by_kind.items()},
        "outcomes": outcomes,
    }


def sif_conversion(r: SweRecord, work: Path) -> dict[str, Any]:
    """Pack one instance image into a SIF, then time its one-time conversion into a fresh image cache."""
    t0 = time.monotonic()
    sif = build_sif(Path(r.image), work / "instance.sif")
    pack_s = time.monotonic() - t0
    os.environ["RAAS_IMAGE_CACHE"] = str(work / "cache")
    try:
        t1 = time.monotonic()
        ensure_sandbox_dir(str(sif))
        convert_s = time.monotonic() - t1
        t2 = time.monotonic()
        ensure_sandbox_dir(str(sif))
        again_s = time.monotonic() - t2
    finally:
        os.environ.pop("RAAS_IMAGE_CACHE", None)
    return {
        "sif_mb": round(sif.stat().st_size / 1e6, 1),
        "pack_s": round(pack_s, 1),
        "convert_s": round(convert_s, 1),
        "cached_lookup_ms": round(again_s * 1000, 2),
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="bwrap,apptainer")
    ap.add_argument("--no-sif", action="store_true")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    records, reports = await build(BuildOptions(**SMALL_SET))  # type: ignore[arg-type]
    build_s = time.monotonic() - t0
    tok = ChatTokenizer.from_pretrained(prepare_tokenizer())
    out: dict[str, Any] = {
        "instances": len(records),
        "load_avg_start": round(load, 2),
        "image": {"small_set_build_s": round(build_s, 2), "small_set_cached": all(r.cached for r in reports)},
        "backends": {},
    }
    with tempfile.TemporaryDirectory(prefix="raas-bench-swe-", dir="/var/tmp") as tmp:
        os.chmod(tmp, 0o711)
        if not args.no_sif:
            out["image"]["sif"] = sif_conversion(records[0], Path(tmp))
        for backend in args.backends.split(","):
            out["backends"][backend] = await run_backend(backend, records, tok, Path(tmp))
    out["load_avg_end"] = round(os.getloadavg()[0], 2)
    RESULTS.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
