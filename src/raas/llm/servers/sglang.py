"""SGLang's native ``/generate`` with ``input_ids`` and ``return_logprob``.

Wire format (SGLang docs, "SGLang Native APIs" and "Sampling Parameters", docs.sglang.io 2026):
request ``{"input_ids": [...], "sampling_params": {"max_new_tokens", "temperature", "top_p", "top_k",
"min_p", "repetition_penalty", "stop_token_ids", "sampling_seed"}, "return_logprob": true}``; response
``{"text", "output_ids"?, "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort", "matched"},
"prompt_tokens", "completion_tokens", "cached_tokens", "output_token_logprobs": [[logprob, id, text|null],
...], "weight_version"?}}``; a ``null`` logprob stays ``None``. Context length from ``/get_server_info`` (``context_length``) or
``/get_model_info`` (``max_context_length``/``context_length``) when the server reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from raas.llm.servers.base import ServerClient, logprob_of, require, sampling_fields
from raas.llm.types import GenerateResult, LLMError, SamplingParams, ServerInfo


class SGLangClient(ServerClient):
    kind: ClassVar[str] = "sglang"

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

    def parse_response(self, body: Any) -> GenerateResult:
        if isinstance(body, list):  # batch form: one prompt sent, one answer expected
            body = require(body, 0)
        meta = require(body, "meta_info")
        entries = require(meta, "output_token_logprobs")
        ids: list[int] = []
        logprobs: list[float | None] = []
        for i, entry in enumerate(entries):
            if not isinstance(entry, list | tuple) or len(entry) < 2 or not isinstance(entry[1], int):
                raise LLMError(f"SGLang output_token_logprobs[{i}] is not [logprob, token_id, ...]")
            logprobs.append(logprob_of(entry[0], f"output_token_logprobs[{i}][0]"))
            ids.append(entry[1])
        output_ids = body.get("output_ids")
        if isinstance(output_ids, list) and output_ids and output_ids != ids:
            raise LLMError("SGLang output_ids disagree with output_token_logprobs")
        finish = meta.get("finish_reason") or {}
        ftype = finish.get("type") if isinstance(finish, dict) else str(finish)
        return GenerateResult(
            output_ids=ids,
            logprobs=logprobs,
            finish_reason="length" if ftype == "length" else ("abort" if ftype == "abort" else "stop"),
            prompt_tokens=int(meta.get("prompt_tokens") or 0),
            cached_tokens=meta.get("cached_tokens"),
            extra={
                "weight_version": meta.get("weight_version"),
                "matched": finish.get("matched") if isinstance(finish, dict) else None,
            },
        )
