"""Tool schemas, argument checks and observation truncation (no sandbox needed)."""

from __future__ import annotations

import pytest

from raas.agent.tools import SCHEMAS, ToolSet, truncate, validate_arguments
from raas.errors import RaasError

pytestmark = pytest.mark.unit


def test_schemas_are_openai_function_tools() -> None:
    for name, schema in SCHEMAS.items():
        assert schema["type"] == "function" and schema["function"]["name"] == name
        params = schema["function"]["parameters"]
        assert params["type"] == "object" and set(params["required"]) <= set(params["properties"])


@pytest.mark.parametrize(
    ("name", "args", "problem"),
    [
        ("bash", {"command": "ls"}, None),
        ("bash", {"command": "ls", "timeout": 5}, None),
        ("bash", {}, "missing required argument(s) command"),
        ("bash", {"command": 3}, "must be of type string"),
        ("bash", {"command": "ls", "timeout": True}, "must be of type number"),
        ("bash", {"command": "ls", "cwd": "/"}, "unknown argument(s) cwd"),
        ("bash", {"command": "y\n", "is_input": True}, None),
        ("bash", {"command": "y", "is_input": "yes"}, "must be of type boolean"),
        ("str_replace_editor", {"command": "view", "path": "/x", "view_range": [1, 5]}, None),
        ("str_replace_editor", {"command": "delete", "path": "/x"}, "must be one of"),
        ("finish", {"answer": "42"}, None),
        ("finish", {"answer": None}, None),
    ],
)
def test_validate_arguments(name: str, args: dict, problem: str | None) -> None:
    got = validate_arguments(name, args)
    if problem is None:
        assert got is None
    else:
        assert got is not None and problem in got


def test_toolset() -> None:
    ts = ToolSet(["bash", "finish"])
    assert [s["function"]["name"] for s in ts.schemas] == ["bash", "finish"]
    assert ts.is_terminal("finish") and not ts.is_terminal("bash")
    unknown = ts.check("ipython", {"code": "1"})
    assert unknown is not None and unknown.kind == "unknown_tool" and "bash, finish" in unknown.text
    bad = ts.check("bash", {})
    assert bad is not None and bad.kind == "bad_arguments"
    assert ts.check("bash", {"command": "ls"}) is None
    with pytest.raises(RaasError) as e:
        ToolSet(["rm_rf"])
    assert e.value.kind == "bad_request"


def test_truncate_keeps_head_and_tail() -> None:
    assert truncate("short", 100) == "short"
    text = "A" * 600 + "B" * 600
    out = truncate(text, 400)
    assert out.startswith("A" * 200) and out.endswith("B" * 200)
    assert "[... 800 bytes truncated ...]" in out
    # Multi-byte characters are never split into invalid UTF-8.
    out = truncate("é" * 1000, 301)
    out.encode("utf-8")
    assert "truncated" in out


def test_one_classification_of_failures() -> None:
    """Every kind is either shown to the policy or ends the rollout, never both; unknown kinds end it."""
    from typing import get_args

    from raas.errors import INFRA_KINDS, OBSERVATION_KINDS, ErrorKind, is_infrastructure

    kinds = set(get_args(ErrorKind))
    assert OBSERVATION_KINDS | INFRA_KINDS == kinds and not OBSERVATION_KINDS & INFRA_KINDS
    for kind in (
        "tool_timeout",
        "sandbox_dead",
        "sandbox_start_failed",
        "llm_unavailable",
        "llm_timeout",
        "verifier_timeout",
        "token_mismatch",
        "timeout",
        "cancelled",
        "internal",
        "a_kind_nobody_declared",
    ):
        assert is_infrastructure(kind), kind
        assert RaasError("x", kind=kind).infrastructure
    for kind in ("tool_error", "bad_request", "not_found", "tool_unavailable", "payload_too_large"):
        assert not is_infrastructure(kind), kind
