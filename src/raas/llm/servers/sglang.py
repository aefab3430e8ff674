"""SGLang's native ``/generate`` with ``input_ids`` and ``return_logprob``.

Wire format (SGLang docs, "SGLang Native APIs" and "Sampling Parameters", docs.sglang.io 2026):
request ``{"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature", "top_p", "top_k",
"min_p", "repetition_penalty", "stop_token_ids", "sampling_seed"}, "return_logprob": true}``; response
``{"text", "output_ids"?, "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", "matched"},
"prompt_tokens", "completion_tokens", "cached_tokens", "output_token_logprobs": [[logprob, id, text|null],
...], "weight_version"?}}``; a ``null`` logprob stays ``None``. Context length from ``/get_server_info`` (``context_length``) or
``/get_model_info`` (``max_context_length``/``context_length``) when the server reports it.

Streaming (``"stream": true``; SGLang's ``http_server.generate_request`` and the tokenizer manager's
output processor, read in its source, 2026): one ``data: {...}`` event per scheduler step, then ``data:
[DONE]``; an error is an event ``{"error": {"message"}}``. Each event holds ``text``, ``output_ids`` and
``meta_info`` as above, with ``completion_tokens`` the running count and ``finish_reason`` ``null`` until
the last. By default (``--incremental-streaming-output`` off) ``text``, ``output_ids`` and
``output_token_logprobs`` are *cumulative*; with it on, each event holds only its step's. The client
tells which from ``completion_tokens`` and reads both. SGLang has no CPU build these machines can run:
this was checked against that source and a double speaking it, not a live server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from raas.llm.servers.base import ServerClient, TextSink, finish_of, logprob_of, require, sampling_fields
from raas.llm.types import GenerateResult, LLMError, SamplingParams, ServerInfo


class SGLangClient(ServerClient):
    kind: ClassVar[str] = "sglang"
    streams: ClassVar[bool] = True

    async def fetch_info(self) -> ServerInfo:
        model = await self.get_json("/get_model_info")
        ctx = model.get("max_context_length") or model.get("context_length")
        if not ctx:
            try:
                server = await self.get_json("/get_server_info")
            except LLMError:
                server = {}
            ctx = server.get("context_length") if isinstance(server, dict) else None
        return ServerInfo(
            kind=self.kind, model=model.get("model_path"), context_length=int(ctx) if ctx else None
        )

    def build_request(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> tuple[str, dict[str, Any]]:
        params = sampling_fields(
            sampling, max_tokens, max_tokens_key="max_new_tokens", seed_key="sampling_seed"
        )
        return "/generate", {
            "input_ids": list(prompt_ids),
            "sampling_params": params,
            "return_logprob": True,
            "stream": False,
        }

    async def generate_streaming(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int, on_text: TextSink
    ) -> GenerateResult:
        path, body = self.build_request(prompt_ids, sampling, max_tokens)
        body["stream"] = True
        reader = SGLangStream()
        async for event in self.post_stream(path, body):
            piece = reader.feed(event)
            if piece:
                on_text(piece)
        return reader.result()

    def parse_response(self, body: Any) -> GenerateResult:
        if isinstance(body, list):  # batch form: one prompt sent, one answer expected
            body = require(body, 0)
        meta = require(body, "meta_info")
        ids, logprobs = _entries(require(meta, "output_token_logprobs"), 0)
        output_ids = body.get("output_ids")
        if isinstance(output_ids, list) and output_ids and output_ids != ids:
            raise LLMError("SGLang output_ids disagree with output_token_logprobs")
        return _result(ids, logprobs, meta)


class SGLangStream:
    """Reads ``/generate``'s stream, cumulative or incremental (see the module docstring), into a
    :class:`GenerateResult`; :meth:`feed` returns the text each event adds."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.text = ""
        self.meta: dict[str, Any] | None = None

    def feed(self, event: Any) -> str:
        if not isinstance(event, dict) or not isinstance(event.get("meta_info"), dict):
            raise LLMError("SGLang stream event has no meta_info")
        if self.meta is not None and self.meta.get("finish_reason") is not None:
            raise LLMError("SGLang stream: an event after the finish")
        meta = event["meta_info"]
        total = meta.get("completion_tokens")
        if isinstance(total, bool) or not isinstance(total, int):
            raise LLMError("SGLang stream event: meta_info.completion_tokens is not a count")
        entries = require(meta, "output_token_logprobs")
        if not isinstance(entries, list):
            raise LLMError("SGLang stream event: output_token_logprobs is not a list")
        have = len(self.ids)
        cumulative = len(entries) == total and have > 0
        if cumulative:
            ids, logprobs = _entries(entries, 0)
            if ids[:have] != self.ids:
                raise LLMError("SGLang stream: an event's tokens do not extend the ones before it")
            new_ids, new_logprobs = ids[have:], logprobs[have:]
        elif have + len(entries) == total:
            new_ids, new_logprobs = _entries(entries, have)
        else:
            raise LLMError(
                f"SGLang stream: {len(entries)} token entries after {have} tokens, completion_tokens {total}"
            )
        output_ids = event.get("output_ids")
        if isinstance(output_ids, list) and output_ids and output_ids not in (new_ids, self.ids + new_ids):
            raise LLMError("SGLang stream: output_ids disagree with output_token_logprobs")
        self.ids.extend(new_ids)
        self.logprobs.extend(new_logprobs)
        self.meta = meta
        text = event.get("text")
        if not isinstance(text, str):
            return ""
        if cumulative:
            piece = text[len(self.text) :] if text.startswith(self.text) else ""
        else:  # incremental, or the first tokens (where both modes send the same)
            piece = text
        self.text += piece
        return piece

    def result(self) -> GenerateResult:
        if self.meta is None or self.meta.get("finish_reason") is None:
            raise LLMError("SGLang stream ended without a finish_reason")
        result = _result(self.ids, self.logprobs, self.meta)
        result.extra["streamed"] = True
        return result


def _entries(entries: Any, offset: int) -> tuple[list[int], list[float | None]]:
    """IDs and logprobs out of ``[[logprob, token_id, text|null], ...]`` (``offset``: the first entry's
    position in the reply, for error messages)."""
    ids: list[int] = []
    logprobs: list[float | None] = []
    for i, entry in enumerate(entries):
        at = offset + i
        if not isinstance(entry, list | tuple) or len(entry) < 2 or not isinstance(entry[1], int):
            raise LLMError(f"SGLang output_token_logprobs[{at}] is not [logprob, token_id, ...]")
        logprobs.append(logprob_of(entry[0], f"output_token_logprobs[{at}][0]"))
        ids.append(entry[1])
    return ids, logprobs


def _result(ids: list[int], logprobs: list[float | None], meta: dict[str, Any]) -> GenerateResult:
    finish = meta.get("finish_reason") or {}
    ftype = finish.get("type") if isinstance(finish, dict) else str(finish)
    return GenerateResult(
        output_ids=ids,
        logprobs=logprobs,
        finish_reason=finish_of(ftype),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        cached_tokens=meta.get("cached_tokens"),
        extra={
            "weight_version": meta.get("weight_version"),
            "matched": finish.get("matched") if isinstance(finish, dict) else None,
        },
    )
