"""A test double of llama.cpp's ``llama-server`` that streams: ``/props``, ``/health`` and ``/completion``
with ``stream: true`` in llama.cpp's own wire format, each token held until the test releases it.

What cannot run here is a model whose generation a test controls token by token; everything raas sees is
what llama-server sends (checked against the real server in test_streaming): one ``data: {...}`` event
per token with ``content`` (the text since the last event), ``tokens`` ([the token]), ``tokens_predicted``
(the running count) and ``completion_probabilities`` (the token's id, its piece's text and bytes, logprob);
no event for a token that leaves a multi-byte character incomplete (the event of the token that completes
it carries the whole text); a last event with ``stop: true``, ``stop_type``, ``timings``, empty
``content`` and ``tokens``. The reply is scripted as token IDs; ``n_predict`` cuts it (``stop_type:
limit``), else it ends ``eos``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


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


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class LlamaStreamDouble:
    """``async with LlamaStreamDouble(token_bytes, [reply_ids, ...]) as d``: request i gets reply i.

    ``d.release(n)`` lets n more tokens out (``d.release_all()`` every token from now on);
    ``d.sent`` counts the token events sent, ``d.finished`` the final events."""

    def __init__(self, token_bytes: dict[int, bytes], replies: Sequence[Sequence[int]], *, n_ctx: int = 4096):
        self.token_bytes = token_bytes
        self.replies = [list(r) for r in replies]
        self.n_ctx = n_ctx
        self.requests: list[dict[str, Any]] = []
        self.sent = 0
        self.finished = 0
        self._gate = asyncio.Semaphore(0)
        self._open = False
        self.port = 0
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self._gate.release()

    def release_all(self) -> None:
        self._open = True
        self.release(10_000)

    @staticmethod
    def logprob(index: int) -> float:
        return -0.25 - index / 64

    async def _props(self, request: Request) -> Response:
        settings = {"n_ctx": self.n_ctx}
        return JSONResponse(
            {"default_generation_settings": settings, "total_slots": 1, "model_path": "double"}
        )

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _completion(self, request: Request) -> Response:
        body = await request.json()
        index = len(self.requests)
        self.requests.append(body)
        reply = self.replies[index]
        n_predict = int(body.get("n_predict", -1))
        cut = reply[:n_predict] if n_predict >= 0 else reply
        if not body.get("stream"):
            return JSONResponse({"error": "this double only streams"}, status_code=400)
        return StreamingResponse(
            self._events(body, cut, len(cut) < len(reply)), media_type="text/event-stream"
        )

    async def _events(self, body: dict[str, Any], ids: list[int], limited: bool) -> AsyncIterator[str]:
        pending = b""
        for i, tid in enumerate(ids):
            if not self._open:
                await self._gate.acquire()
            pending += self.token_bytes[tid]
            try:
                text = pending.decode()
            except UnicodeDecodeError:
                continue  # llama.cpp sends nothing while a character is incomplete
            pending = b""
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
            yield f"data: {json.dumps(event)}\n\n"
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
        yield f"data: {json.dumps(final)}\n\n"

    async def __aenter__(self) -> LlamaStreamDouble:
        app = Starlette(
            routes=[
                Route("/props", self._props),
                Route("/health", self._health),
                Route("/completion", self._completion, methods=["POST"]),
            ]
        )
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._server = _Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release_all()
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10)
        if self._sock is not None:
            self._sock.close()
