"""The token record of a rollout behind the gateway: segments, turns, and the drift report.

A *segment* is one token sequence that only ever grows: its first request's full prompt, then per turn
the prompt tokens added since (template closing of the previous reply, the new messages, the generation
prompt; loss mask 0) and the sampled tokens (mask 1). A request that extends a segment's messages (or,
after a full render, its tokens) continues it; any other request starts a new segment, and the reason is
recorded. Nothing is ever re-tokenized into an existing segment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from raas.core.trajectory import Message, TokenTrajectory, ToolCall
from raas.gateway.messages import MessageKey, Msg, template_message
from raas.llm.tokenizer import ChatTokenizer, Conversation

DRIFT_PREFIX: tuple[Msg, ...] = ({"role": "system", "content": "S"}, {"role": "user", "content": "U"})


@dataclass
class Segment:
    """One growing token sequence and the messages it holds (see the module docstring)."""

    index: int
    reason: str
    conv: Conversation
    msgs: list[Msg]
    keys: list[MessageKey]
    tools_key: str
    tools: list[dict[str, Any]] | None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    first_prompt_len: int = 0
    turns: list[int] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    busy: bool = False
    replied: bool = False
    """It ends with a reply of ours, so a request may continue it."""
    last_reply: int | None = None
    """Index (into the session's replies) of the reply it ends with."""

    def add_prompt(self, ids: list[int]) -> None:
        if not self.ids:
            self.first_prompt_len = len(ids)
        self.ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([None] * len(ids))

    def add_sampled(self, ids: list[int], logprobs: list[float | None]) -> None:
        self.ids.extend(ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)

    def trajectory(self) -> TokenTrajectory:
        """Prompt = the first request's full prompt; response = everything after, mask 1 on sampled IDs
        (logprob 0.0 where the mask is 0, as everywhere in raas)."""
        n = self.first_prompt_len
        return TokenTrajectory(
            prompt_ids=self.ids[:n],
            response_ids=self.ids[n:],
            loss_mask=self.mask[n:],
            logprobs=[lp if m else 0.0 for lp, m in zip(self.logprobs[n:], self.mask[n:], strict=True)],
        )


@dataclass
class Reply:
    """One sampled reply and what the template closed it with."""

    turn: int
    segment: int
    message: Msg
    output_ids: list[int]
    closing_ids: list[int]
    native_tools: bool
    tools: list[dict[str, Any]] | None
    resent: bool = False


def core_message(msg: Msg, **tokens: Any) -> Message:
    """The readable record of a normalized message."""
    calls = None
    if msg.get("tool_calls"):
        calls = [
            ToolCall(
                id=c["id"] or f"call_{i}",
                name=c["name"],
                arguments=c["arguments"] if isinstance(c["arguments"], dict) else {"_raw": c["arguments"]},
            )
            for i, c in enumerate(msg["tool_calls"])
        ]
    return Message(
        role=msg["role"],
        content=msg.get("content") or "",
        tool_calls=calls,
        tool_call_id=msg.get("tool_call_id"),
        name=msg.get("name"),
        **tokens,
    )


def drift_of(tok: ChatTokenizer, reply: Reply) -> dict[str, Any] | None:
    """How the reply, as the agent re-sent it, re-tokenizes compared with what was sampled (plus the
    template's closing); None when it re-tokenizes to exactly the sampled IDs.

    This is what a proxy that re-renders the history would train on instead of the sampled tokens."""
    base = list(DRIFT_PREFIX)
    head = tok.render(base, tools=reply.tools, add_generation_prompt=True)
    full = tok.render([*base, template_message(reply.message, reply.native_tools)], tools=reply.tools)
    sampled = reply.output_ids + reply.closing_ids
    if not full.startswith(head):
        return {
            "turn": reply.turn,
            "segment": reply.segment,
            "note": "the template renders an assistant turn differently from its generation prompt",
        }
    again = tok.encode(full[len(head) :])
    if again == sampled:
        return None
    at = next(
        (i for i, (a, b) in enumerate(zip(sampled, again, strict=False)) if a != b),
        min(len(sampled), len(again)),
    )
    return {
        "turn": reply.turn,
        "segment": reply.segment,
        "sampled_tokens": len(sampled),
        "retokenized_tokens": len(again),
        "first_difference": at,
        "sampled_text": tok.decode(sampled[at : at + 16]),
        "retokenized_text": tok.decode(again[at : at + 16]),
    }
