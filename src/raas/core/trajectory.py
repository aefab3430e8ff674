"""The token-exact record of one rollout, as the trainer receives it.

Token IDs are canonical: ``messages`` are a readable view, ``turns`` keep every LLM call's exact IDs and
logprobs, and ``token_trajectory`` flattens them into prompt/response/loss-mask form for training.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class ToolCall(BaseModel):
    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Message(BaseModel):
    """One chat message plus the tokens it contributed to the sequence.

    ``input_ids`` are the prompt tokens added right before this message was generated or appended
    (template boundaries, the message itself for non-assistant roles); ``output_ids``/``logprobs`` are
    the sampled tokens of an assistant message. Concatenating ``input_ids + output_ids`` over all
    messages in order reproduces the exact token sequence.
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    input_ids: list[int] = Field(default_factory=list)
    output_ids: list[int] | None = None
    logprobs: list[float | None] | None = None


class Turn(BaseModel):
    """One LLM call."""

    index: int
    prompt_ids: list[int]
    """Tokens added to the prompt since the previous turn's prompt + output (the full prompt for turn 0)."""
    prompt_is_delta: bool
    prompt_len: int
    """Total prompt length sent for this turn."""
    output_ids: list[int]
    logprobs: list[float | None]
    """``None`` where the server reported no logprob (llama.cpp: all but the last byte token of a
    multi-byte character); vLLM and SGLang report every token."""
    finish_reason: str
    weight_version: str | None = None
    server: str | None = None
    latency_s: float = 0.0
    segment: int = 0
    """Which token sequence of the rollout this call extends (see ``RunOutput.segments``); a turn that
    starts a new one has ``prompt_is_delta`` false and its full prompt in ``prompt_ids``."""


class TokenTrajectory(BaseModel):
    """Flattened training view: ``prompt_ids`` then ``response_ids``.

    ``loss_mask[i]`` is 1 where ``response_ids[i]`` was sampled by the policy and 0 where the environment or
    the chat template added it; ``logprobs[i]`` is the sampling logprob (0.0 where the mask is 0, ``None``
    where the mask is 1 but the server reported no logprob for that token — recompute it in the trainer).
    """

    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float | None] = Field(default_factory=list)


FinishReason = Literal[
    "finish_tool", "no_tool_call", "max_turns", "context_budget", "loop_detected", "length", "error"
]


class RunOutput(BaseModel):
    """What a handler's RUN stage produces."""

    messages: list[Message] = Field(default_factory=list)
    turns: list[Turn] = Field(default_factory=list)
    token_trajectory: TokenTrajectory = Field(default_factory=TokenTrajectory)
    segments: list[TokenTrajectory] = Field(default_factory=list)
    """Empty when the rollout is one token sequence (``token_trajectory``). When it is several (an agent
    behind the gateway rewrote its history, ran a sub-agent, summarized), every sequence in order, each
    token-exact on its own; ``token_trajectory`` is then the last of them."""
    finish_reason: FinishReason | str = "error"
    answer: str | None = None
    artifacts: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)


class EvalOutput(BaseModel):
    """What a handler's EVAL stage produces. ``reward`` is None only if evaluation could not run."""

    reward: float | None
    resolved: bool | None = None
    artifacts: dict[str, Any] = Field(default_factory=dict)
    details: dict[str, Any] = Field(default_factory=dict)
