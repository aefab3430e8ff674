"""Normalizing the three APIs' requests into one message form (unit)."""

from __future__ import annotations

import pytest

from raas.errors import RaasError
from raas.gateway.messages import (
    from_chat,
    from_messages,
    from_responses,
    message_key,
    template_message,
    tools_key,
)

pytestmark = pytest.mark.unit


def test_chat_roles_parts_and_tool_calls() -> None:
    req = from_chat(
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{broken"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
                {"role": "function", "name": "g", "content": "legacy"},
            ],
            "max_tokens": 7,
            "temperature": 0.2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    )
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert req.messages[1]["content"] == "a\nb"
    assert req.messages[2]["tool_calls"] == [
        {"id": "c1", "name": "f", "arguments": {"x": 1}},
        {"id": "c2", "name": "g", "arguments": "{broken"},  # kept as written, never guessed
    ]
    assert req.max_tokens == 7 and req.sampling == {"temperature": 0.2} and req.stream and req.include_usage
    assert req.tool_choice == "f"


def test_responses_items_become_turns() -> None:
    req = from_responses(
        {
            "instructions": "sys",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
                {"type": "reasoning", "summary": []},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "let me"}],
                },
                {"type": "function_call", "call_id": "k1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "k2", "name": "g", "arguments": '{"a": 2}'},
                {"type": "function_call_output", "call_id": "k1", "output": "one"},
                {
                    "type": "function_call_output",
                    "call_id": "k2",
                    "output": [{"type": "input_text", "text": "two"}],
                },
            ],
            "max_output_tokens": 9,
        }
    )
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert req.messages[2] == {
        "role": "assistant",
        "content": "let me",
        "tool_calls": [
            {"id": "k1", "name": "f", "arguments": {}},
            {"id": "k2", "name": "g", "arguments": {"a": 2}},
        ],
    }
    assert req.messages[4] == {"role": "tool", "content": "two", "tool_call_id": "k2"}
    history = [{"role": "system", "content": "old"}, {"role": "user", "content": "q"}]
    req = from_responses({"instructions": "new", "input": "next"}, history)
    assert req.messages == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "q"},
        {"role": "user", "content": "next"},
    ]


def test_anthropic_blocks_results_before_text_and_thinking_dropped() -> None:
    req = from_messages(
        {
            "max_tokens": 5,
            "system": [{"type": "text", "text": "sys"}],
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "ok"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"p": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "res"}],
                        },
                        {"type": "text", "text": "go on"},
                    ],
                },
            ],
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"},
        }
    )
    assert req.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [{"id": "t1", "name": "f", "arguments": {"p": 1}}],
        },
        {"role": "tool", "content": "res", "tool_call_id": "t1"},
        {"role": "user", "content": "go on"},
    ]
    assert req.tools == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert req.tool_choice == "required"
    with pytest.raises(RaasError, match="not supported in a user message"):
        from_messages(
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f"}]}]}
        )


def test_keys_ignore_our_call_ids_but_not_what_renders() -> None:
    a = {"role": "assistant", "content": "", "tool_calls": [{"id": "x", "name": "f", "arguments": {"q": 1}}]}
    b = {"role": "assistant", "content": "", "tool_calls": [{"id": "y", "name": "f", "arguments": {"q": 1}}]}
    c = {"role": "assistant", "content": "", "tool_calls": [{"id": "x", "name": "f", "arguments": {"q": 2}}]}
    assert message_key(a) == message_key(b) != message_key(c)
    assert message_key({"role": "tool", "content": "r", "tool_call_id": "1"}) != message_key(
        {"role": "tool", "content": "r", "tool_call_id": "2"}
    )
    assert tools_key(None) == tools_key([])


def test_template_form_native_or_hermes() -> None:
    msg = {
        "role": "assistant",
        "content": "hi",
        "tool_calls": [{"id": "x", "name": "f", "arguments": {"q": 1}}],
    }
    native = template_message(msg, native_tools=True)
    assert native["tool_calls"] == [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": {"q": 1}}}
    ]
    assert native["content"] == "hi"
    hermes = template_message(msg, native_tools=False)
    assert "tool_calls" not in hermes
    assert hermes["content"] == 'hi\n<tool_call>\n{"name": "f", "arguments": {"q": 1}}\n</tool_call>'
