"""Test doubles that speak SGLang's and vLLM's exact HTTP wire shapes on a real socket (uvicorn).

SGLang cannot run on these machines (it needs a GPU); its double follows the SGLang docs, "SGLang Native
APIs" and "Sampling Parameters" (docs.sglang.io, 2026-03 build): ``POST /generate`` takes ``input_ids``,
``sampling_params`` and ``return_logprob`` and answers ``{"text", "output_ids", "meta_info": {"id",
"finish_reason": {"type", "matched"}, "prompt_tokens", "completion_tokens", "cached_tokens",
"output_token_logprobs": [[logprob, token_id, null], ...], "weight_version", "e2e_latency"}}``;
``GET /get_model_info`` and ``GET /health``.

The vLLM double follows vLLM's OpenAI server (``/v1/models`` with ``max_model_len``, ``/v1/completions``
with ``return_token_ids`` → ``choices[].token_ids`` / ``prompt_token_ids`` / ``logprobs.token_logprobs``,
and the tokens-only ``/inference/v1/generate`` → ``choices[].token_ids`` / ``logprobs.content[].logprob``);
the real server is exercised by ``make test-vllm``. Faults (5xx, context errors) are injected per request.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

Fault = Callable[[dict[str, Any]], Response | None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WireDouble:
    """Base: a uvicorn server on a free port; ``requests`` records every JSON body received."""

    def __init__(self, *, context_length: int = 512, weight_version: str = "w0") -> None:
        self.context_length = context_length
        self.weight_version = weight_version
        self.requests: list[dict[str, Any]] = []
        self.faults: list[Fault] = []
        self.app = FastAPI()
        self.port = _free_port()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output_for(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Deterministic 'sampling': echo the last prompt IDs back, at most max_tokens of them."""
        n = min(max_tokens, 4)
        return [(prompt[-1] + i + 1) % 1000 for i in range(n)]

    async def _record(self, request: Request) -> tuple[dict[str, Any], Response | None]:
        body = await request.json()
        self.requests.append(body)
        for fault in list(self.faults):
            answer = fault(body)
            if answer is not None:
                return body, answer
        return body, None

    async def __aenter__(self) -> WireDouble:
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None and self._task is not None
        self._server.should_exit = True
        await self._task


class SGLangDouble(WireDouble):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        app = self.app

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/get_model_info")
        async def model_info() -> dict[str, Any]:
            return {
                "model_path": "double/sglang-model",
                "tokenizer_path": "double/sglang-model",
                "is_generation": True,
                "max_context_length": self.context_length,
            }

        @app.post("/generate")
        async def generate(request: Request) -> Any:
            body, fault = await self._record(request)
            if fault is not None:
                return fault
            ids = body["input_ids"]
            params = body.get("sampling_params") or {}
            if len(ids) >= self.context_length:
                return JSONResponse(
                    {"error": {"message": "The input is longer than the model's context length"}},
                    status_code=400,
                )
            out = self.output_for(ids, int(params.get("max_new_tokens", 16)))
            stop = set(params.get("stop_token_ids") or [])
            matched = None
            for i, tid in enumerate(out):
                if tid in stop:
                    out, matched = out[: i + 1], tid
                    break
            finish = (
                {"type": "stop", "matched": matched}
                if matched is not None or len(out) < 4
                else {"type": "length", "length": len(out)}
            )
            return {
                "text": "".join(f"<{t}>" for t in out),
                "output_ids": out,
                "meta_info": {
                    "id": f"req-{len(self.requests)}",
                    "finish_reason": finish,
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out),
                    "cached_tokens": max(0, len(ids) - 1) if len(self.requests) > 1 else 0,
                    "output_token_logprobs": [[-0.25 * (i + 1), t, None] for i, t in enumerate(out)],
                    "weight_version": self.weight_version,
                    "e2e_latency": 0.001,
                },
            }


class VLLMDouble(WireDouble):
    def __init__(self, *, tokens_endpoint: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        app = self.app

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [
                    {
                        "id": "double/vllm-model",
                        "object": "model",
                        "owned_by": "vllm",
                        "max_model_len": self.context_length,
                    }
                ],
            }

        def too_long(ids: list[int]) -> Response | None:
            if len(ids) >= self.context_length:
                return JSONResponse(
                    {
                        "object": "error",
                        "message": f"This model's maximum context length is "
                        f"{self.context_length} tokens. However, you requested {len(ids)} tokens.",
                        "type": "BadRequestError",
                        "code": 400,
                    },
                    status_code=400,
                )
            return None

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body, fault = await self._record(request)
            if fault is not None:
                return fault
            ids = body["prompt"]
            if (refusal := too_long(ids)) is not None:
                return refusal
            out = self.output_for(ids, int(body.get("max_tokens") or 16))
            return {
                "id": "cmpl-double",
                "object": "text_completion",
                "model": body.get("model"),
                "choices": [
                    {
                        "index": 0,
                        "text": "".join(f"<{t}>" for t in out),
                        "logprobs": {
                            "text_offset": list(range(len(out))),
                            "token_logprobs": [-0.5] * len(out),
                            "tokens": [f"token_id:{t}" for t in out],
                            "top_logprobs": [{f"token_id:{t}": -0.5} for t in out],
                        },
                        "finish_reason": "length" if len(out) == body.get("max_tokens") else "stop",
                        "stop_reason": None,
                        "token_ids": out,
                        "prompt_token_ids": ids,
                    }
                ],
                "usage": {
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(out),
                    "total_tokens": len(ids) + len(out),
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            }

        if tokens_endpoint:

            @app.post("/inference/v1/generate")
            async def tokens_generate(request: Request) -> Any:
                body, fault = await self._record(request)
                if fault is not None:
                    return fault
                ids = body.get("token_ids")
                if not isinstance(ids, list):  # vLLM validates the body: 422, as for any bad request
                    return JSONResponse(
                        {
                            "detail": [
                                {"type": "missing", "loc": ["body", "token_ids"], "msg": "Field required"}
                            ]
                        },
                        status_code=422,
                    )
                if (refusal := too_long(ids)) is not None:
                    return refusal
                params = body.get("sampling_params") or {}
                out = self.output_for(ids, int(params.get("max_tokens") or 16))
                return {
                    "request_id": "gen-double",
                    "choices": [
                        {
                            "index": 0,
                            "token_ids": out,
                            "finish_reason": "stop",
                            "logprobs": {
                                "content": [
                                    {
                                        "token": f"token_id:{t}",
                                        "logprob": -0.75,
                                        "bytes": None,
                                        "top_logprobs": [],
                                    }
                                    for t in out
                                ]
                            },
                        }
                    ],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)},
                }


class HeldVLLM:
    """A raw-socket vLLM-protocol double whose answers a test releases by hand.

    Why raw: a test of weight sync needs a server that has *accepted* a request and holds it (or drops the
    connection mid-request, as a crashing server does) exactly until the test says so; uvicorn cannot drop
    a connection mid-request. It speaks the parts of vLLM's OpenAI server the vLLM client uses: ``GET
    /health``, ``GET /v1/models`` (with ``max_model_len``), ``POST /inference/v1/generate`` (404: no
    scale-out route, so the client uses completions) and ``POST /v1/completions`` (``token_ids`` and
    ``logprobs.token_logprobs``). Every path in ``hold`` waits for :attr:`release` before answering;
    ``drop_completions`` makes a released completion close the connection without an answer.
    ``received`` is set once a held request has arrived; ``log`` records ``(method, path)`` of every request;
    ``healthy = False`` makes ``/health`` answer 503.
    """

    def __init__(self, *, hold: set[str] | None = None, drop_completions: bool = False) -> None:
        self.hold = set(hold or ())
        self.drop_completions = drop_completions
        self.healthy = True
        self.received = asyncio.Event()
        self.release = asyncio.Event()
        self.log: list[tuple[str, str]] = []
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> HeldVLLM:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self.release.set()  # nothing stays held past the test
        self._server.close()
        for w in list(self._conns):
            w.transport.abort()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.log.append((method, path))
                if path in self.hold:
                    self.received.set()
                    await self.release.wait()
                    if path == "/v1/completions" and self.drop_completions:
                        writer.transport.abort()  # the server "crashes" mid-request
                        return
                status, payload = self._answer(method, path, body)
                data = json.dumps(payload).encode()
                writer.write(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(data)}\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._conns.discard(writer)
            writer.close()

    def _answer(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        if method == "GET" and path == "/health":
            return (200, {}) if self.healthy else (503, {"detail": "down"})
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "held", "object": "model", "max_model_len": 4096}]}
        if method == "POST" and path == "/v1/completions":
            out = [11, 12, 13]
            return 200, {
                "choices": [
                    {
                        "index": 0,
                        "text": "",
                        "token_ids": out,
                        "logprobs": {"token_logprobs": [-0.5] * len(out)},
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": len(json.loads(body)["prompt"]), "completion_tokens": len(out)},
            }
        return 404, {"detail": "Not Found"}
