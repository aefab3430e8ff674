"""Does append-only templating give the same IDs as a full re-render of the conversation?

A trainer that re-renders a trajectory from its messages would get the full render; raas gives it the
append-only IDs. Where the two differ (templates that strip past ``<think>``, trim content, re-group
tool results, or tokenize across a boundary differently), the trainer must be told. This module plays a
sample multi-turn tool conversation through :class:`~raas.llm.tokenizer.Conversation` and reports every
point where it differs from ``apply_chat_template`` on the same messages.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from raas.llm.tokenizer import ChatTokenizer, Message

SAMPLE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the sandbox.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "The command."}},
                "required": ["command"],
            },
        },
    }
]


def sample_conversation(thinking: bool = False) -> tuple[list[Message], list[list[Message]], list[str]]:
    """(first messages, new messages after each assistant turn, assistant texts) of a tool dialogue."""
    think = "<think>\nI should look at the files first.\n</think>\n\n" if thinking else ""
    first = [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "user", "content": "How many Python files are in /workspace?"},
    ]
    assistant = [
        think + 'Let me count them.\n<tool_call>\n{"name": "bash", "arguments": {"command": '
        '"ls /workspace/*.py | wc -l"}}\n</tool_call>',
        think + "There are 3 Python files.",
        "You are welcome.",
    ]
    later: list[list[Message]] = [
        [{"role": "tool", "content": "3"}],
        [{"role": "user", "content": "Thanks!"}],
    ]
    return first, later, assistant


@dataclass
class Mismatch:
    """Where append-only IDs and the full re-render first differ after one step."""

    step: int
    after: str
    index: int
    incremental_len: int
    full_len: int
    incremental_text: str
    full_text: str


@dataclass
class TemplateReport:
    ok: bool
    template_name: str
    steps: int
    mismatches: list[Mismatch] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    closing: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, ensure_ascii=False)

    def summary(self) -> str:
        if self.ok:
            return f"OK: append-only == full render at all {self.steps} steps ({self.template_name})"
        lines = [f"DRIFT at {len(self.mismatches)} of {self.steps} steps ({self.template_name}):"]
        for m in self.mismatches:
            lines.append(
                f"  step {m.step} after {m.after}: first difference at token {m.index} "
                f"(append-only {m.incremental_len} ids, full render {m.full_len} ids)"
            )
            lines.append(f"    append-only: {m.incremental_text!r}")
            lines.append(f"    full render: {m.full_text!r}")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def _first_difference(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def check_template(
    tok: ChatTokenizer,
    *,
    server_returns_stop_token: bool = True,
    thinking: bool | None = None,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> TemplateReport:
    """Play the sample conversation append-only and compare with a full render after every step.

    ``server_returns_stop_token`` simulates a server that includes the stop token in its output
    (vLLM, SGLang) or strips it (llama.cpp); both must lead to the same IDs.
    """
    if thinking is None:
        thinking = "<think>" in tok.chat_template
    tools = SAMPLE_TOOLS if tools is None else tools
    first, later, assistant_texts = sample_conversation(thinking)
    conv = tok.conversation(first, tools=tools, **template_kwargs)
    stop = tok.stop_token_ids()
    closing_ids = tok.encode(tok.closing_text("assistant", **template_kwargs))
    mismatches: list[Mismatch] = []
    step = 0

    def compare(after: str, add_generation_prompt: bool) -> None:
        nonlocal step
        step += 1
        full = tok.apply_chat_template(
            conv.messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        if full != conv.ids:
            i = _first_difference(conv.ids, full)
            lo = max(0, i - 8)
            mismatches.append(
                Mismatch(
                    step,
                    after,
                    i,
                    len(conv.ids),
                    len(full),
                    tok.decode(conv.ids[lo : i + 12]),
                    tok.decode(full[lo : i + 12]),
                )
            )

    compare("first prompt", True)
    for turn, text in enumerate(assistant_texts):
        sampled = tok.encode(text)
        if server_returns_stop_token and closing_ids:
            sampled = sampled + closing_ids[:1]
        conv.add_assistant(sampled)
        last = turn == len(assistant_texts) - 1
        compare(f"assistant turn {turn + 1}", False)
        if not last:
            conv.add_messages(later[turn])
            compare(f"{later[turn][0]['role']} message after turn {turn + 1}", True)
    return TemplateReport(
        ok=not mismatches,
        template_name=tok.name,
        steps=step,
        mismatches=mismatches,
        notes=list(conv.notes),
        stop_token_ids=stop,
        closing=tok.closing_text("assistant", **template_kwargs),
    )
