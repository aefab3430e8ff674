"""The code task through the HTTP service in bwrap sandboxes, driven by a scripted policy that works through
the real tools: the gold solution scores 1, a wrong one 0, one that loops forever 0 with a timeout detail
(not a hang), and the hidden tests are nowhere in the RUN sandbox (the policy looks for them itself)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.agent.scripted import tool_call
from tests.api.conftest import APIFactory
from tests.doubles.scripted_llm import ScriptedLLM
from tests.tasks.service import bwrap_service, by_marker, run_jobs, tool_observations

from raas.llm.tokenizer import ChatTokenizer
from raas.tasks.code.humaneval import humaneval

pytestmark = pytest.mark.integration

HE0 = humaneval(1)[0]  # has_close_elements
HIDDEN_HALVES = ("candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], ", "0.3) == True")
"""A line of HumanEval/0's hidden check(), in two halves so no command the policy runs contains it whole."""
assert "".join(HIDDEN_HALVES) in HE0["test"]
VISIBLE_HALVES = ("are any two numbers closer to each ", "other than")
"""A line of the prompt's docstring, which is in the RUN sandbox: proves the search itself works."""

SEARCH = (
    "for P in \"$(printf %s '{}' '{}')\" \"$(printf %s '{}' '{}')\"; do "
    'echo "== $(grep -rIlF --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev -e "$P" / 2>/dev/null '
    '| tr "\\n" " ")"; '
    'env | grep -cF -e "$P"; done'
).format(*HIDDEN_HALVES, *VISIBLE_HALVES)


def insert_body(name: str, body: str) -> str:
    """An editor call that puts ``body`` under the prompt of job ``name`` already in solution.py."""
    return tool_call(
        "str_replace_editor",
        command="insert",
        path="/workspace/solution.py",
        insert_line=he_instance(name)["prompt"].count("\n"),
        new_str=body.rstrip("\n"),
    )


def he_instance(name: str, **extra: Any) -> dict[str, Any]:
    """HumanEval/0 with a marker in its prompt (a comment) so the scripted policy can tell jobs apart."""
    return {**HE0, "prompt": f"# job {name}\n{HE0['prompt']}", "instance_id": name, **extra}


SUM = {
    "data_source": "codecontests",
    "description": "Read two integers a and b and print a + b.",
    "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
    "private_tests": {"input": ["10 20\n", "-5 5\n", "7 8\n"], "output": ["30\n", "0\n", "15\n"]},
    "time_limit": 2,
}


def sum_instance(name: str, **extra: Any) -> dict[str, Any]:
    return {**SUM, "description": f"[{name}] {SUM['description']}", "instance_id": name, **extra}


def write_program(source: str) -> str:
    return tool_call("bash", command=f"cat > /workspace/solution.py <<'EOF'\n{source}EOF")


async def test_code_jobs_through_the_service(
    make_api: APIFactory,
    test_image: Path,
    backend_available: dict[str, str | None],
    tokenizer: ChatTokenizer,
) -> None:
    api = await bwrap_service(make_api, test_image, backend_available)
    gold_body = HE0["canonical_solution"]
    run_it = 'cd /workspace && python3 -c "from solution import has_close_elements as f; print(f([1.0, 2.8, 3.0], 0.3))"'
    scripts = {
        "job he-gold": [
            tool_call("bash", command=SEARCH),
            insert_body("he-gold", gold_body),
            tool_call("bash", command=run_it),
            tool_call("submit"),
        ],
        "job he-wrong": [insert_body("he-wrong", "    return False\n"), tool_call("submit")],
        "job he-loop": [insert_body("he-loop", "    while True:\n        pass\n"), tool_call("submit")],
        "[sum-gold]": [
            write_program("a, b = map(int, input().split())\nprint(a + b)\n"),
            tool_call("bash", command="echo 1 2 | python3 /workspace/solution.py"),
            tool_call("submit"),
        ],
        "[sum-wrong]": [
            write_program("a, b = map(int, input().split())\nprint(a - b)\n"),
            tool_call("submit"),
        ],
        "[sum-half]": [  # right only for small sums: 2 of 4 tests
            write_program("a, b = map(int, input().split())\nprint(a + b if abs(a + b) < 5 else 0)\n"),
            tool_call("submit"),
        ],
        "[sum-loop]": [write_program("while True:\n    pass\n"), tool_call("submit")],
        "[sum-answer]": [  # never writes the file; submits the program as a code block
            tool_call("submit", answer="```python\na, b = map(int, input().split())\nprint(a + b)\n```"),
        ],
    }
    jobs = [
        ("he-gold", he_instance("he-gold"), {}),
        ("he-wrong", he_instance("he-wrong"), {}),
        ("he-loop", he_instance("he-loop", time_limit=2), {}),
        ("sum-gold", sum_instance("sum-gold"), {}),
        ("sum-wrong", sum_instance("sum-wrong"), {}),
        ("sum-half", sum_instance("sum-half"), {"reward_mode": "fraction"}),
        ("sum-loop", sum_instance("sum-loop", time_limit=1), {}),
        ("sum-answer", sum_instance("sum-answer"), {}),
    ]
    async with ScriptedLLM(by_marker(tokenizer, scripts)) as llm:
        results = await run_jobs(api, llm.url, jobs)

    for job_id, res in results.items():
        assert res["status"] == "completed" and res["filter"] is False, (job_id, res.get("error"))
    rewards = {job_id: res["reward"] for job_id, res in results.items()}
    assert rewards == {
        "he-gold": 1.0,
        "he-wrong": 0.0,
        "he-loop": 0.0,
        "sum-gold": 1.0,
        "sum-wrong": 0.0,
        "sum-half": 0.5,
        "sum-loop": 0.0,
        "sum-answer": 1.0,
    }, {j: r["artifacts"].get("eval_details") for j, r in results.items()}

    gold = results["he-gold"]
    search, _, ran, *_ = tool_observations(gold)
    hidden, visible = search.split("== ")[1:]
    assert hidden.split() == ["0"], search  # no file, no environment variable holds the hidden test
    assert "/workspace/solution.py" in visible.split(), search  # ...while the search does find the prompt
    assert ran.startswith("True"), ran  # the policy ran its own code
    assert gold["artifacts"]["solution_source"] == "file"
    assert gold["artifacts"]["solution"] == he_instance("he-gold")["prompt"] + gold_body
    assert gold["artifacts"]["eval_details"]["status"] == "passed"
    assert [t["function"]["name"] for t in gold["artifacts"]["tools"]] == [
        "bash",
        "str_replace_editor",
        "submit",
    ]

    for loop in ("he-loop", "sum-loop"):
        assert results[loop]["artifacts"]["eval_details"]["timed_out"] is True
    assert results["sum-loop"]["artifacts"]["eval_details"]["counts"] == {"timeout": 1, "not_run": 3}
    half = results["sum-half"]["artifacts"]["eval_details"]
    assert (half["passed"], half["total"], half["reward_mode"]) == (2, 4, "fraction")
    assert results["sum-answer"]["artifacts"]["solution_source"] == "answer"
    assert results["he-gold"]["timing"]["eval_s"] > 0


@pytest.mark.parametrize(
    ("instance", "field"),
    [
        ({**SUM, "language": "cpp"}, "'language'"),
        ({"data_source": "code", "problem": "p"}, "no test cases"),
        ({**SUM, "private_tests": "{broken"}, "'private_tests'"),
        ({**SUM, "public_tests": {"input": ["1"], "output": []}}, "'public_tests'"),
        ({**HE0, "entry_point": "1abc"}, "'entry_point'"),
        ({**HE0, "test": "assert True"}, "'test'"),
        ({**SUM, "reward_mode": "most"}, "'reward_mode'"),
        ({**SUM, "time_limit": "forever"}, "'time_limit'"),
    ],
)
async def test_bad_code_instances_are_400_naming_the_field(
    make_api: APIFactory, instance: dict[str, Any], field: str
) -> None:
    from raas.llm.models import prepare_tokenizer

    api = await make_api(tokenizer_dir=prepare_tokenizer())
    for path, body in (
        ("/v1/jobs", {"instance": instance}),
        ("/v1/jobs:batch", {"jobs": [{"instance": instance}]}),
    ):
        r = await api.client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["kind"] == "bad_request" and field in error["message"], error
    assert await api.service.ledger.counts() == {}


async def test_code_jobs_on_the_local_backend(
    make_api: APIFactory,
    test_image: Path,
    backend_available: dict[str, str | None],
    tokenizer: ChatTokenizer,
) -> None:
    """The local backend works in a private host dir, not ``/workspace``: the prompt names the real path,
    and the solution is read from it and judged in a workspace of its own."""
    api = await bwrap_service(make_api, test_image, backend_available, backend="local")
    body = HE0["canonical_solution"]
    scripts = {  # the shell starts in the workdir: relative paths land next to the prompt's solution.py
        "job he-local": [
            tool_call("bash", command="pwd"),
            tool_call("bash", command=f"cat >> solution.py <<'EOF'\n{body}EOF"),
            tool_call("submit"),
        ],
        "[sum-local]": [
            tool_call("bash", command="pwd"),
            write_program("a, b = map(int, input().split())\nprint(a + b)\n").replace("/workspace/", ""),
            tool_call("submit"),
        ],
    }
    jobs = [("he-local", he_instance("he-local"), {}), ("sum-local", sum_instance("sum-local"), {})]
    async with ScriptedLLM(by_marker(tokenizer, scripts)) as llm:
        results = await run_jobs(api, llm.url, jobs)
    for job_id, res in results.items():
        assert res["status"] == "completed" and res["reward"] == 1.0, (
            job_id,
            res.get("error"),
            res["artifacts"],
        )
        workdir = tool_observations(res)[0].splitlines()[0]
        assert workdir != "/workspace" and f"{workdir}/solution.py" in res["messages"][1]["content"]


async def test_an_oversized_solution_is_never_pulled_into_the_service(
    make_api: APIFactory,
    test_image: Path,
    backend_available: dict[str, str | None],
    tokenizer: ChatTokenizer,
) -> None:
    api = await bwrap_service(make_api, test_image, backend_available)
    flood = "head -c 50000000 /dev/zero | tr '\\0' '#' > /workspace/solution.py && stat -c %s /workspace/solution.py"
    scripts = {"[sum-flood]": [tool_call("bash", command=flood), tool_call("submit")]}
    async with ScriptedLLM(by_marker(tokenizer, scripts)) as llm:
        results = await run_jobs(api, llm.url, [("sum-flood", sum_instance("sum-flood"), {})])
    res = results["sum-flood"]
    assert tool_observations(res)[0].startswith("50000000")
    assert res["status"] == "completed" and res["reward"] == 0.0
    assert res["artifacts"]["solution_source"] == "too_large" and res["artifacts"]["solution"] is None
    assert "larger than" in res["artifacts"]["eval_details"]["reason"]
