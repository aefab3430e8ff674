"""A compact tool scaffold for small policies: view, search, replace, run the tests (and ``submit``).

Why: a 135M-parameter policy given the general tools (``bash``, ``str_replace_editor``: long schemas,
absolute paths, verbose outputs) made no tool call at all on tiny bug-fix tasks. These tools take short
arguments (paths relative to the sandbox's workdir), answer in a few lines, and are described in one line
each by the task's own prompt (:data:`TOOL_LINES`), so the whole prompt stays a few hundred tokens. They
run only through the sandbox's tool server (file reads and writes, a bash command), like every tool.

* ``view {"path"}``: the file with line numbers (at most :data:`VIEW_MAX_LINES` lines, then a note);
* ``search {"text"}``: lines of the repository's Python files containing ``text`` (fixed string);
* ``replace {"path", "old", "new"}``: replace the one exact occurrence of ``old`` (an error observation
  says when it is missing or not unique); answers with the changed lines, numbered;
* ``run_tests {}``: the repository's visible tests (``pytest -q``), the last lines of their output.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from raas.agent.tools import HostTool, Observation, truncate
from raas.errors import RaasError, is_infrastructure
from raas.toolserver import ops
from raas.toolserver.ops import Arg, PolicyTool

if TYPE_CHECKING:
    from raas.sandbox import Sandbox

VIEW_MAX_LINES = 200
SEARCH_MAX_LINES = 20
TEST_TAIL_LINES = 15

TOOL_LINES: dict[str, str] = {
    "view": "view(path): show a file with line numbers",
    "search": "search(text): find the lines of the code that contain text",
    "replace": "replace(path, old, new): replace the exact text old with new in a file",
    "run_tests": "run_tests(): run the repository's tests",
    "submit": "submit(): finish; your changes are then tested",
}
"""How a scaffold prompt describes each tool (one line each)."""


def describe_tools(names: list[str], *, detailed: bool = True) -> str:
    """The tool list a scaffold prompt shows, in ``names`` order: one line per tool, or (``detailed``
    False) only their signatures on one line, e.g. ``view(path), submit()``."""
    if not detailed:
        return ", ".join(TOOL_LINES[n].split(":", 1)[0] for n in names)
    return "\n".join(f"- {TOOL_LINES[n]}" for n in names)


def _path(sandbox: Sandbox, path: str) -> str:
    return posixpath.normpath(posixpath.join(sandbox.workdir_inside(), path))


def _shown(sandbox: Sandbox, path: str) -> str:
    """``path`` relative to the workdir when inside it (as the policy would name it), else absolute."""
    workdir = sandbox.workdir_inside()
    full = _path(sandbox, path)
    rel = posixpath.relpath(full, workdir)
    return full if rel.startswith("..") else rel


def numbered(lines: list[str], first: int = 1) -> str:
    width = len(str(first + len(lines) - 1))
    return "\n".join(f"{i:>{width}}  {line}" for i, line in enumerate(lines, first))


async def _read_text(sandbox: Sandbox, path: str) -> str | Observation:
    """The file's text, or an error observation saying why not (a missing file, a directory, binary)."""
    try:
        raw = await sandbox.tools.read_file(_path(sandbox, path))
    except RaasError as e:
        if is_infrastructure(e.kind):
            raise
        return Observation(f"Error: cannot read {_shown(sandbox, path)}: no such file", True, "tool_error")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return Observation(f"Error: {_shown(sandbox, path)} is not a text file", True, "tool_error")


class _View:
    tool: ClassVar[PolicyTool] = PolicyTool(
        "view",
        TOOL_LINES["view"],
        extra=(Arg("path", ops.STR, required=True, description="File path, relative to the repository."),),
    )

    async def run(
        self, sandbox: Sandbox, arguments: Mapping[str, Any], *, timeout_s: float, cap_bytes: int
    ) -> Observation:
        text = await _read_text(sandbox, str(arguments["path"]))
        if isinstance(text, Observation):
            return text
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        body = numbered(lines[:VIEW_MAX_LINES])
        if len(lines) > VIEW_MAX_LINES:
            body += f"\n[{len(lines) - VIEW_MAX_LINES} more lines not shown]"
        return Observation(truncate(body or "(empty file)", cap_bytes))


class _Search:
    tool: ClassVar[PolicyTool] = PolicyTool(
        "search",
        TOOL_LINES["search"],
        extra=(Arg("text", ops.STR, required=True, description="The text to look for."),),
    )

    async def run(
        self, sandbox: Sandbox, arguments: Mapping[str, Any], *, timeout_s: float, cap_bytes: int
    ) -> Observation:
        text = str(arguments["text"])
        if not text or "\n" in text:
            return Observation("Error: text must be one non-empty line", True, "bad_arguments")
        command = (
            f"cd {shlex.quote(sandbox.workdir_inside())} && grep -rnF --include='*.py' -e {shlex.quote(text)} . "
            f"2>/dev/null | sed 's|^\\./||' | head -n {SEARCH_MAX_LINES}"
        )
        res = await sandbox.tools.bash(command, timeout=min(timeout_s, 30.0))
        out = res.output.strip("\n")
        return Observation(truncate(out or f"No line contains {text!r}.", cap_bytes))


class _Replace:
    tool: ClassVar[PolicyTool] = PolicyTool(
        "replace",
        TOOL_LINES["replace"],
        extra=(
            Arg("path", ops.STR, required=True, description="File path, relative to the repository."),
            Arg("old", ops.STR, required=True, description="Exact text to replace; it must occur once."),
            Arg("new", ops.STR, required=True, description="The replacement text."),
        ),
    )

    async def run(
        self, sandbox: Sandbox, arguments: Mapping[str, Any], *, timeout_s: float, cap_bytes: int
    ) -> Observation:
        path, old, new = str(arguments["path"]), str(arguments["old"]), str(arguments["new"])
        if not old:
            return Observation("Error: old must not be empty", True, "bad_arguments")
        text = await _read_text(sandbox, path)
        if isinstance(text, Observation):
            return text
        count = text.count(old)
        shown = _shown(sandbox, path)
        if count == 0:
            return Observation(
                f"Error: the text {old!r} is not in {shown}; nothing changed", True, "tool_error"
            )
        if count > 1:
            return Observation(
                f"Error: the text {old!r} occurs {count} times in {shown}; give more of the line so it "
                "occurs once. Nothing changed",
                True,
                "tool_error",
            )
        at = text.index(old)
        updated = text[:at] + new + text[at + len(old) :]
        await sandbox.tools.write_file(_path(sandbox, path), updated.encode("utf-8"))
        first = text.count("\n", 0, at) + 1
        lines = updated.split("\n")[first - 1 : first + new.count("\n")]
        return Observation(truncate(f"Replaced. {shown} now reads:\n{numbered(lines, first)}", cap_bytes))


class _RunTests:
    tool: ClassVar[PolicyTool] = PolicyTool("run_tests", TOOL_LINES["run_tests"])

    async def run(
        self, sandbox: Sandbox, arguments: Mapping[str, Any], *, timeout_s: float, cap_bytes: int
    ) -> Observation:
        command = (
            f"cd {shlex.quote(sandbox.workdir_inside())} && python3 -B -m pytest -q -p no:cacheprovider "
            f"--no-header -rN 2>&1 | tail -n {TEST_TAIL_LINES}"
        )
        res = await sandbox.tools.bash(command, timeout=timeout_s)
        out = res.output.strip("\n") or "(no output)"
        if res.timed_out:
            out += "\n[the tests timed out and were stopped]"
        return Observation(truncate(out, cap_bytes))


SCAFFOLD_TOOLS: dict[str, HostTool] = {t.tool.name: t for t in (_View(), _Search(), _Replace(), _RunTests())}
"""The host tools of this scaffold by name (``ToolSet(names, host_tools=SCAFFOLD_TOOLS)``)."""
