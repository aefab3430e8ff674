"""How a raas result maps onto the ProRL server's result fields (pure functions, no server)."""

from __future__ import annotations

import pytest

from raas.api.native import normalize_address
from raas.api.prorl import prorl_message, prorl_result
from raas.core.jobs import ErrorInfo, JobResult, Timing
from raas.core.trajectory import Message, ToolCall
from raas.errors import RaasError

pytestmark = pytest.mark.unit


def _result(status: str, stage: str | None = None, kind: str = "handler_error", **kw: object) -> JobResult:
    error = ErrorInfo(stage=stage, kind=kind, message="m") if stage else None
    return JobResult(
        job_id="j",
        status=status,
        error=error,  # type: ignore[arg-type]
        timing=Timing(queue_s=1.0, init_s=2.0, run_s=3.0, eval_s=4.0, total_s=12.0),
        **kw,
    )


@pytest.mark.parametrize(
    ("status", "stage", "kind", "critical"),
    [
        ("completed", None, "", None),
        ("failed", "init", "sandbox_start_failed", "init"),
        ("failed", "run", "llm_unavailable", "run"),
        ("failed", "eval", "handler_error", "eval"),
        ("failed", "queue", "interrupted", "init"),
        ("timeout", "run", "timeout", "timeout"),
        ("cancelled", "eval", "cancelled", "timeout"),
    ],
)
def test_critical_error_and_filter(status: str, stage: str | None, kind: str, critical: str | None) -> None:
    out = prorl_result(
        _result(
            status,
            stage,
            kind,
            reward=1.0 if status == "completed" else None,
            resolved=status == "completed",
            filter=status != "completed",
        )
    )
    assert out["critical_error"] == critical
    assert out["filter"] is (critical is not None)
    assert out["success"] is (status == "completed")
    if stage:
        assert out["error"] == f"Error in {stage}: [{kind}] m"
        assert out["error_detail"] == {"stage": stage, "kind": kind, "message": "m"}
    else:
        assert out["error"] is None and out["error_detail"] is None


def test_timing_has_both_key_sets() -> None:
    t = prorl_result(_result("timeout", "run", "timeout"))["timing"]
    assert (t["init_time"], t["run_time"], t["eval_time"], t["others_time"]) == (2.0, 3.0, 4.0, 3.0)
    assert t["counted_elapsed"] == 9.0 and t["timeout_triggered"] is True and t["total_s"] == 12.0


def test_messages_keep_the_token_sequence() -> None:
    msgs = [
        Message(role="user", content="q", input_ids=[1, 2]),
        Message(
            role="assistant",
            content="a",
            input_ids=[3],
            output_ids=[4, 5],
            logprobs=[-0.1, -0.2],
            tool_calls=[ToolCall(id="c1", name="finish", arguments={"answer": "7"})],
        ),
        Message(role="tool", content="ok", tool_call_id="c1", name="finish", input_ids=[6, 7]),
    ]
    out = [prorl_message(m.model_dump()) for m in msgs]
    assert [t for m in out for t in m["input_ids"] + m["token_ids"]] == [1, 2, 3, 4, 5, 6, 7]
    assert out[1]["tool_calls"] == [{"id": "c1", "name": "finish", "arguments": '{"answer": "7"}'}]
    assert out[0]["tool_calls"] is None and out[0]["token_ids"] == [] and out[1]["output_ids"] == [4, 5]
    assert out[2]["tool_call_id"] == "c1" and out[1]["logprobs"] == [-0.1, -0.2]


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("http://h:8000/v1", "http://h:8000"),
        ("http://h:8000/v1/", "http://h:8000"),
        ("https://h/", "https://h"),
        (" http://h:1 ", "http://h:1"),
    ],
)
def test_normalize_address(given: str, want: str) -> None:
    assert normalize_address(given) == want


@pytest.mark.parametrize("bad", ["ftp://h", "h:8000", "http://", ""])
def test_normalize_address_rejects(bad: str) -> None:
    with pytest.raises(RaasError) as e:
        normalize_address(bad)
    assert e.value.kind == "bad_request"
