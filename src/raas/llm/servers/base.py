"""The shape every inference-server client has: token IDs in, token IDs + logprobs out, over httpx.

A subclass only says how to build the request body and how to read the response for its server kind;
retries with backoff on connection errors and 5xx, timeouts, and the context-window pre-check live here.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, ClassVar

import httpx

from raas.errors import RaasError
from raas.llm.types import (
    ContextWindowExceeded,
    GenerateResult,
    LLMError,
    LLMTimeout,
    LLMUnavailable,
    SamplingParams,
    ServerInfo,
)

# Phrases servers use when a prompt is too long (vLLM, SGLang, llama.cpp).
_CONTEXT_PHRASES = (
    "maximum context length",
    "context length",
    "maximum model length",
    "exceeds the available context",
    "exceed_context_size",
    "longer than the model",
    "too long",
    "context window",
)


TextSink = Callable[[str], None]
"""Receives a streamed generation's text, piece by piece, as the server sends it."""


class ServerClient(ABC):
    """Client for one inference server address."""

    kind: ClassVar[str] = ""
    streams: ClassVar[bool] = False
    """True when :meth:`generate_streaming` forwards text as it is generated (else a generate call with a
    text sink answers its text in one piece, once the generation is done)."""

    def __init__(
        self,
        address: str,
        http: httpx.AsyncClient,
        *,
        request_timeout_s: float = 600.0,
        retries: int = 2,
        backoff_s: float = 0.2,
    ) -> None:
        self.address = address.rstrip("/")
        self.http = http
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.info: ServerInfo | None = None

    # -- what a server kind provides ---------------------------------------------------------------
    @abstractmethod
    async def fetch_info(self) -> ServerInfo:
        """Model name and context length (per request slot)."""

    @abstractmethod
    def build_request(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int
    ) -> tuple[str, dict[str, Any]]:
        """(path, JSON body) of one generate request."""

    @abstractmethod
    def parse_response(self, body: Any) -> GenerateResult:
        """Read output IDs, logprobs and finish reason out of the server's JSON."""

    health_path: ClassVar[str] = "/health"

    # -- shared behaviour --------------------------------------------------------------------------
    async def health(self, timeout_s: float = 5.0) -> bool:
        """True when the server answers its health endpoint with 2xx."""
        try:
            r = await self.http.get(self.address + self.health_path, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return r.is_success

    async def ensure_info(self) -> ServerInfo:
        if self.info is None:
            self.info = await self.fetch_info()
        return self.info

    def max_new_tokens(self, prompt_len: int, sampling: SamplingParams) -> int:
        """Tokens left to generate; raises ContextWindowExceeded when the prompt leaves none."""
        ctx = self.info.context_length if self.info else None
        if ctx is None:
            if sampling.max_tokens is None:
                raise LLMError(f"{self.address}: context length unknown; set max_tokens")
            return sampling.max_tokens
        room = ctx - prompt_len
        if room < 1:
            raise ContextWindowExceeded(
                f"prompt of {prompt_len} tokens leaves no room in the {ctx}-token context of {self.address}"
            )
        return room if sampling.max_tokens is None else min(room, sampling.max_tokens)

    async def generate_streaming(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, max_tokens: int, on_text: TextSink
    ) -> GenerateResult:
        """A generation streamed from the server (server kinds with ``streams``)."""
        raise NotImplementedError

    async def generate(
        self, prompt_ids: Sequence[int], sampling: SamplingParams, on_text: TextSink | None = None
    ) -> GenerateResult:
        """One generate call with retries on connection errors and 5xx. With ``on_text``, a server kind
        that ``streams`` is asked for a stream and its text goes to ``on_text`` as it arrives (no retry
        once text has gone out; see :meth:`post_stream`)."""
        if not prompt_ids:
            raise RaasError("empty prompt", kind="bad_request")
        await self.ensure_info()
        max_tokens = self.max_new_tokens(len(prompt_ids), sampling)
        start = time.perf_counter()
        if on_text is not None and self.streams:
            result = await self.generate_streaming(prompt_ids, sampling, max_tokens, on_text)
        else:
            path, body = self.build_request(prompt_ids, sampling, max_tokens)
            data = await self.post_json(path, body)
            result = self.parse_response(data)
        if sampling.stop_token_ids:
            _cut_at_stop(result, sampling.stop_token_ids)
        result.latency_s = time.perf_counter() - start
        result.server = self.address
        result.kind = self.kind
        result.prompt_tokens = result.prompt_tokens or len(prompt_ids)
        if len(result.logprobs) != len(result.output_ids):
            raise LLMError(
                f"{self.address}: {len(result.logprobs)} logprobs for {len(result.output_ids)} tokens"
            )
        return result

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST with retries: connection failures and 5xx are retried with exponential backoff; 4xx are
        the caller's fault and are not."""
        url = self.address + path
        last: str = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * (2 ** (attempt - 1)))
            try:
                r = await self.http.post(url, json=body, timeout=self.request_timeout_s)
            except httpx.TimeoutException as exc:
                if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
                    last = f"{type(exc).__name__}"
                    continue
                raise LLMTimeout(f"{url}: no answer within {self.request_timeout_s:g}s") from exc
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if r.status_code >= 500:
                text = r.text[:500]
                if _is_context_error(text):
                    raise ContextWindowExceeded(f"{url}: {text}")
                last = f"HTTP {r.status_code}: {text}"
                continue
            if r.status_code >= 400:
                text = r.text[:500]
                if _is_context_error(text):
                    raise ContextWindowExceeded(f"{url}: {text}")
                raise LLMError(f"{url}: HTTP {r.status_code}: {text}")
            try:
                return r.json()
            except ValueError as exc:
                raise LLMError(f"{url}: answer is not JSON: {r.text[:200]!r}") from exc
        raise LLMUnavailable(f"{url}: {last} (after {self.retries + 1} attempts)")

    async def post_stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
        """POST for Server-Sent Events; yields each ``data:`` JSON as it arrives. Not retried: a server that
        cannot be reached before the first event is ``llm_unavailable`` (the balancer may fail over, nothing
        was sent on), one that fails after it is ``llm_error``."""
        url = self.address + path
        started = False
        try:
            async with self.http.stream("POST", url, json=body, timeout=self.request_timeout_s) as r:
                if r.status_code >= 400:
                    text = (await r.aread()).decode(errors="replace")[:500]
                    if _is_context_error(text):
                        raise ContextWindowExceeded(f"{url}: {text}")
                    error = LLMUnavailable if r.status_code >= 500 else LLMError
                    raise error(f"{url}: HTTP {r.status_code}: {text}")
                async for line in r.aiter_lines():
                    if line.startswith("error:"):
                        raise LLMError(f"{url}: the stream reported an error: {line[6:].strip()[:500]}")
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        event = json.loads(data)
                    except ValueError as exc:
                        raise LLMError(f"{url}: stream event is not JSON: {data[:200]!r}") from exc
                    if isinstance(event, dict) and "error" in event:
                        raise LLMError(f"{url}: the stream reported an error: {str(event['error'])[:500]}")
                    started = True
                    yield event
        except httpx.TimeoutException as exc:
            if not started and isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
                raise LLMUnavailable(f"{url}: {type(exc).__name__}") from exc
            raise LLMTimeout(f"{url}: no stream event within {self.request_timeout_s:g}s") from exc
        except httpx.TransportError as exc:
            error = LLMError if started else LLMUnavailable
            raise error(f"{url}: {type(exc).__name__}: {exc}") from exc

    async def get_json(self, path: str, timeout_s: float = 10.0) -> Any:
        url = self.address + path
        try:
            r = await self.http.get(url, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise LLMUnavailable(f"{url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code >= 400:
            raise (LLMUnavailable if r.status_code >= 500 else LLMError)(f"{url}: HTTP {r.status_code}")
        try:
            return r.json()
        except ValueError as exc:
            raise LLMError(f"{url}: answer is not JSON") from exc


def _is_context_error(text: str) -> bool:
    low = text.lower()
    return any(p in low for p in _CONTEXT_PHRASES)


def _cut_at_stop(result: GenerateResult, stop_ids: Sequence[int]) -> None:
    """Servers without stop-token-ID support generate past them: keep up to and including the first."""
    stops = set(stop_ids)
    for i, tid in enumerate(result.output_ids):
        if tid in stops:
            del result.output_ids[i + 1 :]
            del result.logprobs[i + 1 :]
            result.finish_reason = "stop"
            return


def sampling_fields(
    sampling: SamplingParams, max_tokens: int, *, max_tokens_key: str = "max_tokens", seed_key: str = "seed"
) -> dict[str, Any]:
    """The sampling dict vLLM and SGLang share; they differ only in the token-limit and seed key names."""
    fields: dict[str, Any] = {
        max_tokens_key: max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "skip_special_tokens": False,
    }
    if sampling.stop_token_ids:
        fields["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        fields[seed_key] = sampling.seed
    return fields


def finish_of(reason: Any) -> str:
    """A server's finish reason in raas's terms: ``length`` and ``abort`` as they are; anything else (EOS,
    a stop token or string) is ``stop``."""
    return reason if reason in ("length", "abort") else "stop"


def require(body: Any, *keys: str | int) -> Any:
    """Walk ``body[k1][k2]...`` or raise an LLMError naming the missing field."""
    cur = body
    path = ""
    for k in keys:
        path += f"[{k!r}]"
        try:
            cur = cur[k]
        except (KeyError, IndexError, TypeError) as exc:
            raise LLMError(f"server answer has no {path}") from exc
    return cur


def logprob_of(value: Any, what: str) -> float | None:
    """A reported logprob as a float, or ``None`` where the server reported none (never an invented 0.0:
    a trainer must be able to tell a missing logprob from probability 1)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LLMError(f"server answer: {what} is not a number: {value!r}")
    return float(value)


def int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise LLMError(f"server answer: {what} is not a list of token IDs")
    return list(value)
