"""The vLLM and SGLang stream readers: a real vLLM stream replayed, SGLang's two stream modes, and the
malformed streams each must refuse (an ``llm_error``, never a trajectory built on a guess).

The vLLM streams in ``fixtures/vllm_stream_capture.json`` were captured unedited from a real vLLM (see
its ``about``); SGLang cannot run here, so its events are written as its output processor builds them
(see :mod:`raas.llm.servers.sglang`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from raas.llm.scripted import Completion, ScriptedLLM, replay
from raas.llm.servers.sglang import SGLangStream
from raas.llm.servers.vllm import VLLMClient, VLLMStream
from raas.llm.types import LLMError, SamplingParams

pytestmark = pytest.mark.unit

CAPTURE = json.loads((Path(__file__).parent / "fixtures" / "vllm_stream_capture.json").read_text())


@pytest.mark.parametrize("case", CAPTURE["cases"], ids=lambda c: c["name"])
def test_a_real_vllm_stream_reads_as_its_plain_answer(case: dict[str, Any]) -> None:
    reader = VLLMStream()
    pieces = [reader.feed(json.loads(e)) for e in case["events"] if e != "[DONE]"]
    streamed = reader.result()
    plain = VLLMClient("http://unused", httpx.AsyncClient()).parse_response(case["plain_response"])
    assert streamed.output_ids == plain.output_ids and len(plain.output_ids) > 5
    assert streamed.logprobs == plain.logprobs
    assert streamed.finish_reason == plain.finish_reason
    assert streamed.prompt_tokens == plain.prompt_tokens == len(case["request"]["prompt"])
    assert "".join(pieces) == case["plain_response"]["choices"][0]["text"]
    assert sum(1 for p in pieces if p) > 5  # the text came in many pieces


def test_the_captured_multibyte_stream_has_tokens_without_text() -> None:
    """What the reader must not lose: vLLM sends a token that leaves a character incomplete with empty
    text, and its ID and logprob all the same."""
    case = next(c for c in CAPTURE["cases"] if c["name"] == "multibyte_cut_by_length")
    choices = [c for e in case["events"] if e != "[DONE]" for c in json.loads(e)["choices"]]
    silent = [c for c in choices if c["token_ids"] and not c["text"]]
    assert len(silent) > 3
    reader = VLLMStream()
    for e in case["events"][:-1]:
        reader.feed(json.loads(e))
    assert len(reader.ids) == sum(len(c["token_ids"]) for c in choices)


def _vllm_event(ids: list[int], text: str = "x", finish: str | None = None, **over: Any) -> dict[str, Any]:
    choice = {
        "index": 0,
        "text": text,
        "token_ids": ids,
        "logprobs": {"token_logprobs": [-0.5] * len(ids)},
        "finish_reason": finish,
    }
    choice.update(over)
    return {"choices": [choice]}


@pytest.mark.parametrize(
    "events, message",
    [
        ([_vllm_event([1]), _vllm_event([2])], "without a finish_reason"),
        ([_vllm_event([1], logprobs={"token_logprobs": [-1.0, -2.0]})], "2 token IDs|1 token IDs"),
        ([_vllm_event([1], finish="stop"), _vllm_event([2])], "after the finish"),
        ([_vllm_event([1], index=1)], "a choice other than"),
        ([_vllm_event(["a"])], "not a list of token IDs"),  # type: ignore[list-item]
        ([_vllm_event([1], text=3)], "text is not a string"),
        (["not an object"], "not a JSON object"),
    ],
)
def test_a_malformed_vllm_stream_is_an_llm_error(events: list[Any], message: str) -> None:
    reader = VLLMStream()
    with pytest.raises(LLMError, match=message) as err:
        for e in events:
            reader.feed(e)
        reader.result()
    assert err.value.kind == "llm_error"


def test_a_missing_vllm_logprob_stays_none() -> None:
    reader = VLLMStream()
    reader.feed(_vllm_event([1, 2], logprobs={"token_logprobs": [None, -1.0]}))
    reader.feed(_vllm_event([3], logprobs=None, finish="length"))
    res = reader.result()
    assert (
        res.output_ids == [1, 2, 3] and res.logprobs == [None, -1.0, None] and res.finish_reason == "length"
    )


# -- SGLang -----------------------------------------------------------------------------------------------
REPLY = [(11, "He"), (12, "llo"), (13, ""), (14, "é!"), (2, "")]
"""(token, text it completes): 13 leaves a character incomplete, 2 is the EOS (SGLang trims its text)."""


def _sglang_events(incremental: bool, per_event: int = 1) -> list[dict[str, Any]]:
    events, text, entries = [], "", []
    steps = [REPLY[i : i + per_event] for i in range(0, len(REPLY), per_event)]
    for n, step in enumerate(steps):
        delta_text = "".join(t for _, t in step)
        delta = [[-0.1 * (len(entries) + j + 1), tid, None] for j, (tid, _) in enumerate(step)]
        text += delta_text
        entries += delta
        last = n == len(steps) - 1
        meta = {
            "id": "r",
            "finish_reason": {"type": "stop", "matched": 2} if last else None,
            "prompt_tokens": 7,
            "weight_version": "w3",
            "completion_tokens": len(entries),
            "cached_tokens": 4,
            "output_token_logprobs": delta if incremental else list(entries),
        }
        event = {
            "text": delta_text if incremental else text,
            "output_ids": [e[1] for e in (delta if incremental else entries)],
            "meta_info": meta,
        }
        events.append(json.loads(json.dumps(event)))  # each event its own JSON, as on the wire
    return events


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
@pytest.mark.parametrize("per_event", [1, 2])
def test_sglang_streams_read_the_same_in_both_modes(incremental: bool, per_event: int) -> None:
    reader = SGLangStream()
    pieces = [reader.feed(e) for e in _sglang_events(incremental, per_event)]
    res = reader.result()
    assert res.output_ids == [t for t, _ in REPLY]
    assert res.logprobs == pytest.approx([-0.1 * (i + 1) for i in range(len(REPLY))])
    assert "".join(pieces) == "Helloé!" and len([p for p in pieces if p]) > 1
    assert res.finish_reason == "stop" and res.prompt_tokens == 7 and res.cached_tokens == 4
    assert res.extra["weight_version"] == "w3" and res.extra["matched"] == 2 and res.extra["streamed"]


def test_sglang_cumulative_events_without_text_lose_nothing() -> None:
    """SGLang's non-incremental intermediate events may carry ``text: null``; the next one's text says all."""
    events = _sglang_events(incremental=False)
    for e in events[1:3]:
        e["text"] = None
    reader = SGLangStream()
    pieces = [reader.feed(e) for e in events]
    assert "".join(pieces) == "Helloé!" and reader.result().output_ids == [t for t, _ in REPLY]


def _broken(change: str) -> list[dict[str, Any]]:
    events = _sglang_events(incremental=False)
    if change == "count":
        events[2]["meta_info"]["completion_tokens"] = 9
    elif change == "rewritten":
        events[2]["meta_info"]["output_token_logprobs"][0][1] = 99
    elif change == "no-finish":
        events[-1]["meta_info"]["finish_reason"] = None
    elif change == "after-finish":
        events.append(events[-1])
    elif change == "output_ids":
        events[1]["output_ids"] = [11, 99]
    elif change == "entry":
        events[0]["meta_info"]["output_token_logprobs"] = [[-0.1, "11", None]]
    elif change == "no-meta":
        del events[0]["meta_info"]
    elif change == "no-count":
        del events[0]["meta_info"]["completion_tokens"]
    return events


@pytest.mark.parametrize(
    "change, message",
    [
        ("count", "completion_tokens 9"),
        ("rewritten", "do not extend"),
        ("no-finish", "without a finish_reason"),
        ("after-finish", "after the finish"),
        ("output_ids", "output_ids disagree"),
        ("entry", r"output_token_logprobs\[0\] is not"),
        ("no-meta", "no meta_info"),
        ("no-count", "completion_tokens is not a count"),
    ],
)
def test_a_malformed_sglang_stream_is_an_llm_error(change: str, message: str) -> None:
    reader = SGLangStream()
    with pytest.raises(LLMError, match=message) as err:
        for e in _broken(change):
            reader.feed(e)
        reader.result()
    assert err.value.kind == "llm_error"


@pytest.mark.integration
async def test_the_scripted_policy_streams_as_vllm_does() -> None:
    """``raas.llm.scripted`` speaks vLLM's protocol, streams included: a streamed answer reads as the plain one."""
    answer = Completion(token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3], text="abc", finish_reason="stop")
    async with ScriptedLLM(replay([answer], cycle=True)) as llm, httpx.AsyncClient() as http:
        client = VLLMClient(llm.url, http, endpoint="completions")
        sampling = SamplingParams(max_tokens=8)
        plain = await client.generate([1, 2], sampling)
        texts: list[str] = []
        streamed = await client.generate([1, 2], sampling, texts.append)
    assert streamed.output_ids == plain.output_ids == [5, 6, 7]
    assert streamed.logprobs == plain.logprobs == [-0.1, -0.2, -0.3]
    assert texts == ["abc"] and streamed.extra["streamed"] and streamed.prompt_tokens == 2
    assert llm.requests[1].body["stream"] is True
