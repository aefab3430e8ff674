"""Read tool calls out of a model's sampled text.

Two formats: Hermes/Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (any number per
turn) and a plain JSON function call (the whole reply is ``{"name", "arguments"|"parameters"}``, a list
of them, or the OpenAI ``{"function": {...}}`` shape, optionally in a fenced block). Parsing never
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
    format: str  # "hermes" | "json" | "none"

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


def _parse_hermes(text: str, allowed: set[str] | None) -> ParsedOutput:
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, match in enumerate(_HERMES.finditer(text)):
        body = match.group(1).strip()
        closed = match.group(0).endswith("</tool_call>")
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
    return ParsedOutput(calls, content, errors, "hermes")


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
    allowed = _names(tools)
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    if "<tool_call>" in text:
        result = _parse_hermes(text, allowed)
    else:
        result = _parse_json(text, allowed) or ParsedOutput([], text, [], "none")
    for _ in result.calls:
        count_tool_call(result.format, "ok")
    for err in result.errors:
        count_tool_call(result.format, "unknown_tool" if "unknown tool" in err else "malformed")
    return result


def _names(tools: Iterable[str] | Iterable[dict[str, Any]] | None) -> set[str] | None:
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
