"""llama.cpp ``llama-server``: native ``/completion`` with an ID prompt and ``return_tokens``.

llama.cpp samples with top_k=40, top_p=0.95, min_p=0.05 unless told otherwise; raas always sends its
own values (``top_k: 0`` means off there) so the policy's full distribution is sampled. The context
length that matters is the per-slot ``n_ctx`` from ``/props``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any, ClassVar

from raas.llm.servers.base import ServerClient, TextSink, int_list, logprob_of, require
from raas.llm.types import GenerateResult, LLMError, SamplingParams, ServerInfo

_FINISH = {"eos": "stop", "word": "stop", "limit": "length"}
OVERSHOOT = 3
"""Tokens a stream may generate past ``max_tokens`` (a UTF-8 character is at most 4 bytes)."""


class LlamaCppClient(ServerClient):
    kind: ClassVar[str] = "llamacpp"
    streams: ClassVar[bool] = True

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

    async def generate_streaming(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int, on_text: TextSink
    ) -> GenerateResult:
        # A few tokens past the limit, when the context has room: a character the limit would cut off
        # is then completed, so its bytes are streamed (llama.cpp never sends an incomplete one) and the
        # IDs inside the limit can be recovered; the tokens past the limit are dropped (see LlamaStream).
        ctx = self.info.context_length if self.info else None
        room = max_tokens if ctx is None else max(ctx - len(prompt_ids), max_tokens)
        path, body = self.build_request(prompt_ids, sampling, min(max_tokens + OVERSHOOT, room))
        body["stream"] = True
        # The IDs the stream leaves out may have to be found by generating the reply again: that needs
        # the seed, so a stream always has one (kept in the result's extra["seed"]).
        body.setdefault("seed", secrets.randbits(31))
        reader = LlamaStream(limit=max_tokens)
        async for event in self.post_stream(path, body):
            piece = reader.feed(event)
            if piece:
                on_text(piece)
        result = reader.result()
        result.extra["seed"] = body["seed"]
        return result

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


class LlamaStream:
    """Reads ``/completion``'s stream (``stream: true``, ``return_tokens``) into a :class:`GenerateResult`.

    Each partial event carries ``content`` (the text since the last event), ``tokens`` (the IDs it adds),
    ``tokens_predicted`` (the running count) and ``completion_probabilities``; the last has ``stop: true``,
    ``stop_type``, ``timings``. llama.cpp sends no event for a token that leaves a multi-byte character
    incomplete: the event of the token that completes it carries the whole character's text but only its
    own ID. Those IDs are *gaps*, found from ``tokens_predicted``: each is recorded in ``extra
    ["stream_gaps"]`` (position, count, the event's text and the IDs it did list), with ``-1`` placeholders
    in ``output_ids``, for the caller to fill from its tokenizer (:func:`raas.llm.stream_gaps.fill_gaps`).
    The text of bytes cut off by the length limit is never sent: such a gap has ``text: None``; the client
    therefore asks for a few tokens past ``limit`` and the result holds them until ``fill_gaps`` has used
    them and cut the reply at ``extra["stream_limit"]`` (finish ``length``).
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.gaps: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None

    def feed(self, event: Any) -> str:
        """Take one event; returns the text it adds ('' past ``limit``: that text is not the reply's)."""
        if not isinstance(event, dict):
            raise LLMError("llama.cpp stream event is not a JSON object")
        content = event.get("content") or ""
        if not isinstance(content, str):
            raise LLMError("llama.cpp stream event: content is not a string")
        if event.get("stop"):
            self.final = event
            self._gap(event.get("tokens_predicted"), [], None)
        else:
            tokens = int_list(event.get("tokens") or [], "tokens")
            probs = event.get("completion_probabilities") or []
            self._gap(event.get("tokens_predicted"), tokens, content)
            self.ids.extend(tokens)
            self.logprobs.extend(align_logprobs(tokens, probs))
            if self.limit is not None and len(self.ids) > self.limit:
                return ""
        return content

    def _gap(self, predicted: Any, tokens: list[int], text: str | None) -> None:
        if isinstance(predicted, bool) or not isinstance(predicted, int):
            return
        count = predicted - len(self.ids) - len(tokens)
        if count < 0:
            raise LLMError(
                f"llama.cpp stream: {len(self.ids) + len(tokens)} tokens but tokens_predicted {predicted}"
            )
        if count:
            self.gaps.append({"at": len(self.ids), "count": count, "text": text, "then": list(tokens)})
            self.ids.extend([-1] * count)
            self.logprobs.extend([None] * count)

    def result(self) -> GenerateResult:
        final = self.final
        if final is None:
            raise LLMError("llama.cpp stream ended without its final event")
        stop_type = final.get("stop_type") or ("eos" if final.get("stopped_eos") else "limit")
        timings = final.get("timings") or {}
        cached = final.get("tokens_cached")
        if timings.get("cache_n") is not None:
            cached = timings["cache_n"]
        extra: dict[str, Any] = {"stop_type": stop_type, "timings": timings, "streamed": True}
        finish = _FINISH.get(stop_type, "stop")
        if self.gaps:
            extra["stream_gaps"] = self.gaps
        if self.limit is not None and len(self.ids) > self.limit:
            extra["stream_limit"] = self.limit  # fill_gaps cuts there, once the gaps are filled
            finish = "length"
        return GenerateResult(
            output_ids=self.ids,
            logprobs=self.logprobs,
            finish_reason=finish,
            prompt_tokens=int(final.get("tokens_evaluated") or 0),
            cached_tokens=cached,
            extra=extra,
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
