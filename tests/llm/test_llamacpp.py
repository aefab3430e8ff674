"""The llama.cpp client against a real llama-server running SmolLM2: token-exact multi-turn trajectories."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import httpx
import pytest

from raas.errors import RaasError
from raas.llm import ChatTokenizer, ContextWindowExceeded, SamplingParams
from raas.llm.servers import LlamaCppClient, detect_kind
from raas.llm.template_check import SAMPLE_TOOLS

pytestmark = pytest.mark.integration


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


async def test_detects_llamacpp_and_reads_slot_context(llama_url: str, http: httpx.AsyncClient) -> None:
    assert await detect_kind(llama_url, http) == "llamacpp"
    client = LlamaCppClient(llama_url, http)
    info = await client.ensure_info()
    assert info.context_length == 1024  # -c 4096 over 4 slots
    assert await client.health()


async def test_our_tokenizer_matches_the_server(
    llama_url: str, http: httpx.AsyncClient, smol: ChatTokenizer
) -> None:
    conv = smol.conversation(
        [{"role": "system", "content": "Tools below."}, {"role": "user", "content": "ls 123 ü"}],
        tools=SAMPLE_TOOLS,
    )
    r = await http.post(
        f"{llama_url}/tokenize", json={"content": smol.decode(conv.prompt_ids), "parse_special": True}
    )
    assert r.json()["tokens"] == conv.prompt_ids


async def test_multi_turn_tool_trajectory_is_token_exact(
    llama_url: str, http: httpx.AsyncClient, smol: ChatTokenizer
) -> None:
    client = LlamaCppClient(llama_url, http)
    conv = smol.conversation(
        [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": "Count the files in /tmp."},
        ],
        tools=SAMPLE_TOOLS,
    )
    sampling = SamplingParams(max_tokens=16, seed=7)
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    for turn in range(3):
        prompt = list(conv.prompt_ids)
        prompts.append(prompt)
        res = await client.generate(prompt, sampling)
        assert res.output_ids, "the server sampled nothing"
        assert len(res.logprobs) == len(res.output_ids)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in res.logprobs)
        assert res.finish_reason in ("stop", "length")
        outputs.append(list(res.output_ids))
        conv.add_assistant(res.output_ids, res.logprobs)
        # the IDs the server sampled are exactly the IDs recorded, with their logprobs, mask 1
        start = len(prompt)
        assert conv.ids[start : start + len(res.output_ids)] == res.output_ids
        assert conv.logprobs[start : start + len(res.output_ids)] == res.logprobs
        assert conv.mask[start : start + len(res.output_ids)] == [1] * len(res.output_ids)
        conv.add_messages([{"role": "tool", "content": f"result {turn}: 3 files"}])
    for t in range(2):
        assert prompts[t + 1][: len(prompts[t]) + len(outputs[t])] == prompts[t] + outputs[t]
    # every sampled ID is masked in, nothing else is
    assert sum(conv.mask) == sum(len(o) for o in outputs)


async def test_eos_is_returned_and_the_template_adds_only_the_rest(
    llama_url: str, http: httpx.AsyncClient, smol: ChatTokenizer
) -> None:
    """llama.cpp returns the EOS it stopped on; the conversation then appends just the newline."""
    client = LlamaCppClient(llama_url, http)
    conv = smol.conversation([{"role": "user", "content": "Reply with just the word yes."}])
    for seed in range(12):
        res = await client.generate(
            conv.prompt_ids, SamplingParams(max_tokens=24, seed=seed, temperature=0.3)
        )
        if res.finish_reason == "stop":
            break
    assert res.finish_reason == "stop" and res.extra["stop_type"] == "eos"
    assert res.output_ids[-1] == 2
    before = len(conv.ids)
    conv.add_assistant(res.output_ids, res.logprobs)
    assert smol.decode(conv.ids[before + len(res.output_ids) :]) == "\n"


async def test_prefix_cache_is_reported(llama_url: str, http: httpx.AsyncClient, smol: ChatTokenizer) -> None:
    client = LlamaCppClient(llama_url, http)
    prompt = smol.conversation(
        [{"role": "user", "content": "Tell me about caching prefixes of prompts."}]
    ).prompt_ids
    await client.generate(prompt, SamplingParams(max_tokens=2, seed=1))
    res = await client.generate(prompt, SamplingParams(max_tokens=2, seed=1))
    assert res.cached_tokens is not None and res.cached_tokens >= len(prompt) - 1


async def test_prompt_that_fills_the_context_is_refused(llama_url: str, http: httpx.AsyncClient) -> None:
    client = LlamaCppClient(llama_url, http)
    with pytest.raises(ContextWindowExceeded) as err:
        await client.generate([1] * 1024, SamplingParams(max_tokens=4))
    assert err.value.kind == "context_window_exceeded"
    # a prompt that leaves room gets max_tokens clipped to the room left, not an error
    res = await client.generate([1, 4093, 198] * 340, SamplingParams(max_tokens=50, temperature=0.0))
    assert len(res.output_ids) <= 1024 - 1020


async def test_empty_prompt_and_bad_sampling_are_bad_requests(
    llama_url: str, http: httpx.AsyncClient
) -> None:
    client = LlamaCppClient(llama_url, http)
    with pytest.raises(RaasError) as err:
        await client.generate([], SamplingParams())
    assert err.value.kind == "bad_request"
    with pytest.raises(RaasError) as err:
        SamplingParams.parse({"temperature": -1})
    assert err.value.kind == "bad_request"
    with pytest.raises(RaasError) as err:
        SamplingParams.parse({"nucleus": 0.5})
    assert err.value.kind == "bad_request"


async def test_stop_token_ids_end_the_output_on_llamacpp(
    llama_url: str, http: httpx.AsyncClient, smol: ChatTokenizer
) -> None:
    """llama.cpp has no stop-token-ID option: the client cuts after the first stop ID it sees."""
    client = LlamaCppClient(llama_url, http)
    prompt = smol.conversation([{"role": "user", "content": "Name three colours."}]).prompt_ids
    greedy = await client.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0))
    assert len(greedy.output_ids) >= 3
    stop = greedy.output_ids[2]
    cut = await client.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(stop,)))
    first = greedy.output_ids.index(stop)
    assert cut.output_ids == greedy.output_ids[: first + 1] and cut.finish_reason == "stop"
    assert len(cut.logprobs) == len(cut.output_ids)


async def test_multibyte_characters_keep_every_token_and_never_invent_logprobs(
    llama_url: str, http: httpx.AsyncClient, smol: ChatTokenizer
) -> None:
    """llama.cpp reports one probability per complete UTF-8 piece, so the byte tokens of a multi-byte
    character share one entry. The client keeps every sampled ID and leaves the unreported logprobs None."""
    client = LlamaCppClient(llama_url, http)
    conv = smol.conversation([{"role": "user", "content": "Write emoji and Chinese: 你好世界 🎉🎉 美"}])
    saw_missing = False
    for seed in range(24):
        res = await client.generate(conv.prompt_ids, SamplingParams(max_tokens=6, temperature=1.5, seed=seed))
        assert len(res.logprobs) == len(res.output_ids)
        missing = [i for i, lp in enumerate(res.logprobs) if lp is None]
        for i in missing:
            # only byte tokens (no complete character on their own) can lack a logprob
            assert "\ufffd" in smol.decode([res.output_ids[i]])
        saw_missing = saw_missing or bool(missing)
    assert saw_missing, "no seed produced a multi-byte character; the prompt no longer exercises the case"
