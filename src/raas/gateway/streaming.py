"""Incremental streaming: a Chat Completions, Responses or Messages reply forwarded to the agent as the
inference server generates it, while the session records the turn's exact token IDs as for any request.

What reaches the agent while the reply is generated is its text. Tool calls are read from the finished
text (:func:`raas.agent.toolcalls.parse_tool_calls`, as for a request that does not stream), so for a
request that offers tools the text is forwarded only up to where a tool call could begin (the first
``<``, ``{``, ``[`` or backquote) and without trailing whitespace (the parser strips it); the rest of the
reply's content and its tool calls follow when the generation is done. The agent thus sees exactly the
content and tool calls a non-streaming request would have returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from raas.errors import RaasError
from raas.gateway import shapes
from raas.gateway.messages import ChatRequest
from raas.gateway.session import Completion, TextStream

CALL_START = ("<", "{", "[", "`")
log = logging.getLogger("raas.gateway")


class HeldText:
    """The part of the reply's text that may go out now (see the module docstring)."""

    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self.text = ""
        self.sent = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.stopped:
            return ""
        safe = self.text
        if self.tools:
            cut = min((i for i in (self.text.find(c) for c in CALL_START) if i >= 0), default=-1)
            if cut >= 0:
                safe = self.text[:cut]
                self.stopped = True
            safe = safe.rstrip()
        out = safe[len(self.sent) :] if safe.startswith(self.sent) else ""
        self.sent += out
        return out

    def rest(self, c: Completion) -> str:
        """The completion's content not sent yet ('' where it does not extend what was sent)."""
        return c.content[len(self.sent) :] if c.content.startswith(self.sent) else ""


Writer = shapes.ChatChunks | shapes.ResponseEvents | shapes.MessageEvents


def writer(req: ChatRequest, model: str, response_id: str) -> Writer:
    if req.api == "chat":
        return shapes.ChatChunks(req, model)
    if req.api == "responses":
        return shapes.ResponseEvents(req, model, response_id)
    return shapes.MessageEvents(req, model)


async def incremental(
    task: asyncio.Task[Completion],
    stream: TextStream,
    req: ChatRequest,
    w: Writer,
    keepalive_s: float,
    on_done: Callable[[Completion], None] | None = None,
) -> AsyncIterator[str]:
    """The SSE events of ``task``'s reply, written by ``w`` as ``stream`` receives its text; ``on_done``
    sees the completion before its last events. If the client leaves (the response is cancelled), the
    request is cancelled with it and nothing is recorded."""
    try:
        held = HeldText(bool(req.tools) and req.tool_choice != "none")
        for event in w.head(stream.prompt_tokens):
            yield event
        while True:
            get = asyncio.ensure_future(stream.pieces.get())
            done, _ = await asyncio.wait(
                {get, task}, timeout=keepalive_s, return_when=asyncio.FIRST_COMPLETED
            )
            if get in done:
                out = held.feed(get.result())
                if out:
                    for event in w.text(out):
                        yield event
                continue
            get.cancel()
            if task in done:
                break
            yield shapes.KEEPALIVE
        while not stream.pieces.empty():
            held.feed(stream.pieces.get_nowait())
        try:
            completion = task.result()
        except RaasError as exc:
            yield shapes.error_event(req.api, exc)
            return
        except Exception as exc:  # a bug of raas's own: an error event, not a broken connection
            log.exception("gateway stream failed")
            error = RaasError(f"internal gateway error: {type(exc).__name__}: {exc}", kind="internal")
            yield shapes.error_event(req.api, error)
            return
        if on_done is not None:
            on_done(completion)
        rest = held.rest(completion)
        if rest:
            for event in w.text(rest):
                yield event
        for event in w.end(completion):
            yield event
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
