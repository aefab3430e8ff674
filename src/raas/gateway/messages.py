"""From an API request to one normal form: chat messages, tool schemas and sampling wishes.

Three wire formats come in (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages); everything
after this module sees one shape, :class:`ChatRequest`, whose messages are plain dicts::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [{"id": str, "name": str, "arguments": dict | str}],   # assistant only, optional
     "tool_call_id": str, "name": str}                                      # tool only, optional

Tools become OpenAI function schemas (what chat templates' ``tools=`` expects). Anything the policy
cannot take (images, audio, built-in server tools, ``n > 1``) is a ``bad_request`` naming the field,
never silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from raas.errors import RaasError

Msg = dict[str, Any]

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")


@dataclass
class ChatRequest:
    """One request in normal form."""

    api: str  # "chat" | "responses" | "messages"
    messages: list[Msg]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"  # "auto" | "none" | "required" | a tool name
    stream: bool = False
    max_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    """What the agent asked for (temperature, top_p, ...); the job's sampling params decide by default."""
    model: str = ""
    include_usage: bool = False
    previous_response_id: str | None = None


def bad(message: str) -> RaasError:
    return RaasError(message, kind="bad_request", stage="run")


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad(f"{what} must be a JSON object")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise bad(f"{what} must be a list")
    return value


def _int_or_none(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad(f"{what} must be a positive integer")
    return value


def _text_parts(content: Any, what: str, kinds: tuple[str, ...]) -> str:
    """A message's text: a string, or text parts of the given types joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(_list(content, what)):
        part = _obj(part, f"{what}[{i}]")
        kind = part.get("type")
        if kind in kinds:
            text = part.get("text")
            if not isinstance(text, str):
                raise bad(f"{what}[{i}].text must be a string")
            texts.append(text)
        else:
            raise bad(f"{what}[{i}] has type {kind!r}: only text reaches this policy")
    return "\n".join(texts)


def _arguments(raw: Any) -> dict[str, Any] | str:
    """Tool-call arguments as a dict (templates render dicts); unparsable JSON stays a string."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw
        return value if isinstance(value, dict) else raw
    if raw is None:
        return {}
    raise bad("tool-call arguments must be a JSON string or object")


def _function_tool(name: Any, description: Any, parameters: Any, what: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise bad(f"{what} needs a name")
    fn: dict[str, Any] = {"name": name}
    if isinstance(description, str):
        fn["description"] = description
    fn["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}


def _choice(value: Any, what: str) -> str:
    """``auto`` | ``none`` | ``required`` | a tool name, from any of the three APIs' spellings."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value in ("auto", "none", "required", "any"):
            return "required" if value == "any" else value
        raise bad(f"{what} {value!r} is not auto, none or required")
    obj = _obj(value, what)
    kind = obj.get("type")
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        return "required"
    fn = obj.get("function") if isinstance(obj.get("function"), dict) else obj
    name = fn.get("name") if isinstance(fn, dict) else None
    if isinstance(name, str) and name:
        return name
    raise bad(f"{what} is not a tool choice this gateway understands")


# -- OpenAI Chat Completions ----------------------------------------------------------------------------


def from_chat(body: dict[str, Any]) -> ChatRequest:
    if body.get("n") not in (None, 1):
        raise bad("n > 1 is not supported: send one request per sample")
    raw_messages = _list(body.get("messages"), "messages")
    if not raw_messages:
        raise bad("messages must not be empty")
    messages = [_chat_message(m, i) for i, m in enumerate(raw_messages)]
    tools = None
    if body.get("tools"):
        tools = []
        for i, t in enumerate(_list(body["tools"], "tools")):
            t = _obj(t, f"tools[{i}]")
            if t.get("type", "function") != "function":
                raise bad(f"tools[{i}] has type {t.get('type')!r}: only function tools are supported")
            fn = _obj(t.get("function"), f"tools[{i}].function")
            tools.append(
                _function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), f"tools[{i}]")
            )
    raw_options = body.get("stream_options")
    options: dict[str, Any] = raw_options if isinstance(raw_options, dict) else {}
    return ChatRequest(
        api="chat",
        messages=messages,
        tools=tools,
        tool_choice=_choice(body.get("tool_choice"), "tool_choice"),
        stream=bool(body.get("stream")),
        max_tokens=_int_or_none(
            body.get("max_completion_tokens", body.get("max_tokens")), "max_completion_tokens"
        ),
        sampling={k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None},
        model=str(body.get("model") or ""),
        include_usage=bool(options.get("include_usage")),
    )


def _chat_message(raw: Any, i: int) -> Msg:
    m = _obj(raw, f"messages[{i}]")
    role = m.get("role")
    where = f"messages[{i}]"
    if role == "developer":
        role = "system"
    if role == "function":  # the legacy shape of a tool result
        return {
            "role": "tool",
            "content": _text_parts(m.get("content"), where, ("text",)),
            "name": m.get("name"),
        }
    if role not in ("system", "user", "assistant", "tool"):
        raise bad(f"{where}.role {role!r} is not system, developer, user, assistant or tool")
    msg: Msg = {
        "role": role,
        "content": _text_parts(m.get("content"), f"{where}.content", ("text", "output_text")),
    }
    if role == "assistant" and m.get("tool_calls"):
        calls = []
        for j, c in enumerate(_list(m["tool_calls"], f"{where}.tool_calls")):
            c = _obj(c, f"{where}.tool_calls[{j}]")
            fn = _obj(c.get("function"), f"{where}.tool_calls[{j}].function")
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                raise bad(f"{where}.tool_calls[{j}].function needs a name")
            calls.append(
                {"id": str(c.get("id") or ""), "name": name, "arguments": _arguments(fn.get("arguments"))}
            )
        msg["tool_calls"] = calls
    if role == "tool":
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
    return msg


# -- OpenAI Responses -------------------------------------------------------------------------------------


def from_responses(body: dict[str, Any], history: list[Msg] | None = None) -> ChatRequest:
    """``history``: the conversation ``previous_response_id`` names (input and output), when given."""
    messages: list[Msg] = list(history or [])
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": instructions}
        else:
            messages.insert(0, {"role": "system", "content": instructions})
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    else:
        for i, item in enumerate(_list(raw, "input")):
            _responses_item(item, i, messages)
    if not messages:
        raise bad("input must not be empty")
    tools = None
    if body.get("tools"):
        tools = []
        for i, t in enumerate(_list(body["tools"], "tools")):
            t = _obj(t, f"tools[{i}]")
            if t.get("type") != "function":
                raise bad(f"tools[{i}] has type {t.get('type')!r}: only function tools are supported")
            tools.append(
                _function_tool(t.get("name"), t.get("description"), t.get("parameters"), f"tools[{i}]")
            )
    prev = body.get("previous_response_id")
    return ChatRequest(
        api="responses",
        messages=messages,
        tools=tools,
        tool_choice=_choice(body.get("tool_choice"), "tool_choice"),
        stream=bool(body.get("stream")),
        max_tokens=_int_or_none(body.get("max_output_tokens"), "max_output_tokens"),
        sampling={k: body[k] for k in SAMPLING_KEYS if body.get(k) is not None},
        model=str(body.get("model") or ""),
        previous_response_id=prev if isinstance(prev, str) else None,
    )


def _responses_item(raw: Any, i: int, out: list[Msg]) -> None:
    item = _obj(raw, f"input[{i}]")
    kind = item.get("type", "message")
    where = f"input[{i}]"
    if kind == "message":
        role = item.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise bad(f"{where}.role {role!r} is not system, developer, user or assistant")
        text = _text_parts(item.get("content"), f"{where}.content", ("input_text", "output_text", "text"))
        if role == "assistant" and out and out[-1]["role"] == "assistant" and not out[-1]["content"]:
            out[-1]["content"] = text  # a message item after its turn's function calls: same turn
            return
        out.append({"role": role, "content": text})
    elif kind == "function_call":
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"{where} (function_call) needs a name")
        call = {
            "id": str(item.get("call_id") or ""),
            "name": name,
            "arguments": _arguments(item.get("arguments")),
        }
        if out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = (
            output
            if isinstance(output, str)
            else _text_parts(output, f"{where}.output", ("input_text", "text"))
        )
        out.append({"role": "tool", "content": text, "tool_call_id": str(item.get("call_id") or "")})
    elif kind == "reasoning":
        return  # the policy's own reasoning is already in its sampled tokens
    else:
        raise bad(f"{where} has type {kind!r}: only messages, function calls and their outputs are supported")


# -- Anthropic Messages -------------------------------------------------------------------------------------


def from_messages(body: dict[str, Any]) -> ChatRequest:
    messages: list[Msg] = []
    system = body.get("system")
    if system:
        messages.append({"role": "system", "content": _text_parts(system, "system", ("text",))})
    raw = _list(body.get("messages"), "messages")
    if not raw:
        raise bad("messages must not be empty")
    for i, m in enumerate(raw):
        _anthropic_message(m, i, messages)
    tools = None
    if body.get("tools"):
        tools = []
        for i, t in enumerate(_list(body["tools"], "tools")):
            t = _obj(t, f"tools[{i}]")
            if t.get("type") not in (None, "custom"):
                raise bad(f"tools[{i}] has type {t.get('type')!r}: only client (custom) tools are supported")
            tools.append(
                _function_tool(t.get("name"), t.get("description"), t.get("input_schema"), f"tools[{i}]")
            )
    max_tokens = _int_or_none(body.get("max_tokens"), "max_tokens")
    if max_tokens is None:
        raise bad("max_tokens is required")
    return ChatRequest(
        api="messages",
        messages=messages,
        tools=tools,
        tool_choice=_choice(body.get("tool_choice"), "tool_choice"),
        stream=bool(body.get("stream")),
        max_tokens=max_tokens,
        sampling={k: body[k] for k in ("temperature", "top_p", "top_k") if body.get(k) is not None},
        model=str(body.get("model") or ""),
    )


def _anthropic_message(raw: Any, i: int, out: list[Msg]) -> None:
    m = _obj(raw, f"messages[{i}]")
    role = m.get("role")
    where = f"messages[{i}]"
    if role not in ("user", "assistant"):
        raise bad(f"{where}.role {role!r} is not user or assistant")
    content = m.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_list(content, f"{where}.content")):
        block = _obj(block, f"{where}.content[{j}]")
        kind = block.get("type")
        at = f"{where}.content[{j}]"
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise bad(f"{at}.text must be a string")
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str):
                raise bad(f"{at} (tool_use) needs a name")
            calls.append(
                {
                    "id": str(block.get("id") or ""),
                    "name": block["name"],
                    "arguments": _arguments(block.get("input")),
                }
            )
        elif kind == "tool_result" and role == "user":
            result = _text_parts(block.get("content"), f"{at}.content", ("text",))
            if block.get("is_error"):
                result = result or "error"
            out.append(
                {"role": "tool", "content": result, "tool_call_id": str(block.get("tool_use_id") or "")}
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # the policy's own reasoning is already in its sampled tokens
        else:
            raise bad(f"{at} has type {kind!r}: not supported in a {role} message")
    if role == "assistant":
        msg: Msg = {"role": "assistant", "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts:
        out.append({"role": "user", "content": "\n".join(texts)})


# -- comparing and rendering -----------------------------------------------------------------------------------


MessageKey = tuple[str, str, str, str]


def message_key(msg: Msg) -> MessageKey:
    """What decides whether two messages are the same turn: role, text, tool calls (name and arguments;
    the call ids are ours and clients may rewrite them), and for tool results the call they answer.
    A tuple, cheap to build for every message of every request (histories are re-sent each turn)."""
    calls = msg.get("tool_calls")
    written = json.dumps([[c["name"], c["arguments"]] for c in calls], sort_keys=True) if calls else ""
    answered = (msg.get("tool_call_id") or "") if msg["role"] == "tool" else ""
    return (msg["role"], msg.get("content") or "", written, answered)


def tools_key(tools: list[dict[str, Any]] | None) -> str:
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


def hermes_call(name: str, arguments: dict[str, Any] | str) -> str:
    """A tool call written the way the Hermes format (raas's default for templates without tools) has it."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return (
        f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'
    )


def template_message(msg: Msg, native_tools: bool) -> Msg:
    """The message as the chat template takes it. A template with tool support gets ``tool_calls`` in the
    Hugging Face shape; one without (raas injects the Hermes format into its system prompt) gets the calls
    written into the content as the model would have written them."""
    out: Msg = {"role": msg["role"], "content": msg.get("content") or ""}
    calls = msg.get("tool_calls") or []
    if calls:
        if native_tools:
            out["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ]
        else:
            written = "\n".join(hermes_call(c["name"], c["arguments"]) for c in calls)
            out["content"] = f"{out['content']}\n{written}" if out["content"] else written
    if msg.get("tool_call_id"):
        out["tool_call_id"] = msg["tool_call_id"]
    if msg.get("name"):
        out["name"] = msg["name"]
    return out
