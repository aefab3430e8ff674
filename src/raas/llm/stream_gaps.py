"""Fill in the token IDs a llama.cpp stream leaves out (see :class:`raas.llm.servers.llamacpp.LlamaStream`).

llama.cpp does not stream a token that leaves a multi-byte character incomplete; the event that completes
the character carries its text but only its own ID. What is known of each gap: where it is, how many
tokens it holds, and the bytes they spell. The IDs are recovered from the tokenizer's vocabulary: the one
sequence of exactly that many tokens whose bytes are exactly those. When no sequence or more than one
fits (or the bytes were never sent), the reply is generated again, not streamed, with the same seed, and
the gaps are taken from it once it agrees with every ID the stream did send; otherwise the IDs cannot be
known and the turn fails as ``token_mismatch`` (infrastructure: filtered, never trained on a guess).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from functools import lru_cache
from typing import Any

from raas.errors import RaasError
from raas.llm.types import GenerateResult

_HEX_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
MAX_GAP_BYTES = 16


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    try:
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return False
    parts = decoder.get("decoders") or [decoder]
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


def vocab_bytes(tokenizer: Any) -> tuple[dict[bytes, list[int]], dict[int, bytes]]:
    """Bytes -> the vocabulary IDs that spell them, and ID -> bytes (added and special tokens left out)."""
    cached = getattr(tokenizer, "_raas_vocab_bytes", None)
    if cached is not None:
        return cached
    byte_level = _is_byte_level(tokenizer)
    decoder = _byte_decoder()
    added = (
        set(tokenizer.get_added_tokens_decoder()) if hasattr(tokenizer, "get_added_tokens_decoder") else set()
    )
    index: dict[bytes, list[int]] = {}
    by_id: dict[int, bytes] = {}
    for piece, tid in tokenizer.get_vocab(with_added_tokens=False).items():
        if tid in added:
            continue
        hexed = _HEX_BYTE.match(piece)
        if hexed:
            raw = bytes([int(hexed.group(1), 16)])
        elif byte_level and all(c in decoder for c in piece):
            raw = bytes(decoder[c] for c in piece)
        else:
            raw = piece.replace("\u2581", " ").encode()
        index.setdefault(raw, []).append(tid)
        by_id[tid] = raw
    try:
        tokenizer._raas_vocab_bytes = (index, by_id)
    except AttributeError:  # a tokenizer that takes no attributes: rebuilt per call
        pass
    return index, by_id


def _spellings(data: bytes, count: int, index: dict[bytes, list[int]], limit: int = 2) -> list[list[int]]:
    """Up to ``limit`` sequences of exactly ``count`` vocabulary IDs whose bytes are ``data``."""
    found: list[list[int]] = []

    def walk(at: int, left: int, acc: list[int]) -> None:
        if len(found) >= limit:
            return
        if at == len(data):
            if left == 0:
                found.append(list(acc))
            return
        if left == 0:
            return
        for end in range(at + 1, len(data) + 1):
            for tid in index.get(data[at:end], []):
                acc.append(tid)
                walk(end, left - 1, acc)
                acc.pop()

    walk(0, count, [])
    return found


Replay = Callable[[int], Awaitable[list[int]]]
"""Generates the same reply again, not streamed, up to the given number of tokens (same seed)."""


def _unknown(reason: str) -> RaasError:
    return RaasError(f"{reason}: the exact IDs cannot be known", kind="token_mismatch")


async def fill_gaps(tokenizer: Any, result: GenerateResult, replay: Replay | None = None) -> None:
    """Replace the ``-1`` placeholders of ``result.extra["stream_gaps"]`` by the IDs, and cut a reply
    generated past its limit at ``extra["stream_limit"]``. Every streamed result must go through it.

    A gap is filled from the vocabulary when exactly one sequence of its length spells its bytes. The
    others (several spellings, or text never sent) need ``replay``: the reply generated again, not
    streamed, with the same seed (sampling is then deterministic), whose IDs must agree with every ID the
    stream did send before its gaps are taken. Without a replay, or when it disagrees, ``token_mismatch``.
    """
    gaps = result.extra.pop("stream_gaps", None) or []
    limit = result.extra.pop("stream_limit", None)
    # built once per tokenizer (~0.2 s for 50k tokens): off the event loop
    index, by_id = await asyncio.to_thread(vocab_bytes, tokenizer) if gaps else ({}, {})
    open_gaps: list[tuple[int, int, str]] = []
    for gap in gaps:
        at, count, text = int(gap["at"]), int(gap["count"]), gap.get("text")
        if limit is not None and at >= limit:
            continue  # past the limit: cut below
        if result.output_ids[at : at + count] != [-1] * count:
            continue  # cut off already (after a stop token the client cut at)
        if text is None:
            open_gaps.append((at, count, "its text was never sent (a character cut off by the limit)"))
            continue
        # the event's text is the missing tokens' bytes followed by those of the tokens it did list
        own = b"".join(by_id.get(t, b"\xff\xff\xff\xff\xff") for t in gap["then"])
        data = str(text).encode()
        raw = data[: len(data) - len(own)] if data.endswith(own) and len(own) <= len(data) else None
        if raw is None or len(raw) > MAX_GAP_BYTES:
            open_gaps.append((at, count, f"its event's text {text!r} does not end with the IDs it listed"))
            continue
        found = _spellings(raw, count, index)
        if len(found) != 1:
            why = "no" if not found else "more than one"
            open_gaps.append((at, count, f"{why} sequence of the vocabulary spells {raw!r}"))
            continue
        result.output_ids[at : at + count] = found[0]
    if open_gaps:
        at, count, why = open_gaps[0]
        if replay is None:
            raise _unknown(f"the stream left out {count} token ID(s) at {at} and {why}")
        end = max(a + c for a, c, _ in open_gaps)
        again = await replay(end)
        sent = [(i, t) for i, t in enumerate(result.output_ids[:end]) if t != -1]
        if len(again) < end or any(again[i] != t for i, t in sent):
            raise _unknown(
                f"the stream left out {count} token ID(s) at {at} ({why}), and generating the reply again "
                "with its seed gave other tokens"
            )
        for a, c, _ in open_gaps:
            result.output_ids[a : a + c] = again[a : a + c]
        result.extra["stream_replayed_tokens"] = end
    if limit is not None:
        del result.output_ids[limit:]
        del result.logprobs[limit:]
    if gaps:
        result.extra["stream_gaps_filled"] = sum(
            int(g["count"]) for g in gaps if limit is None or g["at"] < limit
        )
