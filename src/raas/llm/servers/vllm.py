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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import httpx

from raas.llm.servers.base import ServerClient, int_list, logprob_of, require, sampling_fields
from raas.llm.types import GenerateResult, LLMError, SamplingParams, ServerInfo


class VLLMClient(ServerClient):
    """``endpoint`` is ``"completions"``, ``"generate"`` (tokens-only) or ``"auto"`` (probe once)."""

    kind: ClassVar[str] = "vllm"

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
        body = {
            "model": model,
            "prompt": list(prompt_ids),
            "logprobs": 1,
            "return_token_ids": True,
            "echo": False,
            "stream": False,
            "n": 1,
            **sampling_fields(sampling, max_tokens),
        }
        return "/v1/completions", body

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
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        finish = choice.get("finish_reason") or "stop"
        return GenerateResult(
            output_ids=ids,
            logprobs=logprobs,
            finish_reason="length" if finish == "length" else ("abort" if finish == "abort" else "stop"),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            cached_tokens=details.get("cached_tokens"),
            extra={"stop_reason": choice.get("stop_reason")},
        )
