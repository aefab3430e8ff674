"""The code and STEM tasks with a real model: the embedded llama.cpp server (SmolLM2-135M on CPU) behind the
HTTP service, bwrap sandboxes for RUN and EVAL. Proves the whole path (prompt, tools, token record, EVAL);
what the model scores does not matter."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.api.conftest import APIFactory
from tests.tasks.service import bwrap_service, run_jobs

from raas.llm.embedded import EmbeddedServer
from raas.tasks.code.humaneval import humaneval
from raas.tasks.stem.data import builtin_stem

pytestmark = pytest.mark.e2e


async def test_code_and_stem_with_the_embedded_model(
    make_api: APIFactory, test_image: Path, backend_available: dict[str, str | None]
) -> None:
    api = await bwrap_service(
        make_api, test_image, backend_available, max_turns=2, max_tokens_per_turn=48, context_budget=3072
    )
    jobs = [
        ("code-0", {**humaneval(1)[0], "time_limit": 5}, {"temperature": 1.0, "seed": 7}),
        ("stem-0", builtin_stem(1)[0], {"temperature": 1.0, "seed": 7}),
    ]
    async with EmbeddedServer(parallel=2, ctx_per_slot=3072) as llama:
        results = await run_jobs(api, llama.url, jobs)
    for job_id, res in results.items():
        assert res["status"] == "completed", (job_id, res.get("error"))
        assert res["filter"] is False and res["reward"] in (0.0, 1.0)
        assert res["turns"] and all(t["output_ids"] for t in res["turns"])
        traj = res["token_trajectory"]
        assert len(traj["response_ids"]) == len(traj["loss_mask"]) == len(traj["logprobs"])
        assert sum(traj["loss_mask"]) == sum(len(t["output_ids"]) for t in res["turns"])
        assert res["artifacts"]["eval_details"], job_id
    code = results["code-0"]["artifacts"]
    # Whatever the model did, EVAL judged something: the solution file (at least the prompt it started as).
    assert code["solution_source"] in ("file", "answer", "message")
    assert code["eval_details"]["kind"] == "function"
    assert code["eval_details"]["status"] in ("passed", "failed", "timeout")
    assert results["stem-0"]["artifacts"]["eval_details"]["answer_type"] == "numeric"
