"""The agent's tools: their JSON schemas (shown to the policy) and their dispatch to a sandbox's tool client.

A tool failure the policy caused or can react to (bad arguments, a failing command, a command that ran past
its own timeout, a missing kernel) becomes an *observation* the policy reads; failures of the infrastructure
itself (the sandbox died, its tool server stopped answering) propagate as :class:`~raas.errors.RaasError` so
the job is filtered. Which is which is :func:`raas.errors.is_infrastructure`'s call, not this module's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raas.core.metrics import observe_tool
from raas.errors import RaasError, is_infrastructure

if TYPE_CHECKING:
    from raas.sandbox import Sandbox
    from raas.sandbox.models import BashResult, IPythonResult

TERMINAL_TOOLS = frozenset({"finish", "submit"})

_EDITOR_COMMANDS = ["view", "create", "str_replace", "insert", "undo_edit"]

SCHEMAS: dict[str, dict[str, Any]] = {
    "bash": {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a bash command in a persistent shell in the sandbox and return its output. "
            "A command that waits for keyboard input returns early and keeps running: call bash again "
            "with is_input=true to type into it.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command to run."},
                    "timeout": {
                        "type": "number",
                        "description": "Seconds before the command is interrupted.",
                    },
                    "is_input": {
                        "type": "boolean",
                        "description": "Send `command` as input to the program still running in the shell "
                        '(include "\\n" for Enter; "C-c", "C-d" or "C-z" send those keys) instead of '
                        "running it as a new command.",
                    },
                },
                "required": ["command"],
            },
        },
    },
    "ipython": {
        "type": "function",
        "function": {
            "name": "ipython",
            "description": "Run Python code in a persistent IPython kernel; returns stdout, the value of "
            "the last expression and any error.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "Python code to execute."}},
                "required": ["code"],
            },
        },
    },
    "str_replace_editor": {
        "type": "function",
        "function": {
            "name": "str_replace_editor",
            "description": "View, create and edit files: view a file or directory, create a file, replace "
            "an exact unique string, insert text after a line, or undo the last edit.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "enum": _EDITOR_COMMANDS},
                    "path": {"type": "string", "description": "Absolute path of the file or directory."},
                    "file_text": {"type": "string", "description": "Content for `create`."},
                    "old_str": {"type": "string", "description": "Exact text to replace (`str_replace`)."},
                    "new_str": {"type": "string", "description": "Replacement or inserted text."},
                    "insert_line": {"type": "integer", "description": "Insert after this line (`insert`)."},
                    "view_range": {
                        "type": "array",
                        "items": {"type": "integer"},
                        "description": "[start, end] lines for `view`; end -1 means to the end.",
                    },
                },
                "required": ["command", "path"],
            },
        },
    },
    "finish": {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "Submit the final answer and end the task.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "The final answer."}},
                "required": ["answer"],
            },
        },
    },
    "submit": {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Declare the task done (the sandbox's current state is what gets evaluated).",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "An optional final answer."}},
                "required": [],
            },
        },
    },
}

_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "array": (list,),
    "object": (dict,),
    "boolean": (bool,),
}


@dataclass
class Observation:
    """What the policy reads back from one tool call."""

    text: str
    is_error: bool = False
    kind: str | None = None
    """The error kind when ``is_error`` (``bad_arguments``, ``unknown_tool``, ``tool_error``, ...)."""


def truncate(text: str, cap_bytes: int) -> str:
    """Keep the head and tail of ``text`` within ``cap_bytes`` UTF-8 bytes, marking what was cut."""
    raw = text.encode("utf-8", errors="replace")
    if len(raw) <= cap_bytes:
        return text
    half = max(cap_bytes // 2, 1)
    cut = len(raw) - 2 * half
    head = raw[:half].decode("utf-8", errors="ignore")
    tail = raw[-half:].decode("utf-8", errors="ignore")
    return f"{head}\n[... {cut} bytes truncated ...]\n{tail}"


def validate_arguments(name: str, arguments: Mapping[str, Any]) -> str | None:
    """A message naming what is wrong with ``arguments`` for tool ``name``, or None when they fit its schema."""
    schema = SCHEMAS[name]["function"]["parameters"]
    props: dict[str, Any] = schema["properties"]
    missing = [k for k in schema.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)} for {name}"
    unknown = [k for k in arguments if k not in props]
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)} for {name} (allowed: {', '.join(props)})"
    for key, value in arguments.items():
        expected = props[key].get("type")
        types = _TYPES.get(expected or "", ())
        if value is None:
            continue
        if types and (
            not isinstance(value, types) or (expected in ("number", "integer") and isinstance(value, bool))
        ):
            return f"argument {key!r} of {name} must be of type {expected}, got {type(value).__name__}"
        enum = props[key].get("enum")
        if enum and value not in enum:
            return f"argument {key!r} of {name} must be one of {', '.join(enum)}"
    return None


def _format_bash(r: BashResult) -> str:
    out = r.output.rstrip("\n")
    notes = []
    if r.timed_out:
        notes.append("the command timed out and was interrupted")
    if r.restarted:
        notes.append("the shell was restarted")
    if r.waiting_for_input:
        notes.append(
            "the command is still running and waits for input: call bash with is_input=true to type "
            'into it (e.g. "y\\n"), or "C-c" to interrupt it'
        )
    tail = f"\n[exit code {r.exit_code}]" if r.exit_code is not None else ""
    if notes:
        tail += "\n[" + "; ".join(notes) + "]"
    return (out if out else "(no output)") + tail


def _format_ipython(r: IPythonResult) -> str:
    parts = [text.rstrip("\n") for text in (r.stdout, r.stderr) if text]
    if r.result not in (None, ""):
        parts.append(f"Out: {r.result}")
    if r.error is not None:
        parts.append(f"{r.error.ename}: {r.error.evalue}")
    if r.images:
        parts.append(f"[{len(r.images)} image(s) produced]")
    if r.timed_out:
        parts.append("[execution timed out and was interrupted]")
    if r.restarted:
        parts.append("[the kernel was restarted]")
    return "\n".join(parts) if parts else "(no output)"


class ToolSet:
    """A named subset of the tools: the schemas passed to the chat template and the dispatcher."""

    def __init__(self, names: Iterable[str]) -> None:
        names = list(names)
        unknown = [n for n in names if n not in SCHEMAS]
        if unknown:
            raise RaasError(f"unknown tool(s): {', '.join(unknown)}", kind="bad_request")
        self.names = names

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [SCHEMAS[n] for n in self.names]

    def is_terminal(self, name: str) -> bool:
        return name in TERMINAL_TOOLS and name in self.names

    def check(self, name: str, arguments: Mapping[str, Any]) -> Observation | None:
        """An error observation when the call cannot be dispatched as written; None when it can."""
        if name not in self.names:
            return Observation(
                f"Error: unknown tool {name!r}. Available tools: {', '.join(self.names)}.",
                is_error=True,
                kind="unknown_tool",
            )
        problem = validate_arguments(name, arguments)
        if problem:
            return Observation(f"Error: {problem}.", is_error=True, kind="bad_arguments")
        return None

    async def dispatch(
        self, sandbox: Sandbox, name: str, arguments: Mapping[str, Any], *, timeout_s: float, cap_bytes: int
    ) -> Observation:
        """Run one (already checked) call in ``sandbox``; policy-level failures become observations.

        Every call that reaches the sandbox is recorded in ``raas_tool_latency_seconds`` (``ok`` is false
        when it came back as an error or raised), so operators see tool latency per tool."""
        bad = self.check(name, arguments)
        if bad is not None:
            return bad
        if name in TERMINAL_TOOLS:  # the loop ends the run on these; nothing runs in the sandbox
            return Observation(f"Error: {name} cannot be dispatched", is_error=True, kind="unknown_tool")
        started = time.monotonic()
        try:
            obs = await self._run(sandbox, name, arguments, timeout_s=timeout_s, cap_bytes=cap_bytes)
        except BaseException:
            observe_tool(name, time.monotonic() - started, ok=False)
            raise
        observe_tool(name, time.monotonic() - started, ok=not obs.is_error)
        return obs

    async def _run(
        self, sandbox: Sandbox, name: str, arguments: Mapping[str, Any], *, timeout_s: float, cap_bytes: int
    ) -> Observation:
        try:
            if name == "bash":
                timeout = arguments.get("timeout")
                t = min(float(timeout), timeout_s) if timeout else timeout_s
                if arguments.get("is_input"):
                    result = await sandbox.tools.bash_send(str(arguments["command"]), timeout=t)
                else:
                    result = await sandbox.tools.bash(str(arguments["command"]), timeout=t)
                text = _format_bash(result)
            elif name == "ipython":
                text = _format_ipython(await sandbox.tools.ipython(str(arguments["code"]), timeout=timeout_s))
            elif name == "str_replace_editor":
                extra = {k: v for k, v in arguments.items() if k not in ("command", "path") and v is not None}
                r = await sandbox.tools.editor(str(arguments["command"]), str(arguments["path"]), **extra)
                text = r.output or "(no output)"
            else:
                raise RaasError(f"tool {name} has no dispatcher", kind="internal")
        except RaasError as e:
            if is_infrastructure(e.kind):
                raise
            return Observation(
                truncate(f"Error ({e.kind}): {e.message}", cap_bytes), is_error=True, kind=e.kind
            )
        return Observation(truncate(text, cap_bytes))
