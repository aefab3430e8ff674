"""Knobs of the multi-turn agent loop, set per service and overridable per job."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class AgentConfig(BaseModel):
    max_turns: int = Field(8, ge=1, le=1000)
    max_tokens_per_turn: int = Field(512, ge=1)
    context_budget: int = Field(8192, ge=64, description="Total prompt + response tokens per trajectory.")
    stop_on_no_tool_call: bool = True
    loop_detection_repeats: int = Field(
        3, ge=2, description="Stop when the same call repeats this many times."
    )
    observation_cap_bytes: int = Field(8000, ge=256)
    tool_timeout_s: float = Field(30.0, gt=0)
    system_prompt: str | None = None


AGENT_ALIASES: dict[str, str] = {"max_iterations": "max_turns"}
"""Other clients' names for :class:`AgentConfig` fields in ``sampling_params`` (ProRL's turn limit is
``max_iterations``). The field's own name wins when a job sends both."""


def agent_overrides(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """The :class:`AgentConfig` settings a job's ``sampling_params`` carry, aliases resolved."""
    overrides = {k: v for k, v in sampling_params.items() if k in AgentConfig.model_fields}
    for alias, name in AGENT_ALIASES.items():
        if alias in sampling_params and name not in overrides:
            overrides[name] = sampling_params[alias]
    return overrides
