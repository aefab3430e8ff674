"""The gateway in front of a real model: the embedded llama.cpp server (SmolLM2-135M), the OpenAI and
Anthropic SDKs as clients, streaming and not, with tools. Exactness is checked against the inference
server's own answers, captured by a transparent recording proxy between the balancer and llama-server."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tests.e2e.recording_proxy import RecordingProxy
from tests.gateway.conftest import ANTHROPIC_BASH, BASH_TOOL, Endpoint, assert_output_is_servers, check_exact

from raas.agent.config import AgentConfig
from raas.core.jobs import Job
from raas.core.trajectory import RunOutput
from raas.gateway import Gateway
from raas.llm.balancer import LLMBalancer
from raas.llm.embedded import EmbeddedServer
from raas.llm.tokenizer import ChatTokenizer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def model() -> AsyncIterator[RecordingProxy]:
    server = EmbeddedServer(
        parallel=2, ctx_per_slot=2048, threads=int(os.environ.get("RAAS_TEST_LLAMA_THREADS", "1"))
    )
    await server.start()
    try:
        async with RecordingProxy(server.url) as proxy:
            yield proxy
    finally:
        await server.stop()


@pytest.fixture
async def gateway(model: RecordingProxy, tok: ChatTokenizer) -> AsyncIterator[tuple[Gateway, Path]]:
    balancer = LLMBalancer(health_interval_s=0)
    balancer.add(model.url)
    gw = Gateway(balancer, tok)
    tmp = Path(tempfile.mkdtemp(prefix="raas-gw-"))
    try:
        yield gw, tmp
    finally:
        await gw.aclose()
        await balancer.aclose()
        shutil.rmtree(tmp, ignore_errors=True)


async def _open(gw: Gateway, tmp: Path, name: str) -> Endpoint:
    job = Job(job_id=name, instance={}, trajectory_id=name, sampling_params={"seed": 7, "temperature": 1.0})
    session = gw.open_session(
        job, agent=AgentConfig(max_turns=8, max_tokens_per_turn=24, context_budget=2048)
    )
    path = str(tmp / f"{name}.sock")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.listen(8)
    await gw.serve_socket(session, sock, path)
    return Endpoint(session, path)


def assert_exact_against_server(out: RunOutput, proxy: RecordingProxy) -> None:
    """Every turn's full prompt crossed the wire verbatim and its output is what llama-server returned."""
    check_exact(out)
    wire = {
        tuple(e.request["prompt"]): e.response
        for e in proxy.exchanges
        if e.path == "/completion" and e.status == 200
    }
    seq: list[int] = []
    for turn in out.turns:
        seq = seq + turn.prompt_ids if turn.prompt_is_delta else list(turn.prompt_ids)
        answer = wire.get(tuple(seq))
        assert answer is not None, f"turn {turn.index}: raas recorded a prompt the server never received"
        assert_output_is_servers(turn.output_ids, turn.logprobs, answer)
        seq += turn.output_ids


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_sdk_against_the_embedded_model(
    gateway: tuple[Gateway, Path], model: RecordingProxy, stream: bool
) -> None:
    ep = await _open(*gateway, f"openai-{stream}")
    client = ep.openai()
    messages: list[Any] = [
        {"role": "system", "content": "You are a helpful assistant with a bash tool."},
        {"role": "user", "content": "Say hello in one short sentence."},
    ]
    for follow_up in ("Now say goodbye.", "Thanks!", None):
        if stream:
            text, finish, calls = "", None, {}
            async for chunk in await client.chat.completions.create(
                model="smol",
                messages=messages,
                tools=[BASH_TOOL],
                max_tokens=24,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if not chunk.choices:
                    assert chunk.usage is not None and chunk.usage.completion_tokens > 0
                    continue
                delta = chunk.choices[0].delta
                text += delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
                for tc in delta.tool_calls or []:
                    entry = calls.setdefault(
                        tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                    )
                    entry["id"] = tc.id or entry["id"]
                    entry["function"]["name"] += (tc.function and tc.function.name) or ""
                    entry["function"]["arguments"] += (tc.function and tc.function.arguments) or ""
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = [calls[i] for i in sorted(calls)]
        else:
            r = await client.chat.completions.create(
                model="smol", messages=messages, tools=[BASH_TOOL], max_tokens=24
            )
            message = r.choices[0].message.model_dump(exclude_none=True)
            finish = r.choices[0].finish_reason
            assert r.usage.completion_tokens <= 24
        assert finish in ("stop", "length", "tool_calls")
        messages.append(message)
        if message.get("tool_calls"):
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "ok"})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    out = ep.session.run_output()
    assert len(out.turns) == 3
    assert_exact_against_server(out, model)
    # the agent re-sent every reply, so every later turn continued the first (no re-render of history)
    assert out.artifacts["gateway"]["continued"] == 2 and out.segments == []


async def test_anthropic_sdk_streaming_against_the_embedded_model(
    gateway: tuple[Gateway, Path], model: RecordingProxy
) -> None:
    ep = await _open(*gateway, "anthropic")
    client = ep.anthropic()
    messages: list[Any] = [{"role": "user", "content": "Name a colour."}]
    for follow_up in ("And another one?", None):
        async with client.messages.stream(
            model="smol", max_tokens=24, system="Answer briefly.", messages=messages, tools=[ANTHROPIC_BASH]
        ) as s:
            reply = await s.get_final_message()
        assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")
        assert reply.usage.output_tokens == len(ep.session.turns[-1].output_ids)
        messages.append(
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]}
        )
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    out = ep.session.run_output()
    assert len(out.turns) == 2 and out.artifacts["gateway"]["by_api"] == {"messages": 2}
    assert_exact_against_server(out, model)
