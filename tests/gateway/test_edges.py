"""The gateway at its edges: attribution (another rollout's key is refused), weight-sync pauses (requests
wait, they do not fail), clients that hang up, limits, malformed requests, unparsable tool calls, a dead
inference server, re-tokenization drift, and many rollouts at once."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from typing import Any

import anthropic
import httpx2
import openai
import pytest
import uvicorn
from tests.agent.scripted import EOS, completions, tool_call
from tests.doubles.scripted_llm import Completion, CompletionRequest, ScriptedLLM
from tests.gateway.conftest import (
    ANTHROPIC_BASH,
    BASH_TOOL,
    Endpoint,
    check_exact,
    scripted_rig,
    sent_prompts,
)

from raas.agent.config import AgentConfig
from raas.core.jobs import Job
from raas.gateway import Gateway
from raas.llm.balancer import LLMBalancer
from raas.llm.tokenizer import ChatTokenizer

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "hi"}]


async def _until(predicate: Any) -> None:
    """Wait for a condition of the gateway's state (polled: the state has no event to wait on)."""
    while not predicate():  # noqa: ASYNC110
        await asyncio.sleep(0.005)


async def test_another_rollouts_key_is_refused_on_every_path(tok: ChatTokenizer) -> None:
    async with scripted_rig(tok, ["a", "b"]) as rig:
        a, b = await rig.open("job-a"), await rig.open("job-b")
        for ep, key in ((a, b.session.key), (b, a.session.key), (a, "raas-not-a-key")):
            with pytest.raises(openai.AuthenticationError):
                await ep.openai(key=key, max_retries=0).chat.completions.create(model="p", messages=USER)
            with pytest.raises(anthropic.AuthenticationError):
                await ep.anthropic(key=key, max_retries=0).messages.create(
                    model="p", max_tokens=8, messages=USER
                )
        async with a.http() as http:  # no key at all
            r = await http.post("/v1/chat/completions", json={"model": "p", "messages": USER})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert rig.server.requests == [] and a.session.stats.requests == b.session.stats.requests == 0
        # each key works on its own rollout's socket, and only its rollout records the turn
        r = await a.openai().chat.completions.create(model="p", messages=USER)
        assert r.choices[0].message.content == "a"
        assert len(a.session.turns) == 1 and b.session.turns == []
        # a closed rollout's key stops working everywhere
        await rig.gateway.close_session(a.session)
        assert rig.gateway.session_for_key(a.session.key) is None


async def test_key_attribution_without_a_bound_socket(tok: ChatTokenizer) -> None:
    """The routes as the service mounts them: the key alone picks the rollout."""
    async with scripted_rig(tok, ["for a", "for b"]) as rig:
        a, b = await rig.open("job-a"), await rig.open("job-b")
        path = str(rig.dir / "shared.sock")
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        sock.listen(8)
        server = uvicorn.Server(
            uvicorn.Config(rig.gateway.app, lifespan="off", log_config=None, log_level="warning")
        )
        server.capture_signals = lambda: __import__("contextlib").nullcontext()  # type: ignore[method-assign]
        task = asyncio.create_task(server.serve(sockets=[sock]))
        await _until(lambda: server.started)
        try:
            transport = httpx2.AsyncHTTPTransport(uds=path)
            for ep, want in ((a, "for a"), (b, "for b")):
                client = openai.AsyncOpenAI(
                    base_url="http://gw/v1",
                    api_key=ep.session.key,
                    http_client=httpx2.AsyncClient(transport=transport),
                )
                r = await client.chat.completions.create(model="p", messages=USER)
                assert r.choices[0].message.content == want
            assert [len(a.session.turns), len(b.session.turns)] == [1, 1]
            bad = openai.AsyncOpenAI(
                base_url="http://gw/v1",
                api_key="nope",
                http_client=httpx2.AsyncClient(transport=transport),
                max_retries=0,
            )
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model="p", messages=USER)
        finally:
            server.should_exit = True
            await task
            sock.close()


@pytest.mark.parametrize("api", ["chat", "chat-stream", "messages-stream"])
async def test_requests_wait_through_a_weight_sync_pause(tok: ChatTokenizer, api: str) -> None:
    async with scripted_rig(tok, ["after the sync"]) as rig:
        rig.gateway.keepalive_s = 0.05  # streaming requests send keep-alive comments while they wait
        rig.balancer.add(rig.server.url, weight_version="w1")
        ep = await rig.open()
        await rig.balancer.pause()

        async def call() -> str:
            if api == "chat":
                r = await ep.openai().chat.completions.create(model="p", messages=USER)
                return str(r.choices[0].message.content)
            if api == "chat-stream":
                text = ""
                async for chunk in await ep.openai().chat.completions.create(
                    model="p", messages=USER, stream=True
                ):
                    text += (chunk.choices and chunk.choices[0].delta.content) or ""
                return text
            async with ep.anthropic().messages.stream(model="p", max_tokens=32, messages=USER) as s:
                message = await s.get_final_message()
            return str(message.content[0].text)

        task = asyncio.create_task(call())
        await _until(lambda: ep.session.in_flight == 1)
        await asyncio.sleep(0.3)  # long enough for several keep-alives; nothing may fail meanwhile
        assert not task.done() and rig.server.requests == []
        rig.balancer.set_weight_version("w2")
        rig.balancer.resume()
        assert await task == "after the sync"
        out = ep.session.run_output()
        assert [t.weight_version for t in out.turns] == ["w2"]
        assert ep.session.infra_error is None


async def test_a_client_that_hangs_up_cancels_its_request(tok: ChatTokenizer) -> None:
    async with scripted_rig(tok, ["only this one"]) as rig:
        ep = await rig.open()
        await rig.balancer.pause()
        async with ep.http(timeout=0.2) as http:
            with pytest.raises(httpx2.ReadTimeout):
                await http.post(
                    "/v1/chat/completions",
                    json={"model": "p", "messages": USER},
                    headers={"authorization": f"Bearer {ep.session.key}"},
                )
        await _until(lambda: ep.session.in_flight == 0)
        rig.balancer.resume()
        assert rig.server.requests == [] and ep.session.turns == [] and ep.session.segments == []
        r = await ep.openai().chat.completions.create(model="p", messages=USER)  # the next one is turn 0
        assert r.choices[0].message.content == "only this one"
        check_exact(ep.session.run_output(), sent_prompts(rig.server))


async def test_turn_and_context_limits_are_client_errors_not_failures(tok: ChatTokenizer) -> None:
    async with scripted_rig(tok, ["one", "two"]) as rig:
        ep = await rig.open(agent=AgentConfig(max_turns=2))
        client = ep.openai(max_retries=0)
        msgs: list[Any] = list(USER)
        for _ in range(2):
            r = await client.chat.completions.create(model="p", messages=msgs)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(model="p", messages=msgs)
        assert info.value.code == "turn_limit"
        out = ep.session.run_output()
        assert out.finish_reason == "max_turns" and len(out.turns) == 2 and ep.session.infra_error is None

        small = await rig.open("job-small", agent=AgentConfig(context_budget=64))
        with pytest.raises(openai.BadRequestError) as info:
            await small.openai(max_retries=0).chat.completions.create(
                model="p", messages=[{"role": "user", "content": "word " * 80}]
            )
        assert info.value.code == "context_length_exceeded"
        assert small.session.run_output().finish_reason == "context_budget"
        assert small.session.infra_error is None and small.session.segments == []


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/chat/completions", b"{not json", 400, "not JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/chat/completions", {"messages": []}, 400, "must not be empty"),
        ("/v1/chat/completions", {"messages": USER, "n": 2}, 400, "n > 1"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "only text",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
        (
            "/v1/chat/completions",
            {"messages": [*USER, {"role": "assistant", "content": "pre"}]},
            400,
            "prefilled",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{"type": "web_search"}]},
            400,
            "function tools",
        ),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": -1}, 400, "positive integer"),
        ("/v1/messages", {"messages": USER}, 400, "max_tokens is required"),
        (
            "/v1/messages",
            {"messages": USER, "max_tokens": 5, "tools": [{"type": "bash_20250124", "name": "bash"}]},
            400,
            "custom",
        ),
        ("/v1/responses", {"input": [{"type": "web_search_call"}]}, 400, "only messages"),
        ("/v1/responses", {"input": "x", "previous_response_id": "resp_unknown"}, 404, "no response"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "larger than"),
    ],
)
async def test_malformed_requests_get_the_apis_errors_and_record_nothing(
    tok: ChatTokenizer, path: str, body: Any, status: int, needle: str
) -> None:
    async with scripted_rig(tok, ["unused"]) as rig:
        rig.gateway.max_body_bytes = 4096
        ep = await rig.open()
        async with ep.http() as http:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await http.post(path, content=content, headers={"x-api-key": ep.session.key})
        assert r.status_code == status, r.text
        data = r.json()
        if path == "/v1/messages":
            assert data["type"] == "error" and needle in data["error"]["message"]
        else:
            assert needle in data["error"]["message"]
        assert rig.server.requests == [] and ep.session.turns == [] and ep.session.infra_error is None


async def test_an_unparsable_tool_call_is_plain_content_and_counted(tok: ChatTokenizer) -> None:
    broken = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>'
    good = tool_call("bash", command="ls")
    async with scripted_rig(tok, [broken, broken, good]) as rig:
        ep = await rig.open()
        client = ep.openai()
        r = await client.chat.completions.create(model="p", messages=USER, tools=[BASH_TOOL])
        assert r.choices[0].message.content == broken and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"
        m = await ep.anthropic().messages.create(
            model="p", max_tokens=64, messages=USER, tools=[ANTHROPIC_BASH]
        )
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == broken
        # tool_choice "none": a well-formed call stays text too (and is not a failure)
        r = await client.chat.completions.create(
            model="p", messages=USER, tools=[BASH_TOOL], tool_choice="none"
        )
        assert r.choices[0].message.content == good and r.choices[0].message.tool_calls is None
        out = ep.session.run_output()
        assert out.metrics["tool_call_parse_failures"] == 2.0


async def test_a_dead_inference_server_is_an_infrastructure_error(tok: ChatTokenizer) -> None:
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    balancer = LLMBalancer(health_interval_s=0, retries=0)
    balancer.add(f"http://127.0.0.1:{port}", kind="vllm")
    gateway = Gateway(balancer, tok)
    try:
        session = gateway.open_session(Job(job_id="j", instance={}, trajectory_id="t"))
        path = f"/tmp/raas-gw-dead-{port}.sock"
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        sock.listen(4)
        await gateway.serve_socket(session, sock, path)
        client = openai.AsyncOpenAI(
            base_url="http://gw/v1",
            api_key=session.key,
            max_retries=0,
            http_client=httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=path)),
        )
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="p", messages=USER)
        assert info.value.status_code == 503
        assert session.infra_error is not None and session.infra_error.kind == "llm_unavailable"
        assert session.turns == [] and session.segments == []
    finally:
        await gateway.aclose()
        await balancer.aclose()


async def test_the_drift_report_names_replies_that_retokenize_differently(tok: ChatTokenizer) -> None:
    # "hello world" sampled as single characters: decodes to the same text, re-tokenizes to far fewer IDs
    odd = [i for ch in "hello world" for i in tok.encode(ch)] + [EOS]
    script = [Completion(token_ids=odd, logprobs=[-0.5] * len(odd)), *completions(tok, ["fine"])]
    async with scripted_rig(tok, script=script) as rig:
        ep = await rig.open()
        client = ep.openai()
        r = await client.chat.completions.create(model="p", messages=USER)
        assert r.choices[0].message.content == "hello world"
        msgs = [
            *USER,
            r.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "and?"},
        ]
        await client.chat.completions.create(model="p", messages=msgs)
        out = ep.session.run_output()
        check_exact(out, sent_prompts(rig.server))
        # the record keeps the sampled character tokens; the report says a re-render would not
        assert (
            out.turns[0].output_ids == odd
            and sent_prompts(rig.server)[1][len(sent_prompts(rig.server)[0]) :][: len(odd)] == odd
        )
        (drift,) = out.artifacts["gateway"]["drift"]["retokenize_differently"]
        assert drift["turn"] == 0 and drift["sampled_tokens"] == len(odd) + 1
        assert drift["retokenized_tokens"] < drift["sampled_tokens"] and drift["first_difference"] == 0
        assert out.metrics["drift_turns"] == 1.0


async def test_many_rollouts_at_once_are_each_attributed_exactly(tok: ChatTokenizer) -> None:
    def respond(req: CompletionRequest) -> Completion:
        text = f"reply {req.index}"
        ids = [*tok.encode(text), EOS]
        return Completion(token_ids=ids, logprobs=[-0.01 * (req.index + 1)] * len(ids))

    async with ScriptedLLM(respond) as server:
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(server.url)
        gateway = Gateway(balancer, tok)
        from tests.gateway.conftest import Rig

        rig = Rig(balancer, gateway, server)
        try:
            endpoints = [await rig.open(f"job-{i}") for i in range(12)]

            async def rollout(i: int) -> None:
                client = endpoints[i].openai()
                msgs: list[Any] = [{"role": "user", "content": f"rollout {i}"}]
                for turn in range(3):
                    r = await client.chat.completions.create(model="p", messages=msgs, stream=turn == 1)
                    if turn == 1:
                        text = ""
                        async for chunk in r:
                            text += (chunk.choices and chunk.choices[0].delta.content) or ""
                    else:
                        text = r.choices[0].message.content
                    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "next"}]

            await asyncio.gather(*(rollout(i) for i in range(12)))
            sent = {tuple(r.prompt_ids) for r in server.requests}
            assert len(server.requests) == 36
            seen: set[tuple[int, ...]] = set()
            for i, ep in enumerate(endpoints):
                out = ep.session.run_output()
                assert (
                    len(out.turns) == 3 and out.segments == [] and out.artifacts["gateway"]["continued"] == 2
                )
                check_exact(out)
                first = tok.decode(out.token_trajectory.prompt_ids)
                assert f"rollout {i}" in first
                prefix: list[int] = []
                for turn in out.turns:
                    prefix = prefix + turn.prompt_ids if turn.prompt_is_delta else list(turn.prompt_ids)
                    assert tuple(prefix) in sent  # exactly what this rollout sent
                    seen.add(tuple(prefix))
                    prefix += turn.output_ids
            assert seen == sent
        finally:
            await gateway.aclose()
            await balancer.aclose()
            shutil.rmtree(rig.dir, ignore_errors=True)


async def test_a_sandbox_cannot_hoard_connections_to_its_gateway(tok: ChatTokenizer) -> None:
    """Code in a sandbox can open sockets to its gateway endpoint directly; beyond the cap they are closed
    at once, so the service's file descriptors stay bounded, and the endpoint keeps serving."""
    async with scripted_rig(tok, ["still here"]) as rig:
        rig.gateway.max_connections = 4
        ep = await rig.open()
        idle = [await asyncio.open_unix_connection(ep.path) for _ in range(4)]
        await _until(
            lambda: len(rig.gateway._endpoints[ep.session.id][0].server.server_state.connections) == 4
        )
        reader, writer = await asyncio.open_unix_connection(ep.path)
        assert await reader.read() == b""  # closed by the endpoint without a byte
        writer.close()
        for _, w in idle:
            w.close()
        r = await ep.openai().chat.completions.create(model="p", messages=USER)
        assert r.choices[0].message.content == "still here"


async def test_rollouts_are_routed_by_job_and_group_not_by_sample_index(tok: ChatTokenizer) -> None:
    """Samples of different groups share ``trajectory_id`` (the sample index): the gateway must route by the
    job (unique per rollout) and its group, or two groups' rollouts would share one pin."""
    async with scripted_rig(tok, ["a", "b"]) as rig:
        jobs = [Job(job_id=f"g{g}.0.0", instance={"group_id": f"g{g}"}, trajectory_id="0") for g in range(2)]
        sessions = [rig.gateway.open_session(job, agent=AgentConfig(max_turns=5)) for job in jobs]
        assert [s.trajectory_id for s in sessions] == ["g0.0.0", "g1.0.0"]
        assert [s.group_id for s in sessions] == ["g0", "g1"]
        for i, session in enumerate(sessions):
            path = str(rig.dir / f"{i}.sock")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            sock.listen(8)
            await rig.gateway.serve_socket(session, sock, path)
            client = Endpoint(session, path).openai()
            await client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
        assert rig.balancer.pinned_server("g0.0.0") is not None
        assert rig.balancer.pinned_server("g1.0.0") is not None
        assert rig.balancer.pinned_server("0") is None
        assert rig.balancer.group_home("g0") is not None and rig.balancer.group_home("g1") is not None
