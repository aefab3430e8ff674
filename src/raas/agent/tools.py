"""The agent's tools: their JSON schemas (shown to the policy) and their dispatch to a sandbox's tool client.

The sandbox tools are not described here: their schemas, argument checks and dispatch are derived from the
op declarations in :mod:`raas.toolserver.ops`, which the tool server and the host client read too.

A tool failure the policy caused or can react to (bad arguments, a failing command, a command that ran past
its own timeout, a missing kernel) becomes an *observation* the policy reads; failures of the infrastructure
itself (the sandbox died, its tool server stopped answering) propagate as :class:`~raas.errors.RaasError` so
the job is filtered. Which is which is :func:`raas.errors.is_infrastructure`'s call, not this module's.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from raas.core.metrics import observe_tool
from raas.errors import RaasError, is_infrastructure
from raas.sandbox.models import BashResult, IPythonResult
from raas.toolserver import ops
from raas.toolserver.ops import Arg, PolicyTool

if TYPE_CHECKING:
    from raas.sandbox import Sandbox

TERMINAL_TOOLS = frozenset({"finish", "submit"})

AGENT_TOOLS: dict[str, PolicyTool] = {
    "finish": PolicyTool(
        "finish",
        "Submit the final answer and end the task.",
        extra=(Arg("answer", ops.STR, required=True, description="The final answer."),),
    ),
    "submit": PolicyTool(
        "submit",
        "Declare the task done (the sandbox's current state is what gets evaluated).",
        extra=(Arg("answer", ops.STR, description="An optional final answer."),),
    ),
}
"""Tools the agent loop handles itself (they end the run; nothing runs in the sandbox)."""


def policy_tools() -> dict[str, PolicyTool]:
    """Every tool the policy can be given: the sandbox ones of :data:`raas.toolserver.ops.POLICY_TOOLS`
    (read at call time, so the op declarations stay the only source) and the agent's own."""
    return {**ops.POLICY_TOOLS, **AGENT_TOOLS}


def tool_schema(name: str) -> dict[str, Any]:
    """The function schema the policy sees for tool ``name``, derived from the op declarations."""
    return ops.function_schema(policy_tools()[name])


SCHEMAS: dict[str, dict[str, Any]] = {name: tool_schema(name) for name in policy_tools()}
"""Every tool's schema as of import (see :func:`tool_schema`)."""


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


def validate_arguments(name: str, arguments: Mapping[str, Any], tool: PolicyTool | None = None) -> str | None:
    """A message naming what is wrong with ``arguments`` for tool ``name`` (``tool``: its declaration, when
    it is not one of :func:`policy_tools`), or None when they fit its schema."""
    args = {a.name: a for a in ops.policy_args(tool or policy_tools()[name])}
    missing = [k for k, a in args.items() if a.required and k not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)} for {name}"
    unknown = [k for k in arguments if k not in args]
    if unknown:
        return f"unknown argument(s) {', '.join(unknown)} for {name} (allowed: {', '.join(args)})"
    for key, value in arguments.items():
        if value is None:
            continue
        arg = args[key]
        problem = ops.value_problem(arg, value)
        if problem == "type":
            expected = ops.JSON_TYPES[arg.type]
            return f"argument {key!r} of {name} must be of type {expected}, got {type(value).__name__}"
        if problem is not None:
            return f"argument {key!r} of {name} must be {ops.describe(arg)}"
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


class HostTool(Protocol):
    """A tool whose call raas composes on the host from the sandbox's ops (a task's own scaffold, e.g.
    :mod:`raas.agent.scaffold`): its declaration (``tool``, with ``op`` None and its arguments in
    ``extra``) and what a (checked) call does."""

    @property
    def tool(self) -> PolicyTool: ...

    def run(
        self, sandbox: Sandbox, arguments: Mapping[str, Any], *, timeout_s: float, cap_bytes: int
    ) -> Awaitable[Observation]: ...


class ToolSet:
    """A named subset of the tools: the schemas passed to the chat template and the dispatcher.

    ``host_tools``: tools of a task's own besides :func:`policy_tools` (see :class:`HostTool`).
    ``show_schemas=False``: the chat template is given no schemas (:attr:`schemas` is empty), for a
    scaffold whose prompt describes its tools itself."""

    def __init__(
        self,
        names: Iterable[str],
        *,
        host_tools: Mapping[str, HostTool] | None = None,
        show_schemas: bool = True,
    ) -> None:
        names = list(names)
        host = dict(host_tools or {})
        tools = {**policy_tools(), **{n: h.tool for n, h in host.items()}}
        unknown = [n for n in names if n not in tools]
        if unknown:
            raise RaasError(f"unknown tool(s): {', '.join(unknown)}", kind="bad_request")
        self.names = names
        self._tools = {n: tools[n] for n in names}
        self._host = {n: h for n, h in host.items() if n in names}
        self._all_schemas = [ops.function_schema(tools[n]) for n in names]
        self._schemas = self._all_schemas if show_schemas else []

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """What the chat template renders (empty when the prompt describes the tools itself)."""
        return self._schemas

    @property
    def declared_schemas(self) -> list[dict[str, Any]]:
        """Every tool's schema, shown or not."""
        return self._all_schemas

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
        problem = validate_arguments(name, arguments, self._tools[name])
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
            if name in self._host:
                return await self._host[name].run(
                    sandbox, arguments, timeout_s=timeout_s, cap_bytes=cap_bytes
                )
            tool, op, args = sandbox_call(self._tools[name], arguments, timeout_s)
            result, _ = await sandbox.tools.call(tool, op, args)
            text = _FORMATTERS[(tool, op)](result)
        except RaasError as e:
            if is_infrastructure(e.kind):
                raise
            return Observation(
                truncate(f"Error ({e.kind}): {e.message}", cap_bytes), is_error=True, kind=e.kind
            )
        return Observation(truncate(text, cap_bytes))


def sandbox_call(
    tool: PolicyTool, arguments: Mapping[str, Any], timeout_s: float
) -> tuple[str, str, dict[str, Any]]:
    """The op and its arguments for one (checked) policy call: the arguments the policy sees go through
    unchanged, a ``timeout`` is capped at ``timeout_s`` (and is ``timeout_s`` when the op takes one and
    the policy gave none), and ``bash`` with ``is_input`` types ``command`` into ``bash.send``."""
    if tool.op is None:
        raise RaasError(f"tool {tool.name} has no dispatcher", kind="internal")
    op_tool, op_name = tool.op
    decl = ops.get_op(op_tool, op_name)
    shown = {a.name for a in decl.args if a.policy}
    args = {k: v for k, v in arguments.items() if k in shown and v is not None}
    if decl.arg("timeout") is not None:
        asked = args.get("timeout")
        args["timeout"] = min(float(asked), timeout_s) if asked else timeout_s
    if tool.name == "bash" and arguments.get("is_input"):
        send = ops.get_op("bash", "send")
        op_name = send.name
        args = {("input" if k == "command" else k): v for k, v in args.items()}
        args = {k: v for k, v in args.items() if send.arg(k) is not None}
    return op_tool, op_name, args


def _format_editor(result: dict[str, Any]) -> str:
    return str(result.get("output") or "(no output)")


_FORMATTERS: dict[tuple[str, str], Callable[[dict[str, Any]], str]] = {
    ("bash", "run"): lambda r: _format_bash(BashResult.model_validate(r)),
    ("bash", "send"): lambda r: _format_bash(BashResult.model_validate(r)),
    ("ipython", "run"): lambda r: _format_ipython(IPythonResult.model_validate(r)),
    ("editor", "run"): _format_editor,
}
"""How each op's result reads to the policy."""
