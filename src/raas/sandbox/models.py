"""Typed results of tool calls, as the host-side :class:`raas.sandbox.client.ToolClient` returns them.

Their fields mirror the result fields declared per op in :mod:`raas.toolserver.ops`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Result(BaseModel):
    # Newer servers may add fields; older clients keep working.
    model_config = ConfigDict(extra="ignore")


class BashResult(_Result):
    """One ``bash.run``: cleaned, capped output plus what happened to the command and the session."""

    output: str
    exit_code: int | None = None
    timed_out: bool = False
    interrupted: bool = False
    restarted: bool = False
    truncated: bool = False
    waiting_for_input: bool = False
    """The command is still running and blocked reading the terminal: give it input with
    :meth:`~raas.sandbox.client.ToolClient.bash_send` (or interrupt it); ``exit_code`` is None."""
    cwd: str = ""
    session: str = "default"


class BashSessionInfo(_Result):
    session: str
    alive: bool
    busy: bool
    cwd: str
    pid: int


class IPythonError(_Result):
    ename: str
    evalue: str
    traceback: list[str] = Field(default_factory=list)


class IPythonResult(_Result):
    """One ``ipython.run``: streams, the result repr, an error (if raised), PNG images as base64."""

    stdout: str = ""
    stderr: str = ""
    result: str | None = None
    error: IPythonError | None = None
    images: list[str] = Field(default_factory=list)
    timed_out: bool = False
    restarted: bool = False


class EditorResult(_Result):
    output: str


class ServerInfo(_Result):
    """The ``server.ping`` handshake."""

    version: int
    pid: int
    python: str
    sandbox_id: str | None = None
    tools: dict[str, bool]


RESULT_MODELS: dict[tuple[str, str], type[_Result]] = {
    ("server", "ping"): ServerInfo,
    ("bash", "run"): BashResult,
    ("bash", "send"): BashResult,
    ("ipython", "run"): IPythonResult,
    ("editor", "run"): EditorResult,
}
"""The typed result of each op that has one. The fields are those the op declares in
:mod:`raas.toolserver.ops` (a test holds the two together); other ops' results are read by name."""
