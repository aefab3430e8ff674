"""Filling the IDs llama.cpp leaves out of a stream (raas.llm.stream_gaps) with the real SmolLM2 vocabulary:
unique spellings from the vocabulary, ambiguous ones only from an agreeing replay, never a guess."""

from __future__ import annotations

import pytest

from raas.errors import RaasError
from raas.llm.models import prepare_tokenizer
from raas.llm.stream_gaps import fill_gaps, vocab_bytes
from raas.llm.tokenizer import ChatTokenizer
from raas.llm.types import GenerateResult

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(prepare_tokenizer())


def _streamed(ids: list[int], gap_at: int, count: int, text: str | None, then: list[int]) -> GenerateResult:
    out = [*ids[:gap_at], *([-1] * count), *ids[gap_at:]]
    gap = {"at": gap_at, "count": count, "text": text, "then": then}
    return GenerateResult(
        output_ids=out, logprobs=[None] * len(out), finish_reason="stop", extra={"stream_gaps": [gap]}
    )


async def test_a_unique_spelling_is_taken_from_the_vocabulary(tok: ChatTokenizer) -> None:
    index, _ = vocab_bytes(tok.tokenizer)
    first, last = index[b"\xc3"][0], index[b"\xa9"][0]  # é as two byte tokens
    hi = tok.encode("Hi")
    result = _streamed([*hi, last], len(hi), 1, "é", [last])
    await fill_gaps(tok.tokenizer, result)
    assert result.output_ids == [*hi, first, last] and result.extra["stream_gaps_filled"] == 1


async def test_an_ambiguous_gap_needs_a_replay_that_agrees(tok: ChatTokenizer) -> None:
    index, _ = vocab_bytes(tok.tokenizer)
    last = index[b"\x98"][0]  # 秘 = e7 a7 98; " \xe7\xa7" in two tokens is spelled more than one way
    spellings = [[a, b] for a in index.get(b" ", []) for b in index.get(b"\xe7\xa7", [])]
    spellings += [[a, b] for a in index.get(b" \xe7", []) for b in index.get(b"\xa7", [])]
    assert len(spellings) >= 2
    hi = tok.encode("Hi")

    with pytest.raises(RaasError) as err:
        await fill_gaps(tok.tokenizer, _streamed([*hi, last], len(hi), 2, " 秘", [last]))
    assert err.value.kind == "token_mismatch" and "more than one" in err.value.message

    sampled = spellings[1]

    async def replay(n: int) -> list[int]:
        return [*hi, *sampled, last][:n]

    result = _streamed([*hi, last], len(hi), 2, " 秘", [last])
    await fill_gaps(tok.tokenizer, result, replay)
    assert (
        result.output_ids == [*hi, *sampled, last] and result.extra["stream_replayed_tokens"] == len(hi) + 2
    )

    async def other(n: int) -> list[int]:  # a replay that did not sample the same tokens
        return [*tok.encode("Yo"), *sampled, last][:n]

    with pytest.raises(RaasError) as err:
        await fill_gaps(tok.tokenizer, _streamed([*hi, last], len(hi), 2, " 秘", [last]), other)
    assert err.value.kind == "token_mismatch" and "other tokens" in err.value.message


async def test_a_limit_cuts_the_overshoot_and_text_never_sent_needs_a_replay(tok: ChatTokenizer) -> None:
    ids = tok.encode("Hello there friend")
    result = GenerateResult(
        output_ids=[*ids, -1],
        logprobs=[None] * (len(ids) + 1),
        finish_reason="length",
        extra={"stream_gaps": [{"at": len(ids), "count": 1, "text": None, "then": []}], "stream_limit": 2},
    )
    await fill_gaps(tok.tokenizer, result)  # the gap lies past the limit: cut, not needed
    assert result.output_ids == ids[:2] and len(result.logprobs) == 2
    result = GenerateResult(
        output_ids=[*ids, -1],
        logprobs=[None] * (len(ids) + 1),
        finish_reason="length",
        extra={"stream_gaps": [{"at": len(ids), "count": 1, "text": None, "then": []}]},
    )
    with pytest.raises(RaasError) as err:
        await fill_gaps(tok.tokenizer, result)
    assert err.value.kind == "token_mismatch" and "never sent" in err.value.message
