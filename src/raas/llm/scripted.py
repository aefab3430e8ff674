"""A scripted inference server: it speaks the real vLLM OpenAI-server wire protocol and answers from a
script instead of a model.

Why: a dry run of a task (``raas run --policy replay``: a dataset's known patches played through the
real pipeline, sandboxes and EVAL), reward plumbing tests and benchmarks need a policy whose answers and
speed are known in advance. This is a real HTTP server on a real socket (uvicorn), so raas's LLM clients
talk to it exactly as they talk to vLLM:

* ``GET /health`` → 200; ``GET /version`` → ``{"version": ...}``;
* ``GET /v1/models`` → ``{"data": [{"id", "object": "model", "owned_by": "vllm", "max_model_len"}]}``;
* ``POST /v1/completions`` with ``prompt`` as a list of token IDs (``logprobs``, ``return_token_ids``,
  ``max_tokens`` …) → ``choices[0].{text, token_ids, prompt_token_ids, logprobs.{tokens, token_logprobs},
  finish_reason}`` and ``usage``. A string prompt is answered too (``prompt_token_ids`` is then empty).
  With ``stream: true`` the same answer comes as vLLM's stream: one ``data:`` event with the whole
  choice (vLLM sends one per decode step; a scripted answer has no steps), a ``usage`` event when
  ``stream_options.include_usage`` asks for it, then ``data: [DONE]``.

What it answers comes from a *responder*, a function of the request:

* :func:`replay` — a fixed sequence of completions, one per request (e.g. a tool call, then
  ``finish(answer=...)``); with ``cycle=True`` it starts over, otherwise an exhausted script answers 500.
* :func:`fixed` — ``n`` copies of one token (benchmarks).
* any ``Callable[[CompletionRequest], Completion]`` (e.g. keyed on the prompt).

Text is turned into IDs by the ``encode`` function you pass (normally the policy tokenizer's ``encode``),
so the IDs are exactly what that tokenizer would produce.

Capacity model (for the decoupling benchmark): ``capacity`` concurrent sequences (like a GPU's batch
slots) and ``tokens_per_s`` decode speed per sequence; a request holds one slot for
``prefill_s + len(tokens) / tokens_per_s`` seconds and waits for a free slot first. :meth:`ScriptedLLM.stats`
reports slot utilization (busy slot-seconds / (capacity * wall seconds)) since the last :meth:`reset_stats`.

Usage::

    async with ScriptedLLM(replay([Completion.of_text("hi", encode=tok.encode)])) as llm:
        balancer.add(llm.url)

or, from synchronous code / another loop, ``with ScriptedLLM(...).in_thread() as llm: ...``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_NAME = "scripted-policy"


@dataclass
class CompletionRequest:
    """The parts of a ``/v1/completions`` body a responder needs."""

    prompt_ids: list[int]
    prompt_text: str | None
    max_tokens: int | None
    body: dict[str, Any]
    index: int
    """0-based number of this request since the server started."""


@dataclass
class Completion:
    """One scripted answer."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str = "stop"
    text: str = ""

    @classmethod
    def of_text(
        cls,
        text: str,
        *,
        encode: Callable[[str], Sequence[int]],
        finish_reason: str = "stop",
        eos_id: int | None = None,
    ) -> Completion:
        """A completion whose IDs are ``encode(text)`` (plus ``eos_id`` when given)."""
        ids = [int(t) for t in encode(text)]
        if eos_id is not None:
            ids.append(eos_id)
        return cls(token_ids=ids, finish_reason=finish_reason, text=text)


Responder = Callable[[CompletionRequest], Completion]


def replay(completions: Sequence[Completion], *, cycle: bool = False) -> Responder:
    """Answer the i-th request with ``completions[i]``."""
    items = list(completions)
    if not items:
        raise ValueError("replay needs at least one completion")
    source: Iterator[Completion] = itertools.cycle(items) if cycle else iter(items)
    lock = threading.Lock()

    def respond(req: CompletionRequest) -> Completion:
        with lock:
            try:
                return next(source)
            except StopIteration:
                raise RuntimeError(f"script exhausted after {len(items)} completions") from None

    return respond


def fixed(n_tokens: int, token_id: int = 42, logprob: float = -0.25) -> Responder:
    """``min(n_tokens, max_tokens)`` copies of ``token_id``; finish ``length`` when cut by max_tokens."""

    def respond(req: CompletionRequest) -> Completion:
        n = n_tokens if req.max_tokens is None else min(n_tokens, req.max_tokens)
        return Completion(
            token_ids=[token_id] * n,
            logprobs=[logprob] * n,
            finish_reason="length" if n < n_tokens else "stop",
        )

    return respond


async def _stream_events(answer: dict[str, Any], body: dict[str, Any]) -> AsyncIterator[str]:
    """``answer`` as vLLM's ``/v1/completions`` stream (see the module docstring)."""
    usage = answer.pop("usage")
    yield f"data: {json.dumps(answer)}\n\n"
    if (body.get("stream_options") or {}).get("include_usage"):
        yield f"data: {json.dumps({**answer, 'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


class _QuietServer(uvicorn.Server):
    """uvicorn without signal handlers: the program that starts the server (a CLI run, a test) owns
    SIGINT/SIGTERM and stops it on its way out."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class _Stats:
    started: float = field(default_factory=time.monotonic)
    requests: int = 0
    tokens: int = 0
    busy_slot_s: float = 0.0
    active: int = 0
    last_change: float = field(default_factory=time.monotonic)
    max_active: int = 0


class ScriptedLLM:
    """See the module docstring."""

    def __init__(
        self,
        responder: Responder,
        *,
        capacity: int | None = None,
        tokens_per_s: float | None = None,
        prefill_s: float = 0.0,
        max_model_len: int = 32768,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.responder = responder
        self.capacity = capacity
        self.tokens_per_s = tokens_per_s
        self.prefill_s = prefill_s
        self.max_model_len = max_model_len
        self.host = host
        self.port = port
        self.requests: list[CompletionRequest] = []
        self._counter = itertools.count()
        self._stats = _Stats()
        self._slots: asyncio.Semaphore | None = None
        self._server: uvicorn.Server | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self.app = self._build_app()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- the HTTP app ------------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="scripted vLLM-protocol policy")

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {}

        @app.get("/_scripted/stats")
        async def scripted_stats() -> dict[str, float]:
            """Not part of vLLM: lets a benchmark in another process read :meth:`stats`."""
            return self.stats()

        @app.post("/_scripted/reset")
        async def scripted_reset() -> dict[str, float]:
            self.reset_stats()
            return self.stats()

        @app.get("/version")
        async def version() -> dict[str, str]:
            return {"version": "0.0.0-scripted"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {
                "object": "list",
                "data": [
                    {
                        "id": MODEL_NAME,
                        "object": "model",
                        "owned_by": "vllm",
                        "root": MODEL_NAME,
                        "max_model_len": self.max_model_len,
                    }
                ],
            }

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            try:
                body = await request.json()
            except ValueError:
                return JSONResponse(
                    {"error": {"message": "body is not JSON", "type": "BadRequestError"}}, 400
                )
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                prompt_ids, prompt_text = list(prompt), None
            elif isinstance(prompt, str):
                prompt_ids, prompt_text = [], prompt
            else:
                return JSONResponse(
                    {
                        "error": {
                            "message": "prompt must be a string or a list of token IDs",
                            "type": "BadRequestError",
                        }
                    },
                    400,
                )
            if len(prompt_ids) >= self.max_model_len:
                return JSONResponse(
                    {
                        "error": {
                            "message": f"This model's maximum context length is {self.max_model_len} tokens.",
                            "type": "BadRequestError",
                        }
                    },
                    400,
                )
            req = CompletionRequest(
                prompt_ids=prompt_ids,
                prompt_text=prompt_text,
                max_tokens=body.get("max_tokens"),
                body=body,
                index=next(self._counter),
            )
            self.requests.append(req)
            try:
                out = self.responder(req)
            except Exception as exc:
                return JSONResponse({"error": {"message": str(exc), "type": "InternalServerError"}}, 500)
            await self._occupy(len(out.token_ids))
            answer = self._render(req, out)
            if body.get("stream"):
                return StreamingResponse(_stream_events(answer, body), media_type="text/event-stream")
            return JSONResponse(answer)

        return app

    def _render(self, req: CompletionRequest, out: Completion) -> dict[str, Any]:
        logprobs = out.logprobs if out.logprobs is not None else [-0.1] * len(out.token_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "stop_reason": None,
            "token_ids": list(out.token_ids),
            "prompt_token_ids": list(req.prompt_ids) if req.body.get("return_token_ids") else None,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in out.token_ids],
                "token_logprobs": list(logprobs),
                "top_logprobs": None,
                "text_offset": [0] * len(out.token_ids),
            },
        }
        return {
            "id": f"cmpl-scripted-{req.index}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": MODEL_NAME,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": len(out.token_ids),
                "total_tokens": len(req.prompt_ids) + len(out.token_ids),
            },
        }

    async def _occupy(self, n_tokens: int) -> None:
        """Hold one of ``capacity`` slots for the time the modelled accelerator would need."""
        hold = self.prefill_s + (n_tokens / self.tokens_per_s if self.tokens_per_s else 0.0)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.capacity) if self.capacity else None
        if self._slots is not None:
            await self._slots.acquire()
        self._slot_change(+1)
        try:
            if hold > 0:
                await asyncio.sleep(hold)
        finally:
            self._slot_change(-1)
            self._stats.requests += 1
            self._stats.tokens += n_tokens
            if self._slots is not None:
                self._slots.release()

    def _slot_change(self, delta: int) -> None:
        s = self._stats
        now = time.monotonic()
        s.busy_slot_s += s.active * (now - s.last_change)
        s.last_change = now
        s.active += delta
        s.max_active = max(s.max_active, s.active)

    # -- statistics --------------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        active = self._stats.active
        self._stats = _Stats(active=active)

    def stats(self) -> dict[str, float]:
        """Requests, tokens and slot utilization since the last reset."""
        self._slot_change(0)
        s = self._stats
        wall = max(time.monotonic() - s.started, 1e-9)
        cap = self.capacity or max(s.max_active, 1)
        return {
            "requests": s.requests,
            "tokens": s.tokens,
            "wall_s": wall,
            "busy_slot_s": s.busy_slot_s,
            "utilization": s.busy_slot_s / (cap * wall),
            "max_active": s.max_active,
        }

    # -- running it --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind (port 0 picks a free port) and serve in the running event loop."""
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and an
        # accepted socket inherits it; with proto 0 every response waits ~40 ms for a delayed ACK.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((self.host, self.port))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="off", access_log=False, timeout_keep_alive=30
        )
        self._server = _QuietServer(config)
        self._serve_task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._serve_task.done():
                self._serve_task.result()
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._server is not None and self._serve_task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._serve_task
        if self._sock is not None:
            self._sock.close()
        self._server = self._serve_task = self._sock = None

    async def __aenter__(self) -> ScriptedLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @contextlib.contextmanager
    def in_thread(self) -> Iterator[ScriptedLLM]:
        """Serve from a private event loop on a background thread (for sync code or other loops)."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        errors: list[BaseException] = []

        def main() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start())
            except BaseException as exc:
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()

        thread = threading.Thread(target=main, name="scripted-llm", daemon=True)
        thread.start()
        ready.wait()
        if errors:
            thread.join()
            loop.close()
            raise errors[0]
        try:
            yield self
        finally:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(timeout=30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m raas.llm.scripted --port P --tokens N [--capacity C --tokens-per-s R]``: serve
    :func:`fixed` completions from a process of its own (benchmarks), until SIGINT/SIGTERM."""
    import argparse
    import signal

    p = argparse.ArgumentParser(prog="python -m raas.llm.scripted")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=8, help="tokens per completion")
    p.add_argument("--capacity", type=int)
    p.add_argument("--tokens-per-s", type=float)
    p.add_argument("--prefill-s", type=float, default=0.0)
    args = p.parse_args(argv)

    async def run() -> None:
        llm = ScriptedLLM(
            fixed(args.tokens),
            capacity=args.capacity,
            tokens_per_s=args.tokens_per_s,
            prefill_s=args.prefill_s,
            host=args.host,
            port=args.port,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with llm:
            print(f"SCRIPTED_LLM_READY {llm.url}", flush=True)
            await stop.wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
