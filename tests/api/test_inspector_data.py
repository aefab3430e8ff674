"""The trajectory inspector's data (raas.api.inspector_data) on hand-built results: the list's filters and
pages, a file that is not a results file, the token view of a multi-turn result, and the caps that keep a
huge observation from making a page unusable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raas.api import inspector_data
from raas.api.inspector_data import FileJobs, JobQuery, job_detail, token_view
from raas.core.jobs import ErrorInfo, JobResult
from raas.core.trajectory import Message
from raas.errors import RaasError
from tests.trainer.test_grpo import result

pytestmark = pytest.mark.unit


def decode(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def results_file(tmp_path: Path, results: list[JobResult]) -> Path:
    path = tmp_path / "results.jsonl"
    path.write_text("".join(r.model_dump_json() + "\n" for r in results))
    return path


def sample_results() -> list[JobResult]:
    out = [
        result("g1.0.0", 1.0, [1, 2], [([5, 6], "0"), ([7], "1")]),
        result("g1.1.0", 0.0, [1, 2], [([8], "0")]),
        result("g2.0.0", 0.5, [3], [([9], "1")]),
    ]
    failed = JobResult(
        job_id="lone",
        status="failed",
        filter=True,
        error=ErrorInfo(stage="run", kind="llm_timeout", message="no answer"),
    )
    return [*out, failed]


async def test_the_list_filters_and_pages(tmp_path: Path) -> None:
    jobs = FileJobs(results_file(tmp_path, sample_results()))
    assert (await jobs.page(JobQuery()))["total"] == 4
    assert [j["job_id"] for j in (await jobs.page(JobQuery(group="g1")))["jobs"]] == ["g1.0.0", "g1.1.0"]
    assert [j["job_id"] for j in (await jobs.page(JobQuery(outcome="filtered")))["jobs"]] == ["lone"]
    assert [j["job_id"] for j in (await jobs.page(JobQuery(status="failed")))["jobs"]] == ["lone"]
    assert [j["job_id"] for j in (await jobs.page(JobQuery(min_reward=0.5)))["jobs"]] == ["g1.0.0", "g2.0.0"]
    assert [j["job_id"] for j in (await jobs.page(JobQuery(max_reward=0.4)))["jobs"]] == ["g1.1.0"]
    assert [j["job_id"] for j in (await jobs.page(JobQuery(weight_version="1")))["jobs"]] == [
        "g1.0.0",
        "g2.0.0",
    ]
    assert [j["job_id"] for j in (await jobs.page(JobQuery(text="LONE")))["jobs"]] == ["lone"]
    page = await jobs.page(JobQuery(offset=1, limit=2))
    assert page["total"] == 4 and [j["job_id"] for j in page["jobs"]] == ["g1.1.0", "g2.0.0"]
    lone = (await jobs.page(JobQuery(text="lone")))["jobs"][0]
    assert lone["error"] == "run/llm_timeout: no answer" and lone["group_id"] is None


def test_a_file_that_is_not_results_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = results_file(tmp_path, sample_results()[:1])
    path.write_text(path.read_text() + json.dumps({"hello": 1}) + "\n")
    with pytest.raises(RaasError, match=r"results.jsonl:2 is not a raas job result"):
        FileJobs(path)


def test_the_token_view_walks_the_turns() -> None:
    r = result("g.0.0", 1.0, [1, 2], [([5, 6], "0"), ([7], "1")], obs=[9, 9])
    view = token_view(r, decode)
    assert [t[0] for t in view["tokens"]] == ["<1>", "<2>", "<5>", "<6>", "<9>", "<9>", "<7>"]
    assert [t[1] for t in view["tokens"]] == [0, 0, 1, 1, 0, 0, 1]
    assert [t[3] for t in view["tokens"]] == [-1, -1, 0, 0, 1, 1, 1]
    assert (view["prompt"], view["sampled"], view["masked"], view["total"]) == (2, 3, 2, 7)
    assert [t["weight_version"] for t in view["turns"]] == ["0", "1"]


def test_the_token_view_shows_every_segment_of_a_rebuilt_context() -> None:
    """A rollout whose context was rebuilt (summarised, truncated) has several token sequences: each is
    shown from its own prompt, its turns keep their indices, and the counts cover all of them."""
    first = result("g.0.0", 1.0, [1, 2], [([5, 6], "0"), ([7], "1")], obs=[9])
    second = result("g.0.0", 1.0, [3], [([8], "2")])
    later = second.turns[0].model_copy(update={"index": 2, "segment": 1})
    r = first.model_copy(
        update={
            "turns": [*first.turns, later],
            "segments": [first.token_trajectory, second.token_trajectory],
            "token_trajectory": second.token_trajectory,
        }
    )
    view = token_view(r, decode)
    assert [t[0] for t in view["tokens"]] == ["<1>", "<2>", "<5>", "<6>", "<9>", "<7>", "<3>", "<8>"]
    assert [t[3] for t in view["tokens"]] == [-1, -1, 0, 0, 1, 1, -1, 2]
    assert [t[4] for t in view["tokens"]] == [0, 0, 0, 0, 0, 0, 1, 1]
    assert (view["segments"], view["prompt"], view["sampled"], view["masked"]) == (2, 3, 4, 1)


def test_the_history_splits_states_from_sandboxes() -> None:
    history = [
        ("queued", 100.0, None),
        ("init", 100.5, None),
        ("sandbox", 100.7, json.dumps({"id": "sb1", "backend": "bwrap", "image": "/img"})),
        ("sandbox", 100.8, "not json"),
        ("completed", 103.0, None),
    ]
    view = inspector_data.history_view(history)
    assert [(t["status"], t["at_s"]) for t in view["transitions"]] == [
        ("queued", 0.0),
        ("init", 0.5),
        ("completed", 3.0),
    ]
    assert [b.get("id") for b in view["sandboxes"]] == ["sb1", None]


def test_caps_keep_a_huge_observation_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inspector_data, "MAX_VIEW_TOKENS", 5)
    monkeypatch.setattr(inspector_data, "MAX_TEXT_CHARS", 10)
    r = result("g.0.0", 1.0, [1, 2], [([5, 6], "0"), ([7], "1")], obs=[9, 9])
    r.messages = [Message(role="tool", content="x" * 25)]
    detail = job_detail(r, decode)
    assert detail["tokens"]["shown"] == 5 and detail["tokens"]["total"] == 7
    assert detail["messages"][0]["text"] == "x" * 10 and detail["messages"][0]["cut"] == 15
    assert job_detail(r, None)["tokens"] is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.jsonl"], "is not a file"),
        (["notes.txt"], "notes.txt:1 is not a raas job result"),
        (["results.jsonl", "--host", "0.0.0.0"], "not a loopback address"),
        (["results.jsonl", "--host", "example.org"], "not an IP address"),
    ],
)
def test_raas_view_refuses_what_it_cannot_show_safely(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    from typer.testing import CliRunner

    from raas.cli import app

    results_file(tmp_path, sample_results())
    (tmp_path / "notes.txt").write_text("hello\n")
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(app, ["view", *args])
    assert out.exit_code == 2 and message in " ".join(out.output.split()), out.output
