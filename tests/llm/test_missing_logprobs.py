"""A logprob the server did not report is ``None`` for every server kind, never an invented 0.0.

The vLLM cases replay the real responses captured in ``fixtures/`` (see ``test_vllm_real.py``) with one
logprob taken out, through the whole client (HTTP, parsing, the length check).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from raas.llm import LLMError, SamplingParams
from raas.llm.servers import LlamaCppClient, SGLangClient, VLLMClient
from raas.llm.servers.llamacpp import align_logprobs

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures"
MISSING = 3  # the position whose logprob the server leaves out


def _fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


async def _replay_vllm(body: dict[str, Any], endpoint: str) -> Any:
    meta = _fixture("vllm_capture.json")

    def replay(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=meta["models"])
        return httpx.Response(200, json=body)

    async with httpx.AsyncClient(transport=httpx.MockTransport(replay)) as http:
        client = VLLMClient("http://replay", http, endpoint=endpoint)
        return await client.generate(meta["completions_request"]["prompt"], SamplingParams(max_tokens=24))


async def test_vllm_completions_null_logprob_stays_none() -> None:
    real = _fixture("vllm_completions_response.json")
    body = copy.deepcopy(real)
    body["choices"][0]["logprobs"]["token_logprobs"][MISSING] = None
    res = await _replay_vllm(body, "completions")
    expected: list[float | None] = list(real["choices"][0]["logprobs"]["token_logprobs"])
    expected[MISSING] = None
    assert res.output_ids == real["choices"][0]["token_ids"]
    assert res.logprobs == expected
    assert res.logprobs[MISSING] is None


@pytest.mark.parametrize("how", ["null", "absent"])
async def test_vllm_tokens_only_missing_logprob_is_none(how: str) -> None:
    real = _fixture("vllm_generate_response.json")
    body = copy.deepcopy(real)
    entry = body["choices"][0]["logprobs"]["content"][MISSING]
    if how == "null":
        entry["logprob"] = None
    else:
        del entry["logprob"]
    res = await _replay_vllm(body, "generate")
    expected: list[float | None] = [e["logprob"] for e in real["choices"][0]["logprobs"]["content"]]
    expected[MISSING] = None
    assert res.logprobs == expected


async def test_vllm_garbage_logprob_is_an_llm_error() -> None:
    body = copy.deepcopy(_fixture("vllm_completions_response.json"))
    body["choices"][0]["logprobs"]["token_logprobs"][MISSING] = "-0.5"
    with pytest.raises(LLMError, match=r"token_logprobs\[3\]"):
        await _replay_vllm(body, "completions")


def test_sglang_null_logprob_stays_none() -> None:
    body = {
        "text": "",
        "output_ids": [8, 9, 10],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": None},
            "prompt_tokens": 3,
            "output_token_logprobs": [[-0.25, 8, None], [None, 9, None], [-0.75, 10, None]],
        },
    }
    res = SGLangClient("http://unused", httpx.AsyncClient()).parse_response(body)
    assert res.output_ids == [8, 9, 10] and res.logprobs == [-0.25, None, -0.75]


def test_llamacpp_null_logprob_stays_none() -> None:
    assert align_logprobs(
        [5, 6, 7], [{"id": 5, "logprob": -1.0}, {"id": 6, "logprob": None}, {"id": 7, "logprob": -3.0}]
    ) == [
        -1.0,
        None,
        -3.0,
    ]
    body = {
        "tokens": [5, 6],
        "completion_probabilities": [{"id": 5, "logprob": -1.0}, {"id": 6, "logprob": None}],
        "stop_type": "eos",
    }
    res = LlamaCppClient("http://unused", httpx.AsyncClient()).parse_response(body)
    assert res.logprobs == [-1.0, None]
