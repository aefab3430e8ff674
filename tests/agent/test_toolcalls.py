"""Tool-call parsing: both formats, several calls, and every malformed shape ending as an observation."""

from __future__ import annotations

import pytest

from raas.agent.toolcalls import TOOL_CALLS, ToolCallStats, parse_tool_calls

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {}}}, "python"]


def _count(fmt: str, outcome: str) -> float:
    return TOOL_CALLS.labels(fmt, outcome)._value.get()


def test_hermes_single_call_with_text_around() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    r = parse_tool_calls(text, TOOLS)
    assert r.format == "hermes" and not r.errors
    assert [(c.name, c.arguments) for c in r.calls] == [("bash", {"command": "ls"})]
    assert r.content == "Let me look."
    assert r.error_observation() is None
    assert r.calls[0].to_openai()["function"]["arguments"] == '{"command": "ls"}'


def test_hermes_several_calls_and_string_arguments() -> None:
    text = (
        '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}</tool_call>'
        '<tool_call>{"name": "python", "parameters": {"code": "1+1"}}</tool_call>'
    )
    r = parse_tool_calls(text, TOOLS)
    assert [(c.name, c.arguments) for c in r.calls] == [
        ("bash", {"command": "pwd"}),
        ("python", {"code": "1+1"}),
    ]
    assert len({c.id for c in r.calls}) == 2


def test_plain_json_call_object_list_fenced_and_openai_shape() -> None:
    assert parse_tool_calls('{"name": "bash", "arguments": {"command": "ls"}}').calls[0].name == "bash"
    r = parse_tool_calls(
        '[{"name": "bash", "arguments": {}}, {"name": "python", "parameters": {"code": "x"}}]'
    )
    assert [c.name for c in r.calls] == ["bash", "python"] and r.format == "json"
    r = parse_tool_calls('```json\n{"name": "bash", "parameters": {"command": "id"}}\n```')
    assert r.calls[0].arguments == {"command": "id"}
    r = parse_tool_calls('{"type": "function", "function": {"name": "bash", "arguments": "{}"}}')
    assert r.calls[0].name == "bash" and r.calls[0].arguments == {}


def test_plain_text_and_non_call_json_are_not_calls() -> None:
    for text in ("The answer is 42.", '{"answer": 42}', "[1, 2, 3]", "", "{ not json at all"):
        r = parse_tool_calls(text)
        assert r.calls == [] and r.errors == [] and r.format == "none", text


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}', "not closed"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>["bash"]</tool_call>', "not an object"),
        (
            '<tool_call>{"name": "bash", "arguments": "{oops"}</tool_call>',
            "arguments of 'bash' are not valid JSON",
        ),
        ('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('{"name": "bash", "arguments": {', "not valid JSON"),
    ],
)
def test_malformed_calls_become_error_observations(text: str, needle: str) -> None:
    before = sum(_count(f, "malformed") for f in ("hermes", "json"))
    r = parse_tool_calls(text, TOOLS)
    assert r.malformed and r.calls == []
    obs = r.error_observation()
    assert obs is not None and needle in obs and "<tool_call>" in obs
    assert sum(_count(f, "malformed") for f in ("hermes", "json")) == before + 1


def test_unknown_tool_is_reported_and_good_calls_survive() -> None:
    before = _count("hermes", "unknown_tool")
    text = (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    )
    r = parse_tool_calls(text, TOOLS)
    assert [c.name for c in r.calls] == ["bash"]
    assert "unknown tool 'rm_rf'" in (r.error_observation() or "")
    assert _count("hermes", "unknown_tool") == before + 1
    stats = ToolCallStats()
    stats.add(r)
    assert (stats.parsed, stats.malformed, stats.unknown_tool) == (1, 0, 1)


def test_non_string_input_never_raises() -> None:
    r = parse_tool_calls(None)  # type: ignore[arg-type]
    assert r.calls == [] and r.errors == []


SCHEMA_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "line": {"type": "integer"}, "text": {}},
            },
        },
    }
]


def test_qwen3_coder_xml_call_typed_by_the_schema() -> None:
    text = (
        "Fixing it.\n<tool_call>\n<function=edit>\n<parameter=path>\n/a.py\n</parameter>\n"
        "<parameter=line>\n12\n</parameter>\n<parameter=text>\n  x = 1\n\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    r = parse_tool_calls(text, SCHEMA_TOOLS)
    assert r.format == "qwen_xml" and not r.errors
    assert r.calls[0].name == "edit"
    # integer by the schema; strings keep inner whitespace (one newline trimmed at each end)
    assert r.calls[0].arguments == {"path": "/a.py", "line": 12, "text": "  x = 1\n"}
    assert r.content == "Fixing it."


def test_qwen3_coder_xml_unknown_function_is_an_error() -> None:
    r = parse_tool_calls("<tool_call><function=rm><parameter=x>1</parameter></function></tool_call>", ["ls"])
    assert r.calls == [] and "unknown tool 'rm'" in r.errors[0]


def test_llama_function_tag_and_python_tag_calls() -> None:
    r = parse_tool_calls('Sure. <function=bash>{"command": "ls -l"}</function>', TOOLS)
    assert r.format == "llama" and r.content == "Sure."
    assert [(c.name, c.arguments) for c in r.calls] == [("bash", {"command": "ls -l"})]
    r = parse_tool_calls('<|python_tag|>{"name": "bash", "parameters": {"command": "id"}}', TOOLS)
    assert r.format == "llama" and [(c.name, c.arguments) for c in r.calls] == [("bash", {"command": "id"})]
    r = parse_tool_calls(
        '<|python_tag|>{"name": "bash", "parameters": {}}; {"name": "python", "parameters": {"code": "1"}}',
        TOOLS,
    )
    assert [c.name for c in r.calls] == ["bash", "python"]
    r = parse_tool_calls('{"name": "bash", "parameters": {}}; {"name": "python", "parameters": {}}', TOOLS)
    assert r.format == "json" and [c.name for c in r.calls] == ["bash", "python"]


def test_llama_malformed_calls_are_errors_not_crashes() -> None:
    r = parse_tool_calls("<function=bash>{not json}</function>", TOOLS)
    assert r.calls == [] and "not valid JSON" in r.errors[0]
    r = parse_tool_calls("<|python_tag|>print('hi')", TOOLS)
    assert r.calls == [] and r.errors
    r = parse_tool_calls("<|python_tag|>", TOOLS)
    assert r.calls == [] and r.errors
