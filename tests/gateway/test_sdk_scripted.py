"""The gateway with the scripted policy (real vLLM wire protocol, real tool calls) and the real OpenAI and
Anthropic SDKs as clients: structured tool calls both ways, streaming and not, and a token record that is
exactly what was sent and sampled."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.agent.scripted import tool_call
from tests.gateway.conftest import ANTHROPIC_BASH, BASH_TOOL, check_exact, scripted_rig, sent_prompts

from raas.llm.tokenizer import ChatTokenizer

pytestmark = pytest.mark.integration

SCRIPT = [
    "Let me look around first.\n" + tool_call("bash", command="ls -la"),
    tool_call("bash", command="cat README.md"),
    "The README says hello. Done.",
]


async def _openai_dialogue(client: Any, stream: bool) -> list[Any]:
    """Three turns through the OpenAI SDK, re-sending the history as agents do."""
    messages: list[Any] = [
        {"role": "system", "content": "You are a careful engineer."},
        {"role": "user", "content": "What does the README say?"},
    ]
    replies = []
    for observation in ("total 8\n-rw-r--r-- README.md\n", "hello\n", None):
        if stream:
            content, calls = "", {}
            chunks = await client.chat.completions.create(
                model="policy", messages=messages, tools=[BASH_TOOL], stream=True
            )
            finish = None
            async for chunk in chunks:
                delta = chunk.choices[0].delta
                finish = chunk.choices[0].finish_reason or finish
                content += delta.content or ""
                for tc in delta.tool_calls or []:
                    entry = calls.setdefault(
                        tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                    entry["id"] = tc.id or entry["id"]
                    entry["function"]["name"] += (tc.function and tc.function.name) or ""
                    entry["function"]["arguments"] += (tc.function and tc.function.arguments) or ""
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [calls[i] for i in sorted(calls)]
            replies.append((message, finish))
        else:
            r = await client.chat.completions.create(model="policy", messages=messages, tools=[BASH_TOOL])
            message = r.choices[0].message.model_dump(exclude_none=True)
            replies.append((message, r.choices[0].finish_reason))
            assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
        messages.append(message)
        if observation is not None:
            for call in message.get("tool_calls", []):
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": observation})
    return replies


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_sdk_tool_calls_and_exact_record(tok: ChatTokenizer, stream: bool) -> None:
    async with scripted_rig(tok, SCRIPT) as rig:
        ep = await rig.open()
        replies = await _openai_dialogue(ep.openai(), stream)
        (m1, f1), (m2, f2), (m3, f3) = replies
        assert f1 == f2 == "tool_calls" and f3 == "stop"
        assert m1["content"] == "Let me look around first."
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m1["tool_calls"]
        ] == [("bash", {"command": "ls -la"})]
        assert m2.get("content") in (None, "") and json.loads(
            m2["tool_calls"][0]["function"]["arguments"]
        ) == {"command": "cat README.md"}
        assert m3["content"] == "The README says hello. Done." and "tool_calls" not in m3
        out = ep.session.run_output()
        gw = out.artifacts["gateway"]
        assert gw["continued"] == 2 and gw["full_renders"] == 1 and len(gw["segments"]) == 1
        assert out.segments == []  # one sequence: token_trajectory is all of it
        check_exact(out, sent_prompts(rig.server))
        # the sampled IDs are the script's, byte for byte, each followed by the template's closing
        for turn, completion in zip(out.turns, rig.script, strict=True):
            assert turn.output_ids == completion.token_ids
            assert turn.logprobs == completion.logprobs
        # each later prompt is the previous prompt + its sampled IDs + the new tokens: append-only
        sent = sent_prompts(rig.server)
        for i in (1, 2):
            assert (
                sent[i][: len(sent[i - 1]) + len(rig.script[i - 1].token_ids)]
                == sent[i - 1] + rig.script[i - 1].token_ids
            )
        assert gw["drift"] == {"resent_replies": 2, "retokenize_differently": []}


async def _anthropic_dialogue(client: Any, stream: bool) -> list[Any]:
    messages: list[Any] = [{"role": "user", "content": "What does the README say?"}]
    replies = []
    for observation in ("total 8\n-rw-r--r-- README.md\n", "hello\n", None):
        kwargs = {
            "model": "policy",
            "max_tokens": 256,
            "system": "You are a careful engineer.",
            "tools": [ANTHROPIC_BASH],
        }
        if stream:
            async with client.messages.stream(messages=messages, **kwargs) as s:
                async for _ in s:
                    pass
                message = await s.get_final_message()
        else:
            message = await client.messages.create(messages=messages, **kwargs)
        replies.append(message)
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}
        )
        uses = [b for b in message.content if b.type == "tool_use"]
        if observation is not None and uses:
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": u.id, "content": observation} for u in uses
                    ],
                }
            )
    return replies


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_sdk_tool_use_and_exact_record(tok: ChatTokenizer, stream: bool) -> None:
    async with scripted_rig(tok, SCRIPT) as rig:
        ep = await rig.open()
        r1, r2, r3 = await _anthropic_dialogue(ep.anthropic(), stream)
        assert r1.stop_reason == r2.stop_reason == "tool_use" and r3.stop_reason == "end_turn"
        assert [b.type for b in r1.content] == ["text", "tool_use"]
        assert r1.content[0].text == "Let me look around first."
        assert (r1.content[1].name, r1.content[1].input) == ("bash", {"command": "ls -la"})
        assert [b.type for b in r2.content] == ["tool_use"] and r2.content[0].input == {
            "command": "cat README.md"
        }
        assert [b.type for b in r3.content] == ["text"] and r3.content[
            0
        ].text == "The README says hello. Done."
        assert r1.usage.input_tokens > 0 and r1.usage.output_tokens == len(rig.script[0].token_ids)
        out = ep.session.run_output()
        assert out.artifacts["gateway"]["continued"] == 2 and out.segments == []
        check_exact(out, sent_prompts(rig.server))
        for turn, completion in zip(out.turns, rig.script, strict=True):
            assert turn.output_ids == completion.token_ids


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_responses_api_with_and_without_previous_response_id(
    tok: ChatTokenizer, stream: bool
) -> None:
    async with scripted_rig(tok, SCRIPT) as rig:
        ep = await rig.open()
        client = ep.openai()
        tools = [{"type": "function", **BASH_TOOL["function"]}]  # type: ignore[dict-item]

        async def create(**kwargs: Any) -> Any:
            if not stream:
                return await client.responses.create(model="policy", tools=tools, **kwargs)
            final = None
            async for event in await client.responses.create(
                model="policy", tools=tools, stream=True, **kwargs
            ):
                if event.type == "response.completed":
                    final = event.response
            return final

        r1 = await create(instructions="You are a careful engineer.", input="What does the README say?")
        kinds = [item.type for item in r1.output]
        assert kinds == ["message", "function_call"]
        call = r1.output[1]
        assert (call.name, json.loads(call.arguments)) == ("bash", {"command": "ls -la"})
        # stateful: only the new item, the rest comes from previous_response_id
        r2 = await create(
            previous_response_id=r1.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "README.md\n"}],
        )
        call2 = r2.output[0]
        assert call2.type == "function_call" and json.loads(call2.arguments) == {"command": "cat README.md"}
        # stateless: the whole history as input items, as the Agents SDK sends it
        history = [
            {"role": "user", "content": "What does the README say?"},
            *[item.model_dump(exclude_none=True) for item in r1.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "README.md\n"},
            *[item.model_dump(exclude_none=True) for item in r2.output],
            {"type": "function_call_output", "call_id": call2.call_id, "output": "hello\n"},
        ]
        r3 = await create(instructions="You are a careful engineer.", input=history)
        assert r3.output_text == "The README says hello. Done." and r3.status == "completed"
        out = ep.session.run_output()
        assert out.artifacts["gateway"]["continued"] == 2 and out.segments == []
        check_exact(out, sent_prompts(rig.server))


async def test_a_history_rewrite_starts_a_new_segment(tok: ChatTokenizer) -> None:
    script = [tool_call("bash", command="ls"), "Summary: there is one file.", "Answer: a.txt"]
    async with scripted_rig(tok, script) as rig:
        ep = await rig.open()
        client = ep.openai()
        system = {"role": "system", "content": "You are terse."}
        user = {"role": "user", "content": "Which files are there?"}
        r1 = await client.chat.completions.create(model="p", messages=[system, user], tools=[BASH_TOOL])
        m1 = r1.choices[0].message.model_dump(exclude_none=True)
        call = m1["tool_calls"][0]
        tool = {"role": "tool", "tool_call_id": call["id"], "content": "a.txt\n"}
        r2 = await client.chat.completions.create(
            model="p", messages=[system, user, m1, tool], tools=[BASH_TOOL]
        )
        summary = r2.choices[0].message.content
        # the agent compacts its history: the summary replaces the tool exchange
        rewritten = [system, {"role": "user", "content": f"Which files are there? (Notes: {summary})"}]
        r3 = await client.chat.completions.create(model="p", messages=rewritten, tools=[BASH_TOOL])
        assert r3.choices[0].message.content == "Answer: a.txt"
        out = ep.session.run_output()
        assert len(out.segments) == 2
        assert [t.segment for t in out.turns] == [0, 0, 1]
        reasons = [s["reason"] for s in out.artifacts["gateway"]["segments"]]
        assert reasons[0] == "first request" and "message 1 (user) differs from segment 0" in reasons[1]
        assert out.token_trajectory == out.segments[1]
        check_exact(out, sent_prompts(rig.server))
        # the new segment is a full render of the rewritten request, never spliced into the old one
        assert sent_prompts(rig.server)[2] == tok.apply_chat_template(
            [system, rewritten[1]], tools=[BASH_TOOL], add_generation_prompt=True
        )


async def test_a_retried_request_branches_and_a_rewritten_tool_id_merges(tok: ChatTokenizer) -> None:
    script = [tool_call("bash", command="ls"), tool_call("bash", command="pwd"), "one", "two"]
    async with scripted_rig(tok, script) as rig:
        ep = await rig.open()
        client = ep.openai()
        msgs: list[Any] = [{"role": "user", "content": "go"}]
        r1 = await client.chat.completions.create(model="p", messages=msgs, tools=[BASH_TOOL])
        # a retry of the very same request (the agent lost the answer): a branch, never spliced
        r1b = await client.chat.completions.create(model="p", messages=msgs, tools=[BASH_TOOL])
        m = r1.choices[0].message.model_dump(exclude_none=True)
        assert r1b.choices[0].message.tool_calls[0].function.arguments == '{"command": "pwd"}'
        # the agent renames the call id in its history: the tokens are the same, so the segment continues
        m["tool_calls"][0]["id"] = "renamed"
        msgs += [m, {"role": "tool", "tool_call_id": "renamed", "content": "x"}]
        await client.chat.completions.create(model="p", messages=msgs, tools=[BASH_TOOL])
        msgs[2] = {"role": "tool", "tool_call_id": "renamed-again", "content": "x"}
        msgs += [{"role": "assistant", "content": "one"}, {"role": "user", "content": "and?"}]
        await client.chat.completions.create(model="p", messages=msgs, tools=[BASH_TOOL])
        out = ep.session.run_output()
        gw = out.artifacts["gateway"]
        assert [t.segment for t in out.turns] == [0, 1, 0, 0]
        assert "repeats segment 0" in gw["segments"][1]["reason"]
        assert gw["continued"] == 1 and gw["merged"] == 1
        check_exact(out, sent_prompts(rig.server))
