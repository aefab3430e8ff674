"""The STEM task through the HTTP service in bwrap sandboxes with a scripted policy (vLLM wire protocol):
right answers score 1 whichever way they are given (finish, \\boxed, "Answer:"), wrong ones 0, and every
question of the built-in set is scored 1 for its own ground truth."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.agent.scripted import tool_call
from tests.api.conftest import APIFactory
from tests.doubles.scripted_llm import ScriptedLLM
from tests.tasks.service import bwrap_service, by_marker, run_jobs, tool_observations

from raas.llm.models import prepare_tokenizer
from raas.llm.tokenizer import ChatTokenizer
from raas.tasks.stem.answers import parse
from raas.tasks.stem.data import builtin_stem

pytestmark = pytest.mark.integration


def mc(name: str) -> dict[str, Any]:
    return {
        "data_source": "stem",
        "question": f"[{name}] Which of these is a noble gas?",
        "choices": ["sodium", "argon", "chlorine", "iron"],
        "answer": "B",
    }


def cart(name: str) -> dict[str, Any]:
    return {
        "data_source": "stem",
        "question": f"[{name}] A cart accelerates from rest at 4 m/s^2 for 3 s. How far does it go?",
        "answer": "18 m",
    }


def gold_answer(record: dict[str, Any]) -> str:
    """The record's ground truth, written differently where the grader allows it."""
    spec = parse(record)
    if spec.answer_type == "expression":
        return " + ".join(reversed(spec.gold.split(" + ")))  # same polynomial, terms reordered
    if spec.answer_type == "choice":
        return f"({spec.gold})"
    return spec.gold


async def test_stem_jobs_through_the_service(
    make_api: APIFactory,
    test_image: Path,
    backend_available: dict[str, str | None],
    tokenizer: ChatTokenizer,
) -> None:
    api = await bwrap_service(make_api, test_image, backend_available, max_turns=3)
    scripts: dict[str, list[str]] = {
        "[mc-gold]": [tool_call("finish", answer="B")],
        "[mc-text]": [tool_call("finish", answer="argon")],
        "[mc-wrong]": [tool_call("finish", answer="C")],
        "[cart-gold]": [
            tool_call("ipython", code="print(0.5 * 4 * 3 ** 2)"),
            tool_call("finish", answer="18.0 m"),
        ],
        "[cart-bash]": [
            tool_call("bash", command="python3 -c 'print(0.5*4*9)'"),
            "So it goes 18 m.\nAnswer: 18 m",
        ],
        "[cart-boxed]": ["Half of 4 times 9 is \\boxed{18\\text{ m}}."],
        "[cart-wrong]": [tool_call("finish", answer="36 m")],
        "[cart-none]": ["I cannot tell."],
    }
    jobs: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        (name, (mc if name.startswith("mc") else cart)(name), {}) for name in (m.strip("[]") for m in scripts)
    ]
    builtin = builtin_stem(10)
    for record in builtin:
        scripts[record["question"]] = [tool_call("finish", answer=gold_answer(record))]
        jobs.append((record["instance_id"], record, {}))
    async with ScriptedLLM(by_marker(tokenizer, scripts)) as llm:
        results = await run_jobs(api, llm.url, jobs)

    for job_id, res in results.items():
        assert res["status"] == "completed" and res["filter"] is False, (job_id, res.get("error"))
    rewards = {job_id: res["reward"] for job_id, res in results.items()}
    details = {job_id: res["artifacts"]["eval_details"] for job_id, res in results.items()}
    assert {k: v for k, v in rewards.items() if not k.startswith("builtin")} == {
        "mc-gold": 1.0,
        "mc-text": 1.0,
        "mc-wrong": 0.0,
        "cart-gold": 1.0,
        "cart-bash": 1.0,
        "cart-boxed": 1.0,
        "cart-wrong": 0.0,
        "cart-none": 0.0,
    }, details
    assert all(rewards[r["instance_id"]] == 1.0 for r in builtin), details
    assert {d["answer_type"] for k, d in details.items() if k.startswith("builtin")} == {
        "numeric",
        "choice",
        "text",
        "expression",
    }
    assert tool_observations(results["cart-gold"])[0] == "18.0"
    assert tool_observations(results["cart-bash"])[0].startswith("18.0")
    sources = {k: results[k]["artifacts"]["answer_source"] for k in ("cart-gold", "cart-bash", "cart-boxed")}
    assert sources == {"cart-gold": "finish", "cart-bash": "answer_line", "cart-boxed": "boxed"}
    assert details["cart-none"]["reason"] == "no answer given"
    assert [t["function"]["name"] for t in results["mc-gold"]["artifacts"]["tools"]] == [
        "ipython",
        "bash",
        "finish",
    ]


@pytest.mark.parametrize(
    ("instance", "field"),
    [
        ({"question": "q"}, "'answer'"),
        ({"answer": "1"}, "'question'"),
        ({"question": "q", "choices": ["a", "b"], "answer": "D"}, "'answer'"),
        ({"question": "q", "choices": "[broken", "answer": "A"}, "'choices'"),
        ({"question": "q", "answer": "1", "answer_type": "essay"}, "'answer_type'"),
        ({"question": "q", "answer": "1", "tolerance": -1}, "'tolerance'"),
    ],
)
async def test_bad_stem_instances_are_400_naming_the_field(
    make_api: APIFactory, instance: dict[str, Any], field: str
) -> None:
    api = await make_api(tokenizer_dir=prepare_tokenizer())
    r = await api.client.post("/v1/jobs", json={"instance": {"data_source": "stem", **instance}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["kind"] == "bad_request" and field in error["message"], error
    assert await api.service.ledger.counts() == {}
