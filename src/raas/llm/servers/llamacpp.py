"""llama.cpp ``llama-server``: native ``/completion`` with an ID prompt and ``return_tokens``.

llama.cpp samples with top_k=40, top_p=0.95, min_p=0.05 unless told otherwise; raas always sends its
own values (``top_k: 0`` means off there) so the policy's full distribution is sampled. The context
length that matters is the per-slot ``n_ctx`` from ``/props``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from raas.llm.servers.base import ServerClient, int_list, logprob_of, require
from raas.llm.types import GenerateResult, LLMError, SamplingParams, ServerInfo

_FINISH = {"eos": "stop", "word": "stop", "limit": "length"}


class LlamaCppClient(ServerClient):
    kind: ClassVar[str] = "llamacpp"

    async def fetch_info(self) -> ServerInfo:
        props = await self.get_json("/props")
        settings = props.get("default_generation_settings") or {}
        n_ctx = settings.get("n_ctx") or props.get("n_ctx")
        return ServerInfo(
            kind=self.kind,
            model=props.get("model_path") or props.get("model_alias"),
            context_length=int(n_ctx) if n_ctx else None,
        )

    def build_request(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "n_predict": max_tokens,
            "temperature": sampling.temperature,
            "top_k": 0 if sampling.top_k < 0 else sampling.top_k,
            "top_p": sampling.top_p,
            "min_p": sampling.min_p,
            "typical_p": 1.0,
            "repeat_penalty": sampling.repetition_penalty,
            "n_probs": 1,
            "return_tokens": True,
            "cache_prompt": True,
            "stream": False,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        return "/completion", body

    def parse_response(self, body: Any) -> GenerateResult:
        tokens = int_list(require(body, "tokens"), "tokens")
        logprobs = align_logprobs(tokens, body.get("completion_probabilities") or [])
        stop_type = body.get("stop_type") or ("eos" if body.get("stopped_eos") else "limit")
        timings = body.get("timings") or {}
        cached = body.get("tokens_cached")
        if timings.get("cache_n") is not None:
            cached = timings["cache_n"]
        return GenerateResult(
            output_ids=tokens,
            logprobs=logprobs,
            finish_reason=_FINISH.get(stop_type, "stop"),
            prompt_tokens=int(body.get("tokens_evaluated") or 0),
            cached_tokens=cached,
            extra={"stop_type": stop_type, "timings": timings},
        )


def align_logprobs(tokens: Sequence[int], probs: Sequence[Any]) -> list[float | None]:
    """Line llama.cpp's probability entries up with the exact sampled tokens.

    llama.cpp emits one entry per *complete UTF-8 text piece*: the byte tokens of a multi-byte character
    share one entry (carrying the id and logprob of the last of them), and trailing bytes of a character
    cut off by the length limit get none. The entries are therefore an ordered subsequence of ``tokens``;
    tokens without an entry (or whose entry carries a ``null`` logprob) get ``None`` — never an invented
    number.
    """
    out: list[float | None] = [None] * len(tokens)
    j = 0
    for i, tid in enumerate(tokens):
        if j >= len(probs):
            break
        entry = probs[j]
        if not isinstance(entry, dict) or "logprob" not in entry:
            raise LLMError("llama.cpp returned probabilities without logprob (server too old)")
        eid = entry.get("id")
        if eid is None and len(probs) != len(tokens):
            raise LLMError("llama.cpp probabilities carry no token ids: cannot align them with the tokens")
        if eid is None or eid == tid:
            out[i] = logprob_of(entry["logprob"], f"completion_probabilities[{j}].logprob")
            j += 1
    if j != len(probs):
        raise LLMError(
            f"llama.cpp returned {len(probs)} token probabilities that do not match its {len(tokens)} tokens"
        )
    return out
