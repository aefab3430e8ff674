"""Read tool calls out of a model's sampled text.

Formats, detected from the text:

* Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (any number per turn), and
  inside the same tags Qwen3-Coder's XML body ``<function=NAME><parameter=KEY>VALUE</parameter></function>``;
* Llama 3.1 custom functions ``<function=NAME>{...json args...}</function>``;
* a plain JSON function call: the whole reply is ``{"name", "arguments"|"parameters"}``, a list of them
  (Llama 3.x's JSON tool calling, also after its ``<|python_tag|>`` marker and ``;``-separated), or the
  OpenAI ``{"function": {...}}`` shape, optionally in a fenced block.

Parsing never
raises: a malformed call becomes an error observation the agent sees on its next turn, and is counted,
because a policy that emits broken calls must be told (and rewarded) accordingly, not crash the rollout.
The sampled token IDs are never rewritten; this only reads the text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from raas.core.metrics import TOOL_CALLS as TOOL_CALLS  # re-exported: counted on the served registry
from raas.core.metrics import count_tool_call

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*\n(.*?)\n?```$", re.DOTALL)
_XML_FUNCTION = re.compile(r"^<function=([^>\s]+)>(.*?)(?:</function>)?$", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)
_LLAMA_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"

FORMAT_HINT = (
    'Call a tool as <tool_call>{"name": "<tool name>", "arguments": {<arguments as JSON>}}</tool_call>.'
)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:12]}")
    raw: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


@dataclass
class ParsedOutput:
    """Calls found in one assistant message, the text around them, and what was malformed."""

    calls: list[ToolCall]
    content: str
    errors: list[str]
    format: str  # "hermes" | "qwen_xml" | "llama" | "json" | "none"

    @property
    def malformed(self) -> bool:
        return bool(self.errors)

    def error_observation(self) -> str | None:
        """What to tell the agent when a call could not be read (``None`` when all were fine)."""
        if not self.errors:
            return None
        return "Error: " + "; ".join(self.errors) + ". " + FORMAT_HINT


@dataclass
class ToolCallStats:
    """Per-rollout counts (the Prometheus counter carries the process-wide totals)."""

    parsed: int = 0
    malformed: int = 0
    unknown_tool: int = 0

    def add(self, result: ParsedOutput) -> None:
        self.parsed += len(result.calls)
        self.malformed += sum(1 for e in result.errors if "unknown tool" not in e)
        self.unknown_tool += sum(1 for e in result.errors if "unknown tool" in e)


def _call_from_obj(obj: Any, raw: str, allowed: set[str] | None) -> ToolCall | str:
    """A ToolCall, or an error message saying what is wrong with ``obj``."""
    if not isinstance(obj, dict):
        return f"tool call is a JSON {type(obj).__name__}, not an object"
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'tool call has no "name"'
    args: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f"arguments of {name!r} are not valid JSON ({exc.msg})"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"arguments of {name!r} must be a JSON object"
    if allowed is not None and name not in allowed:
        return f"unknown tool {name!r} (available: {', '.join(sorted(allowed))})"
    return ToolCall(name=name, arguments=args, raw=raw)


def _xml_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A Qwen3-Coder parameter value: its text (one newline trimmed at each end), as JSON when the tool's
    schema says the parameter is not a string."""
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    kind = (schema or {}).get("type")
    if kind is None or kind == "string":
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _parse_xml_call(body: str, raw: str, allowed: set[str] | None, schemas: dict[str, Any]) -> ToolCall | str:
    match = _XML_FUNCTION.match(body)
    if match is None:
        return "tool call is neither JSON nor <function=...> XML"
    name = match.group(1)
    params = schemas.get(name, {}).get("properties", {}) if isinstance(schemas.get(name), dict) else {}
    args = {k: _xml_value(v, params.get(k)) for k, v in _XML_PARAMETER.findall(match.group(2))}
    return _call_from_obj({"name": name, "arguments": args}, raw, allowed)


def _parse_hermes(text: str, allowed: set[str] | None, schemas: dict[str, Any] | None = None) -> ParsedOutput:
    calls: list[ToolCall] = []
    errors: list[str] = []
    xml = False
    for i, match in enumerate(_HERMES.finditer(text)):
        body = match.group(1).strip()
        closed = match.group(0).endswith("</tool_call>")
        if body.startswith("<function="):
            xml = True
            got: ToolCall | str = _parse_xml_call(body, match.group(0), allowed, schemas or {})
            if isinstance(got, str):
                errors.append(f"tool call {i + 1}: {got}")
            else:
                calls.append(got)
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            hint = "" if closed else " and is not closed with </tool_call>"
            errors.append(f"tool call {i + 1} is not valid JSON ({exc.msg}){hint}")
            continue
        got = _call_from_obj(obj, match.group(0), allowed)
        if isinstance(got, str):
            errors.append(f"tool call {i + 1}: {got}")
        else:
            calls.append(got)
    content = _HERMES.sub("", text).strip()
    return ParsedOutput(calls, content, errors, "qwen_xml" if xml else "hermes")


def _parse_llama_functions(text: str, allowed: set[str] | None) -> ParsedOutput:
    """Llama 3.1's ``<function=NAME>{args}</function>`` calls."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, match in enumerate(_LLAMA_FUNCTION.finditer(text)):
        name, body = match.group(1), match.group(2).strip()
        try:
            args = json.loads(body) if body else {}
        except json.JSONDecodeError as exc:
            errors.append(f"tool call {i + 1}: arguments of {name!r} are not valid JSON ({exc.msg})")
            continue
        got = _call_from_obj({"name": name, "arguments": args}, match.group(0), allowed)
        if isinstance(got, str):
            errors.append(f"tool call {i + 1}: {got}")
        else:
            calls.append(got)
    content = _LLAMA_FUNCTION.sub("", text).strip()
    return ParsedOutput(calls, content, errors, "llama")


def _parse_python_tag(text: str, allowed: set[str] | None) -> ParsedOutput:
    """Llama 3.x JSON calls after ``<|python_tag|>``, possibly several separated by ``;``."""
    head, _, body = text.partition(PYTHON_TAG)
    parts = [p.strip() for p in body.split(";") if p.strip()] if body.strip() else []
    calls: list[ToolCall] = []
    errors: list[str] = []
    for part in parts:
        got = _parse_json(part, allowed)
        if got is None:
            errors.append("text after <|python_tag|> is not a JSON function call")
            continue
        calls.extend(got.calls)
        errors.extend(got.errors)
    if not parts:
        errors.append("<|python_tag|> is followed by no function call")
    return ParsedOutput(calls, head.strip(), errors, "llama")


def _looks_like_call(text: str) -> bool:
    return '"name"' in text or '"function"' in text


def _parse_json(text: str, allowed: set[str] | None) -> ParsedOutput | None:
    body = text.strip()
    fence = _FENCE.match(body)
    if fence:
        body = fence.group(1).strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        if _looks_like_call(body):
            return ParsedOutput([], "", [f"tool call is not valid JSON ({exc.msg})"], "json")
        return None
    items = obj if isinstance(obj, list) else [obj]
    if not items or not all(isinstance(o, dict) and ("name" in o or "function" in o) for o in items):
        return None  # JSON, but not a function call: an ordinary answer
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, item in enumerate(items):
        got = _call_from_obj(item, json.dumps(item, ensure_ascii=False), allowed)
        if isinstance(got, str):
            errors.append(f"tool call {i + 1}: {got}")
        else:
            calls.append(got)
    return ParsedOutput(calls, "", errors, "json")


def parse_tool_calls(
    text: str, tools: Iterable[str] | Iterable[dict[str, Any]] | None = None
) -> ParsedOutput:
    """Find the tool calls in ``text``; ``tools`` (names or OpenAI tool schemas) limits valid names."""
    items: list[Any] | None = list(tools) if tools is not None else None
    allowed = _names(items)
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    if "<tool_call>" in text:
        result = _parse_hermes(text, allowed, _schemas(items))
    elif PYTHON_TAG in text:
        result = _parse_python_tag(text, allowed)
    elif _LLAMA_FUNCTION.search(text):
        result = _parse_llama_functions(text, allowed)
    else:
        result = (
            _parse_json_lines(text, allowed)
            or _parse_json(text, allowed)
            or ParsedOutput([], text, [], "none")
        )
    for _ in result.calls:
        count_tool_call(result.format, "ok")
    for err in result.errors:
        count_tool_call(result.format, "unknown_tool" if "unknown tool" in err else "malformed")
    return result


def _parse_json_lines(text: str, allowed: set[str] | None) -> ParsedOutput | None:
    """Several JSON calls separated by ``;`` (Llama 3.2 without the python tag)."""
    if ";" not in text:
        return None
    parts = [p.strip() for p in text.strip().split(";") if p.strip()]
    if len(parts) < 2:
        return None
    parsed = [_parse_json(p, allowed) for p in parts]
    if any(p is None or p.format != "json" for p in parsed):
        return None
    calls = [c for p in parsed if p is not None for c in p.calls]
    errors = [e for p in parsed if p is not None for e in p.errors]
    return ParsedOutput(calls, "", errors, "json")


def _schemas(tools: Iterable[Any] | None) -> dict[str, Any]:
    """Parameter schemas by tool name (OpenAI tool schemas), for typing XML parameter values."""
    out: dict[str, Any] = {}
    for t in tools or ():
        if isinstance(t, dict):
            inner = t.get("function")
            fn: dict[str, Any] = inner if isinstance(inner, dict) else t
            if isinstance(fn.get("name"), str) and isinstance(fn.get("parameters"), dict):
                out[fn["name"]] = fn["parameters"]
    return out


def _names(tools: Iterable[Any] | None) -> set[str] | None:
    if tools is None:
        return None
    names: set[str] = set()
    for t in tools:
        if isinstance(t, str):
            names.add(t)
        elif isinstance(t, dict):
            inner = t.get("function")
            fn: dict[str, Any] = inner if isinstance(inner, dict) else t
            if isinstance(fn.get("name"), str):
                names.add(fn["name"])
    return names
