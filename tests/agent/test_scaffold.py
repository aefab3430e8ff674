"""The compact scaffold's tools (view, search, replace, run_tests) in a real sandbox, reached the way the
agent loop reaches them: the policy's text parsed into a call, checked, dispatched."""

from __future__ import annotations

import pytest

from raas.agent.loop import _parse
from raas.agent.scaffold import SCAFFOLD_TOOLS, TOOL_LINES, describe_tools
from raas.agent.tools import ToolSet
from raas.sandbox import Sandbox
from raas.tasks.swe.mini.handler import TOOLS

pytestmark = pytest.mark.integration

CODE = 'def clamp(x, lo, hi):\n    """x in [lo, hi]."""\n    if x > hi:\n        return hi\n    if x > hi:\n        return hi\n    return x\n'


def tools() -> ToolSet:
    return ToolSet(TOOLS, host_tools=SCAFFOLD_TOOLS, show_schemas=False)


async def call(sandbox: Sandbox, reply: str) -> tuple[str, bool, str | None]:
    """One policy reply holding one call: parsed, checked and run as the agent loop does."""
    calls, errors = _parse(reply)
    assert not errors and len(calls) == 1, errors
    ts = tools()
    obs = ts.check(calls[0].name, calls[0].arguments) or await ts.dispatch(
        sandbox, calls[0].name, calls[0].arguments, timeout_s=30, cap_bytes=8000
    )
    return obs.text, obs.is_error, obs.kind


@pytest.mark.unit
def test_the_prompt_describes_every_tool_in_one_line_and_shows_no_schemas() -> None:
    ts = tools()
    assert ts.schemas == [] and [s["function"]["name"] for s in ts.declared_schemas] == TOOLS
    text = describe_tools(TOOLS)
    assert text.count("\n") == len(TOOLS) - 1 and all(TOOL_LINES[t] in text for t in TOOLS)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("reply", "kind"),
    [
        (
            '<tool_call>\n{"name": "replace", "arguments": {"path": "a.py", "old": "x"}}\n</tool_call>',
            "bad_arguments",
        ),
        ('<tool_call>\n{"name": "view", "arguments": {"file": "a.py"}}\n</tool_call>', "bad_arguments"),
        ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>', "unknown_tool"),
        ('<tool_call>\n{"name": "view", "arguments": {"path": 3}}\n</tool_call>', "bad_arguments"),
    ],
)
def test_calls_that_do_not_fit_are_told_apart_before_anything_runs(reply: str, kind: str) -> None:
    calls, errors = _parse(reply)
    assert not errors
    bad = tools().check(calls[0].name, calls[0].arguments)
    assert bad is not None and bad.kind == kind and bad.is_error


@pytest.mark.unit
def test_a_malformed_call_is_a_parse_error() -> None:
    calls, errors = _parse('<tool_call>\n{"name": "view", "arguments": {"path": "a.py"\n</tool_call>')
    assert calls == [] and errors


async def test_view_search_replace_and_run_tests(sandbox: Sandbox) -> None:
    await sandbox.tools.write_file(f"{sandbox.workdir_inside()}/clamp.py", CODE)
    text, err, _ = await call(
        sandbox, '<tool_call>\n{"name": "view", "arguments": {"path": "clamp.py"}}\n</tool_call>'
    )
    assert (
        not err
        and text.splitlines()[0] == "1  def clamp(x, lo, hi):"
        and text.splitlines()[-1] == "7      return x"
    )
    text, err, _ = await call(
        sandbox, '<tool_call>{"name": "search", "arguments": {"text": "if x > hi"}}</tool_call>'
    )
    assert not err and text.splitlines() == ["clamp.py:3:    if x > hi:", "clamp.py:5:    if x > hi:"]
    # Not unique: nothing changes, and the policy is told where it occurs.
    text, err, kind = await call(
        sandbox,
        '<tool_call>{"name": "replace", "arguments": {"path": "clamp.py", "old": "if x > hi:", "new": "if x < lo:"}}</tool_call>',
    )
    assert err and kind == "tool_error" and "occurs 2 times" in text
    assert (await sandbox.tools.read_file(f"{sandbox.workdir_inside()}/clamp.py")).decode() == CODE
    text, err, kind = await call(
        sandbox,
        '<tool_call>{"name": "replace", "arguments": {"path": "clamp.py", "old": "x >= hi", "new": "x"}}</tool_call>',
    )
    assert err and kind == "tool_error" and "is not in clamp.py" in text
    reply = (
        '<tool_call>{"name": "replace", "arguments": {"path": "clamp.py", "old": "    if x > hi:\\n        return hi\\n    return x",'
        ' "new": "    if x < lo:\\n        return lo\\n    return x"}}</tool_call>'
    )
    text, err, _ = await call(sandbox, reply)
    assert (
        not err
        and text == "Replaced. clamp.py now reads:\n5      if x < lo:\n6          return lo\n7      return x"
    )
    fixed = (await sandbox.tools.read_file(f"{sandbox.workdir_inside()}/clamp.py")).decode()
    assert fixed == CODE.replace(
        "    if x > hi:\n        return hi\n    return x", "    if x < lo:\n        return lo\n    return x"
    )
    text, err, kind = await call(
        sandbox, '<tool_call>{"name": "view", "arguments": {"path": "missing.py"}}</tool_call>'
    )
    assert err and kind == "tool_error" and "no such file" in text
    await sandbox.tools.write_file(
        f"{sandbox.workdir_inside()}/test_clamp.py",
        "from clamp import clamp\n\ndef test_hi():\n    assert clamp(2, 0, 3) == 9\n",
    )
    text, err, _ = await call(sandbox, '<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>')
    assert not err and "1 failed" in text and "assert 2 == 9" in text
