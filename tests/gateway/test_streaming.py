"""Incremental streaming: a streamed request's reply reaches the agent while the inference server is still
generating it, and the record stays token-exact.

The ordering tests use doubles of llama-server's, vLLM's and SGLang's streams (tests/doubles/
stream_servers.py) that send each token only when the test releases it: the client must hold chunk i
while the server has sent i tokens and not its final event. One test checks the part a double cannot:
that on the real llama-server a streamed generation records exactly the IDs and logprobs of a plain one
(same seed), including the IDs llama.cpp leaves out of its stream; the same check against a real vLLM is
in tests/llm/test_vllm_real.py (``make test-vllm``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from tests.doubles.stream_servers import (
    HeldStreamDouble,
    LlamaStreamDouble,
    SGLangStreamDouble,
    VLLMStreamDouble,
    gpt2_byte_decoder,
)
from tests.gateway.conftest import ANTHROPIC_BASH, BASH_TOOL, Rig, check_exact

from raas.agent.config import AgentConfig
from raas.gateway import Gateway
from raas.llm.balancer import LLMBalancer
from raas.llm.embedded import EmbeddedServer
from raas.llm.servers.llamacpp import OVERSHOOT, LlamaCppClient
from raas.llm.stream_gaps import fill_gaps, vocab_bytes
from raas.llm.tokenizer import ChatTokenizer
from raas.llm.types import SamplingParams

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "Greet me."}]


def token_bytes(tok: ChatTokenizer) -> dict[int, bytes]:
    """Each token's bytes, as llama.cpp renders it (special tokens: none)."""
    decoder = gpt2_byte_decoder()
    vocab = tok.tokenizer.get_vocab(with_added_tokens=False)
    out = {tid: bytes(decoder[c] for c in piece) for piece, tid in vocab.items()}
    for tid in tok.eos_token_ids:
        out[tid] = b""
    return out


def pieces(tok: ChatTokenizer, ids: list[int]) -> list[str]:
    """The text of each event the double sends for ``ids`` (a character's bytes go out together)."""
    tb, out, pending = token_bytes(tok), [], b""
    for tid in ids:
        pending += tb[tid]
        try:
            out.append(pending.decode())
        except UnicodeDecodeError:
            continue
        pending = b""
    return [p for p in out if p]


DOUBLES: dict[str, Any] = {
    "llamacpp": LlamaStreamDouble,
    "vllm": VLLMStreamDouble,
    "sglang": SGLangStreamDouble,
    "sglang-incremental": lambda *a: SGLangStreamDouble(*a, incremental=True),
}
every_server = pytest.mark.parametrize("server", list(DOUBLES))
id_servers = pytest.mark.parametrize("server", ["vllm", "sglang", "sglang-incremental"])
"""Servers whose streams carry every token's ID (llama.cpp's leaves some out: its own test below)."""


@pytest.fixture
def server() -> str:
    return "llamacpp"


@pytest.fixture
async def rig_for(tok: ChatTokenizer, server: str) -> AsyncIterator[Any]:
    """``await rig_for(replies)``: a gateway in front of a streaming double of ``server``."""
    opened: list[tuple[HeldStreamDouble, Rig]] = []

    async def make(replies: list[list[int]]) -> tuple[Rig, HeldStreamDouble]:
        double = await DOUBLES[server](token_bytes(tok), replies).__aenter__()
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(double.url)
        rig = Rig(balancer, Gateway(balancer, tok, keepalive_s=60))
        opened.append((double, rig))
        return rig, double

    try:
        yield make
    finally:
        for double, rig in opened:
            await rig.gateway.aclose()
            await rig.balancer.aclose()
            await double.__aexit__(None, None, None)
            shutil.rmtree(rig.dir, ignore_errors=True)


@every_server
async def test_chat_chunks_reach_the_client_while_the_server_generates(
    tok: ChatTokenizer, rig_for: Any, server: str
) -> None:
    ids = [*tok.encode("Hello there, my good friend!"), tok.eos_token_ids[0]]
    rig, double = await rig_for([ids])
    ep = await rig.open("stream-chat")
    client = ep.openai()
    opening = asyncio.create_task(
        client.chat.completions.create(model="m", messages=USER, stream=True, max_tokens=64)
    )
    double.release(1)
    stream = await opening
    chunks = stream.__aiter__()
    head = await anext(chunks)
    assert head.choices[0].delta.role == "assistant"
    texts = pieces(tok, ids)
    assert len(texts) >= 5
    for i, text in enumerate(texts):
        if i:
            double.release(1)
        chunk = await anext(chunks)
        assert chunk.choices[0].delta.content == text
        # the client holds chunk i while the server has sent i tokens and not its final event
        assert double.sent == i + 1 and double.finished == 0
    double.release_all()
    rest = [c async for c in chunks]
    assert [c.choices[0].finish_reason for c in rest] == ["stop"]
    assert double.finished == 1
    out = ep.session.run_output()
    assert out.turns[0].output_ids == ids
    assert out.turns[0].logprobs == [double.logprob(i) for i in range(len(ids))]
    assert double.requests[0]["stream"] is True
    # no seed is added where the stream carries every ID (llama.cpp's may need a replay with one)
    seeds = {
        "llamacpp": "seed",
        "vllm": "seed",
        "sglang": "sampling_seed",
        "sglang-incremental": "sampling_seed",
    }
    sent = double.requests[0].get("sampling_params") or double.requests[0]
    assert (seeds[server] in sent) == (server == "llamacpp")
    check_exact(out)


async def test_messages_events_reach_the_client_while_the_server_generates(
    tok: ChatTokenizer, rig_for: Any
) -> None:
    ids = [*tok.encode("A colour: blue, and another: green."), tok.eos_token_ids[0]]
    rig, double = await rig_for([ids])
    ep = await rig.open("stream-messages")
    client = ep.anthropic()
    opening = asyncio.create_task(
        client.messages.create(model="m", max_tokens=64, messages=USER, stream=True)
    )
    double.release(1)
    stream = await opening
    events = stream.__aiter__()
    assert (await anext(events)).type == "message_start"
    assert (await anext(events)).type == "content_block_start"
    texts = pieces(tok, ids)
    for i, text in enumerate(texts):
        if i:
            double.release(1)
        event = await anext(events)
        assert event.type == "content_block_delta" and event.delta.text == text  # type: ignore[union-attr]
        assert double.sent == i + 1 and double.finished == 0
    double.release_all()
    rest = [e.type async for e in events]
    assert rest == ["content_block_stop", "message_delta", "message_stop"]
    out = ep.session.run_output()
    assert out.turns[0].output_ids == ids
    check_exact(out)


async def test_multibyte_characters_and_a_cut_one_stream_exactly(tok: ChatTokenizer, rig_for: Any) -> None:
    text = "Café — 你好 🎉 ok"
    ids = [*tok.encode(text), tok.eos_token_ids[0]]
    tb = token_bytes(tok)
    partial = [i for i, t in enumerate(ids) if tb[t] and not _decodes(tb[t])]
    assert len(partial) >= 3  # the double leaves these out of its stream, as llama.cpp does
    at = text.encode().index("🎉".encode())
    emoji = next(i for i in range(len(ids)) if len(b"".join(tb[t] for t in ids[: i + 1])) > at)
    assert not _decodes(b"".join(tb[t] for t in ids[: emoji + 1]))  # the limit below cuts the emoji
    rig, double = await rig_for([ids, ids])
    double.release_all()
    ep = await rig.open("multibyte", agent=AgentConfig(max_turns=5, context_budget=8192))
    client = ep.openai()
    got = ""
    async for chunk in await client.chat.completions.create(model="m", messages=USER, stream=True):
        got += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    assert got == text
    first = ep.session.turns[0]
    assert first.output_ids == ids
    logprobs = [None if i in _left_out(ids, tb) else double.logprob(i) for i in range(len(ids))]
    assert first.logprobs == logprobs

    # a limit inside the emoji: the stream runs a few tokens past it, and the reply keeps exactly the limit
    limit = emoji + 1
    ep2 = await rig.open("cut", agent=AgentConfig(max_turns=5, context_budget=8192))
    r = await ep2.openai().chat.completions.create(model="m", messages=USER, stream=True, max_tokens=limit)
    finish = [c.choices[0].finish_reason async for c in r if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert double.requests[1]["n_predict"] == limit + OVERSHOOT
    assert ep2.session.turns[0].output_ids == ids[:limit]
    check_exact(ep2.session.run_output())


@id_servers
async def test_multibyte_characters_and_a_cut_one_stream_exactly_where_every_id_is_sent(
    tok: ChatTokenizer, rig_for: Any
) -> None:
    """vLLM and SGLang send every token's ID and logprob, text or not: nothing to recover, no overshoot."""
    text = "Café — 你好 🎉 ok"
    ids = [*tok.encode(text), tok.eos_token_ids[0]]
    tb = token_bytes(tok)
    at = text.encode().index("🎉".encode())
    emoji = next(i for i in range(len(ids)) if len(b"".join(tb[t] for t in ids[: i + 1])) > at)
    assert not _decodes(b"".join(tb[t] for t in ids[: emoji + 1]))
    rig, double = await rig_for([ids, ids])
    double.release_all()
    ep = await rig.open("multibyte", agent=AgentConfig(max_turns=5, context_budget=8192))
    got = ""
    async for chunk in await ep.openai().chat.completions.create(model="m", messages=USER, stream=True):
        got += (chunk.choices[0].delta.content or "") if chunk.choices else ""
    assert got == text
    assert ep.session.turns[0].output_ids == ids
    assert ep.session.turns[0].logprobs == [double.logprob(i) for i in range(len(ids))]

    limit = emoji + 1  # inside the emoji
    ep2 = await rig.open("cut", agent=AgentConfig(max_turns=5, context_budget=8192))
    r = await ep2.openai().chat.completions.create(model="m", messages=USER, stream=True, max_tokens=limit)
    finish = [c.choices[0].finish_reason async for c in r if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert len(double.requests) == 2  # no replay
    assert ep2.session.turns[0].output_ids == ids[:limit]
    check_exact(ep2.session.run_output())


async def test_ids_only_a_replay_can_recover_come_from_a_replay_with_the_streams_seed(
    tok: ChatTokenizer, rig_for: Any
) -> None:
    """llama.cpp leaves out both tokens of a " \xe7\xa7" that the vocabulary spells more than one way: the
    gateway generates the reply again, not streamed, with the seed it gave the stream."""
    index, _ = vocab_bytes(tok.tokenizer)
    last = index[b"\x98"][0]  # 秘 = e7 a7 98
    spelled = [[a, b] for a in index.get(b" \xe7", []) for b in index.get(b"\xa7", [])]
    others = [[a, b] for a in index.get(b" ", []) for b in index.get(b"\xe7\xa7", [])]
    assert spelled and others  # more than one spelling: only a replay can tell which was sampled
    ids = [*tok.encode("Hi"), *spelled[0], last, tok.eos_token_ids[0]]
    rig, double = await rig_for([ids, ids])
    double.release_all()
    ep = await rig.open("replay")
    r = await ep.openai().chat.completions.create(model="m", messages=USER, stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in r if c.choices])
    assert text == "Hi 秘"
    stream, again = double.requests
    assert stream["stream"] is True and again["stream"] is False
    assert isinstance(stream["seed"], int) and again["seed"] == stream["seed"]
    assert ep.session.turns[0].output_ids == ids
    check_exact(ep.session.run_output())


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def _left_out(ids: list[int], tb: dict[int, bytes]) -> set[int]:
    out, pending, start = set(), b"", 0
    for i, tid in enumerate(ids):
        if not pending:
            start = i
        pending += tb[tid]
        if _decodes(pending):
            out.update(range(start, i))
            pending = b""
    return out


async def test_a_stream_records_what_a_plain_generation_records_on_llama_server(tok: ChatTokenizer) -> None:
    """Same seed, same prompt: the streamed generation's IDs and logprobs equal the plain one's, also where
    llama.cpp left IDs out of the stream (multi-byte characters) and where the limit cut a character."""
    server = EmbeddedServer(
        parallel=1, ctx_per_slot=1024, threads=int(os.environ.get("RAAS_TEST_LLAMA_THREADS", "1"))
    )
    await server.start()
    filled = replayed = 0
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            client = LlamaCppClient(server.url, http)
            for prompt in (
                "Write emoji and Chinese: 你好世界 🎉🎉",
                "日本語で挨拶してください。",
                "List 3 emoji: 😀 🚀 🌍",
            ):
                ids = tok.conversation([{"role": "user", "content": prompt}]).ids
                for seed in (1, 3):
                    sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, seed=seed, max_tokens=48)
                    plain = await client.generate(ids, sampling)
                    texts: list[str] = []
                    streamed = await client.generate(ids, sampling, texts.append)

                    async def replay(
                        n: int, sampling: SamplingParams = sampling, ids: list[int] = ids
                    ) -> list[int]:
                        again = await client.generate(ids, sampling.model_copy(update={"max_tokens": n}))
                        return again.output_ids

                    await fill_gaps(tok.tokenizer, streamed, replay)
                    replayed += int("stream_replayed_tokens" in streamed.extra)
                    assert streamed.output_ids == plain.output_ids, (prompt, seed)
                    assert streamed.logprobs == plain.logprobs
                    assert streamed.finish_reason == plain.finish_reason
                    assert len(texts) > 1
                    filled += int(streamed.extra.get("stream_gaps_filled", 0))
    finally:
        await server.stop()
    # The case that needs recovering did occur. Whether one of these prompts also hits a gap only a replay
    # recovers depends on the llama.cpp build's sampling (it did on one build, not on another); the replay
    # path itself is covered against the real vocabulary in tests/llm/test_stream_gaps.py.
    assert filled + replayed > 0


@every_server
async def test_with_tools_text_streams_until_a_call_begins_and_the_call_follows(
    tok: ChatTokenizer, rig_for: Any
) -> None:
    """Tool calls are read from the finished text (as without streaming): the text before the call goes
    out as it is generated, the call as tool_call deltas at the end, and the agent that re-sends what it
    received continues the same token sequence."""
    call = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    ids = [*tok.encode("Let me look around. " + call), tok.eos_token_ids[0]]
    rig, double = await rig_for([ids, [*tok.encode("Done."), tok.eos_token_ids[0]]])
    ep = await rig.open("stream-tools")
    client = ep.openai()
    opening = asyncio.create_task(
        client.chat.completions.create(model="m", messages=USER, tools=[BASH_TOOL], stream=True)
    )
    double.release(1)
    chunks = (await opening).__aiter__()
    assert (await anext(chunks)).choices[0].delta.role == "assistant"
    text = ""
    while not text.endswith("around."):
        double.release(1)
        text += (await anext(chunks)).choices[0].delta.content or ""
    assert double.finished == 0  # the text reached the client before the reply was done
    double.release_all()
    calls: dict[str, Any] = {"id": "", "name": "", "arguments": ""}
    finish = None
    async for chunk in chunks:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            calls["id"] = tc.id or calls["id"]
            calls["name"] += (tc.function and tc.function.name) or ""
            calls["arguments"] += (tc.function and tc.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    assert text == "Let me look around." and "<" not in text
    assert calls["name"] == "bash" and json.loads(calls["arguments"]) == {"command": "ls"}
    assert finish == "tool_calls"
    reply = {
        "role": "assistant",
        "content": text,
        "tool_calls": [
            {
                "id": calls["id"],
                "type": "function",
                "function": {"name": "bash", "arguments": calls["arguments"]},
            }
        ],
    }
    messages = [*USER, reply, {"role": "tool", "tool_call_id": calls["id"], "content": "a.txt"}]
    r = await client.chat.completions.create(model="m", messages=messages, tools=[BASH_TOOL], stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in r if c.choices]) == "Done."
    out = ep.session.run_output()
    assert (
        out.turns[0].output_ids == ids and out.artifacts["gateway"]["continued"] == 1 and out.segments == []
    )
    check_exact(out)


async def test_messages_stream_with_tools_ends_with_the_tool_use_block(
    tok: ChatTokenizer, rig_for: Any
) -> None:
    call = '<tool_call>{"name": "bash", "arguments": {"command": "pwd"}}</tool_call>'
    ids = [*tok.encode("Checking. " + call), tok.eos_token_ids[0]]
    rig, double = await rig_for([ids])
    double.release_all()
    ep = await rig.open("stream-tool-use")
    async with ep.anthropic().messages.stream(
        model="m", max_tokens=64, messages=USER, tools=[ANTHROPIC_BASH]
    ) as s:
        kinds = [e.type async for e in s]
        reply = await s.get_final_message()
    assert reply.stop_reason == "tool_use"
    assert [b.type for b in reply.content] == ["text", "tool_use"]
    assert reply.content[0].text == "Checking."  # type: ignore[union-attr]
    assert reply.content[1].input == {"command": "pwd"}  # type: ignore[union-attr]
    assert kinds.index("text") < kinds.index("content_block_stop")  # text came before the block closed
    assert ep.session.turns[0].output_ids == ids


async def test_responses_text_deltas_reach_the_client_while_the_server_generates(
    tok: ChatTokenizer, rig_for: Any
) -> None:
    ids = [*tok.encode("Sure, here is the answer you asked for."), tok.eos_token_ids[0]]
    rig, double = await rig_for([ids])
    ep = await rig.open("stream-responses")
    client = ep.openai()
    opening = asyncio.create_task(client.responses.create(model="m", input="Answer me.", stream=True))
    double.release(1)
    events = (await opening).__aiter__()
    assert [(await anext(events)).type for _ in range(4)] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    texts = pieces(tok, ids)
    for i, text in enumerate(texts):
        if i:
            double.release(1)
        event = await anext(events)
        assert event.type == "response.output_text.delta" and event.delta == text  # type: ignore[union-attr]
        assert double.sent == i + 1 and double.finished == 0
    double.release_all()
    rest = [e async for e in events]
    assert [e.type for e in rest][-1] == "response.completed"
    done = rest[-1].response  # type: ignore[union-attr]
    assert done.output_text == "".join(texts)
    assert ep.session.turns[0].output_ids == ids
    # the streamed response is remembered: previous_response_id continues the conversation
    assert ep.session.history_of(done.id)[-1]["content"] == "".join(texts)
