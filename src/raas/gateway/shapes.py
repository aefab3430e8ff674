"""A completion in each API's response shape, whole or as Server-Sent Events, and each API's errors.

Streams are real SSE: the same events, in the same order, that the OpenAI and Anthropic servers send
(``data: {chunk}`` lines ending in ``data: [DONE]`` for Chat Completions; ``event: <type>`` +
``data: {...}`` for Responses and Messages). Streams are written as the
reply is generated (:class:`ChatChunks`, :class:`ResponseEvents`, :class:`MessageEvents`; see
:mod:`raas.gateway.streaming`); a stream whose inference server cannot stream follows once the reply is done.
While a request waits (e.g. the balancer is paused for a weight sync) an SSE comment keeps the connection
alive.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from raas.errors import RaasError
from raas.gateway.messages import ChatRequest
from raas.gateway.session import Completion, TurnLimit

KEEPALIVE = ": keep-alive\n\n"
TEXT_CHUNK = 24  # characters per streamed text delta


def _pieces(text: str) -> list[str]:
    return [text[i : i + TEXT_CHUNK] for i in range(0, len(text), TEXT_CHUNK)]


def _args_json(call: dict[str, Any]) -> str:
    return json.dumps(call["arguments"], ensure_ascii=False)


def _sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _rid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# -- OpenAI Chat Completions -------------------------------------------------------------------------------


def chat_body(c: Completion, req: ChatRequest, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": c.content if (c.content or not c.tool_calls) else None,
    }
    if c.tool_calls:
        message["tool_calls"] = [
            {"id": t["id"], "type": "function", "function": {"name": t["name"], "arguments": _args_json(t)}}
            for t in c.tool_calls
        ]
    return {
        "id": _rid("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model or model,
        "choices": [{"index": 0, "message": message, "finish_reason": c.finish, "logprobs": None}],
        "usage": _chat_usage(c),
        "system_fingerprint": None,
    }


def _chat_usage(c: Completion) -> dict[str, Any]:
    return {
        "prompt_tokens": c.prompt_tokens,
        "completion_tokens": c.completion_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    }


class ChatChunks:
    """One Chat Completions stream, written as the reply arrives: :meth:`head`, :meth:`text` per piece of
    text, :meth:`end` with the finished completion (tool calls, finish reason, usage, ``[DONE]``)."""

    def __init__(self, req: ChatRequest, model: str) -> None:
        self.req = req
        self.rid, self.created, self.name = _rid("chatcmpl"), int(time.time()), req.model or model

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return _sse(self._frame([choice]))

    def _frame(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.name,
            "choices": choices,
        }

    def head(self, prompt_tokens: int = 0) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, piece: str) -> list[str]:
        return [self._chunk({"content": piece})]

    def end(self, c: Completion) -> list[str]:
        out = []
        for i, t in enumerate(c.tool_calls):
            head = {
                "index": i,
                "id": t["id"],
                "type": "function",
                "function": {"name": t["name"], "arguments": ""},
            }
            out.append(self._chunk({"tool_calls": [head]}))
            for piece in _pieces(_args_json(t)):
                out.append(self._chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
        out.append(self._chunk({}, c.finish))
        if self.req.include_usage:
            out.append(_sse({**self._frame([]), "usage": _chat_usage(c)}))
        out.append("data: [DONE]\n\n")
        return out


# -- OpenAI Responses ----------------------------------------------------------------------------------------


def responses_body(c: Completion, req: ChatRequest, model: str, response_id: str) -> dict[str, Any]:
    return {**_response_frame(req, model, response_id, "completed"), **_response_result(c)}


def _response_frame(req: ChatRequest, model: str, response_id: str, status: str) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": req.model or model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "parallel_tool_calls": True,
        "temperature": req.sampling.get("temperature"),
        "top_p": req.sampling.get("top_p"),
        "tool_choice": req.tool_choice if req.tool_choice in ("auto", "none", "required") else "auto",
        "tools": [{"type": "function", **t["function"], "strict": False} for t in (req.tools or [])],
        "previous_response_id": req.previous_response_id,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": None,
    }


def _output_items(c: Completion) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if c.content or not c.tool_calls:
        items.append(
            {
                "type": "message",
                "id": _rid("msg"),
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": c.content, "annotations": [], "logprobs": []}],
            }
        )
    for t in c.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": _rid("fc"),
                "call_id": t["id"],
                "name": t["name"],
                "arguments": _args_json(t),
                "status": "completed",
            }
        )
    return items


def _response_result(c: Completion, items: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    incomplete = c.finish == "length"
    return {
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": items if items is not None else _output_items(c),
        "usage": {
            "input_tokens": c.prompt_tokens,
            "input_tokens_details": {"cached_tokens": c.cached_tokens},
            "output_tokens": c.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.prompt_tokens + c.completion_tokens,
        },
    }


class ResponseEvents:
    """One Responses stream, written as the reply arrives (see :class:`ChatChunks`): the message item opens
    with the first piece of text; function calls follow at the end."""

    def __init__(self, req: ChatRequest, model: str, response_id: str) -> None:
        self.req, self.model, self.response_id = req, model, response_id
        self.seq = 0
        self.item_id = _rid("msg")
        self.text_open = False
        self.part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}

    def _event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        return _sse({"type": kind, "sequence_number": self.seq - 1, **data}, kind)

    def head(self, prompt_tokens: int = 0) -> list[str]:
        frame = _response_frame(self.req, self.model, self.response_id, "in_progress")
        return [
            self._event("response.created", response=frame),
            self._event("response.in_progress", response=frame),
        ]

    def _open_text(self) -> list[str]:
        self.text_open = True
        item = {
            "type": "message",
            "id": self.item_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event(
                "response.content_part.added",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                part=self.part,
            ),
        ]

    def text(self, piece: str) -> list[str]:
        out = [] if self.text_open else self._open_text()
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=self.item_id,
                output_index=0,
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        )
        return out

    def end(self, c: Completion) -> list[str]:
        items = _output_items(c)
        if self.text_open and not (items and items[0]["type"] == "message"):  # text went out: its item stays
            message = {"type": "message", "id": self.item_id, "status": "completed", "role": "assistant"}
            items.insert(0, {**message, "content": [{**self.part, "text": c.content}]})
        out: list[str] = []
        if items and items[0]["type"] == "message":
            items[0]["id"] = self.item_id
            if not self.text_open:
                out += self._open_text()
            text = items[0]["content"][0]["text"]
            where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
            out.append(self._event("response.output_text.done", **where, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", **where, part={**self.part, "text": text}))
            out.append(self._event("response.output_item.done", output_index=0, item=items[0]))
        for index, item in enumerate(items):
            if item["type"] == "message":
                continue
            out.append(
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""},
                )
            )
            for piece in _pieces(item["arguments"]):
                out.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=piece,
                    )
                )
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        done = {
            **_response_frame(self.req, self.model, self.response_id, "completed"),
            **_response_result(c, items),
        }
        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, response=done))
        return out


# -- Anthropic Messages -------------------------------------------------------------------------------------


def _stop_reason(c: Completion) -> str:
    if c.tool_calls:
        return "tool_use"
    return "max_tokens" if c.finish == "length" else "end_turn"


def messages_body(c: Completion, req: ChatRequest, model: str) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if c.content or not c.tool_calls:
        content.append({"type": "text", "text": c.content})
    for t in c.tool_calls:
        content.append({"type": "tool_use", "id": t["id"], "name": t["name"], "input": t["arguments"]})
    return {
        "id": _rid("msg"),
        "type": "message",
        "role": "assistant",
        "model": req.model or model,
        "content": content,
        "stop_reason": _stop_reason(c),
        "stop_sequence": None,
        "usage": {
            "input_tokens": c.prompt_tokens,
            "output_tokens": c.completion_tokens,
            "cache_read_input_tokens": c.cached_tokens,
            "cache_creation_input_tokens": 0,
        },
    }


class MessageEvents:
    """One Anthropic Messages stream, written as the reply arrives (see :class:`ChatChunks`): the text
    block opens with the first piece of text; tool-use blocks follow at the end."""

    def __init__(self, req: ChatRequest, model: str) -> None:
        self.req, self.model = req, model
        self.id = _rid("msg")
        self.index = 0
        self.text_open = False

    def head(self, prompt_tokens: int = 0, cached_tokens: int = 0) -> list[str]:
        start: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.req.model or self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt_tokens,
                "output_tokens": 0,
                "cache_read_input_tokens": cached_tokens,
                "cache_creation_input_tokens": 0,
            },
        }
        return [_sse({"type": "message_start", "message": start}, "message_start")]

    def _open_text(self) -> list[str]:
        self.text_open = True
        block = {
            "type": "content_block_start",
            "index": self.index,
            "content_block": {"type": "text", "text": ""},
        }
        return [_sse(block, "content_block_start")]

    def text(self, piece: str) -> list[str]:
        out = [] if self.text_open else self._open_text()
        delta = {"type": "text_delta", "text": piece}
        out.append(
            _sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta")
        )
        return out

    def end(self, c: Completion) -> list[str]:
        out = []
        if not self.text_open and not c.tool_calls:
            out += self._open_text()  # an empty reply is one empty text block
        if self.text_open:
            out.append(_sse({"type": "content_block_stop", "index": self.index}, "content_block_stop"))
            self.index += 1
        for t in c.tool_calls:
            head = {"type": "tool_use", "id": t["id"], "name": t["name"], "input": {}}
            out.append(
                _sse(
                    {"type": "content_block_start", "index": self.index, "content_block": head},
                    "content_block_start",
                )
            )
            for piece in _pieces(json.dumps(t["arguments"], ensure_ascii=False)):
                delta = {"type": "input_json_delta", "partial_json": piece}
                out.append(
                    _sse(
                        {"type": "content_block_delta", "index": self.index, "delta": delta},
                        "content_block_delta",
                    )
                )
            out.append(_sse({"type": "content_block_stop", "index": self.index}, "content_block_stop"))
            self.index += 1
        end: dict[str, Any] = {
            "type": "message_delta",
            "delta": {"stop_reason": _stop_reason(c), "stop_sequence": None},
        }
        out.append(_sse({**end, "usage": {"output_tokens": c.completion_tokens}}, "message_delta"))
        out.append(_sse({"type": "message_stop"}, "message_stop"))
        return out


# -- errors ----------------------------------------------------------------------------------------------------

# kind -> (HTTP status, OpenAI error type, Anthropic error type)
_ERRORS: dict[str, tuple[int, str, str]] = {
    "bad_request": (400, "invalid_request_error", "invalid_request_error"),
    "context_window_exceeded": (400, "invalid_request_error", "invalid_request_error"),
    "unauthorized": (401, "authentication_error", "authentication_error"),
    "not_found": (404, "not_found_error", "not_found_error"),
    "payload_too_large": (413, "invalid_request_error", "request_too_large"),
    "llm_unavailable": (503, "server_error", "overloaded_error"),
    "unavailable": (503, "server_error", "overloaded_error"),
    "llm_timeout": (504, "server_error", "api_error"),
    "llm_error": (502, "server_error", "api_error"),
}


def error_status(exc: RaasError) -> int:
    return _ERRORS.get(exc.kind, (500, "server_error", "api_error"))[0]


def error_body(api: str, exc: RaasError) -> dict[str, Any]:
    status, openai_type, anthropic_type = _ERRORS.get(exc.kind, (500, "server_error", "api_error"))
    # The raas API's fields (``detail``; ``error.kind``, ``error.stage``) ride along with each SDK's own.
    typed = {"kind": exc.kind, "stage": exc.stage or "run"}
    if api == "messages":
        return {
            "type": "error",
            "error": {"type": anthropic_type, "message": exc.message, **typed},
            "detail": exc.message,
        }
    code: str | None = None
    if exc.kind == "context_window_exceeded":
        code = "context_length_exceeded"
    elif isinstance(exc, TurnLimit):
        code = "turn_limit"
    elif status >= 500:
        code = exc.kind
    return {
        "error": {"message": exc.message, "type": openai_type, "param": None, "code": code, **typed},
        "detail": exc.message,
    }


def error_event(api: str, exc: RaasError) -> str:
    """An error after the stream's headers went out (it is answered in the stream, in the API's form)."""
    body = error_body(api, exc)
    if api == "messages":
        return _sse(body, "error")
    if api == "responses":
        return _sse(
            {"type": "error", "code": body["error"]["code"], "message": exc.message, "sequence_number": 0},
            "error",
        )
    return _sse(body)
