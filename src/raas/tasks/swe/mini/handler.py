"""The ``swe-mini`` task: SWE records served through the SWE handler with a scaffold a small policy can use.

Same INIT, RUN and EVAL as :class:`~raas.tasks.swe.handler.SweHandler` (the repository in a sandbox, the
patch taken from it, hidden tests in a fresh sandbox graded by SWE-bench's code); only the agent differs:

* the compact tools of :mod:`raas.agent.scaffold` (view, search, replace, run_tests, submit), described in
  one line each by the system prompt instead of JSON schemas;
* one demonstrated fix before the issue (:data:`EXAMPLE`, on code in no split), because a tiny policy
  copies a demonstrated tool call far more often than it follows a described one (as on ``lookup``);
* short turns and a small context (:data:`AGENT_DEFAULTS`).

Any SWE record runs with it when its ``data_source`` is ``swe-mini`` (the curriculum's records are,
:mod:`raas.tasks.swe.mini.build`); the same record with ``swebench`` gets the general agent.
"""

from __future__ import annotations

from typing import ClassVar

from raas.agent.scaffold import SCAFFOLD_TOOLS, describe_tools, numbered
from raas.agent.tools import ToolSet
from raas.core.trajectory import Message
from raas.tasks.swe.config import SweConfig
from raas.tasks.swe.handler import SweHandler
from raas.tasks.swe.replay import tool_call

NAME = "swe-mini"
TOOLS = ["view", "search", "replace", "run_tests", "submit"]
SYSTEM_PROMPT = (
    f"You fix bugs in Python code. Tools: {describe_tools(TOOLS, detailed=False)}.\n"
    'Reply with one tool call: <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
)
"""Signatures only (the demonstration shows how they are used): every token of the prompt is paid for
again in every trained row."""
PROMPT_TEMPLATE = "Fix this issue:\n{problem_statement}"

_BUGGY = ["def is_even(n):", "    return n % 2 == 1"]
EXAMPLE: list[Message] = [
    Message(
        role="user",
        content=PROMPT_TEMPLATE.format(
            problem_statement="Bug in `is_even` (file `parity.py`):\n`is_even(4)` returns False, expected True.\n"
        ),
    ),
    Message(role="assistant", content=tool_call("view", path="parity.py")),
    Message(role="tool", name="view", content=numbered(_BUGGY)),
    Message(
        role="assistant",
        content=tool_call("replace", path="parity.py", old="return n % 2 == 1", new="return n % 2 == 0"),
    ),
    Message(
        role="tool",
        name="replace",
        content="Replaced. parity.py now reads:\n" + numbered(["    return n % 2 == 0"], 2),
    ),
    Message(role="assistant", content=tool_call("submit")),
]
"""The demonstrated fix (a module in no split: the curriculum's code never has ``is_even``)."""

AGENT_DEFAULTS: dict[str, int] = {"max_turns": 6, "max_tokens_per_turn": 128, "context_budget": 3072}
"""View, replace, perhaps run the tests, submit, and one retry; a turn is one short tool call."""

EVAL_TIMEOUT_S = 60.0
"""The curriculum's suites run in about a second; a policy's patch can make one loop for ever (seen in RL:
two EVALs held both cores for 10+ minutes under SWE's default 1,800 s limit, starving the policy's server).
Such a patch is graded ``tests_timed_out`` (reward 0) after this long."""

CONFIG = SweConfig(
    tools=TOOLS,
    system_prompt=SYSTEM_PROMPT,
    prompt_template=PROMPT_TEMPLATE,
    test_timeout_s=EVAL_TIMEOUT_S,
)


class SweMiniHandler(SweHandler):
    """See the module docstring."""

    name: ClassVar[str] = NAME
    agent_defaults: ClassVar[dict[str, int]] = AGENT_DEFAULTS
    config: ClassVar[SweConfig | None] = CONFIG

    def tool_set(self) -> ToolSet:
        return ToolSet(self.settings.tools, host_tools=SCAFFOLD_TOOLS, show_schemas=False)

    def examples(self) -> list[Message]:
        return list(EXAMPLE)
