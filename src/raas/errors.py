"""Typed errors shared by every layer.

A failure anywhere in raas is reported as ``(stage, kind, message)`` so a trainer can tell an
infrastructure failure (filter the trajectory) from a policy failure (reward it). ``kind`` is one of
:data:`ErrorKind`; it is a plain string on the wire.
"""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal[
    # request / input problems
    "bad_request",
    "not_found",
    "payload_too_large",
    "unauthorized",
    # service state
    "overloaded",
    "unavailable",
    # sandbox and tool problems
    "sandbox_start_failed",
    "sandbox_dead",
    "tool_timeout",
    "tool_unavailable",
    "tool_error",
    # inference problems
    "llm_unavailable",
    "llm_error",
    "context_window_exceeded",
    # job lifecycle
    "timeout",
    "cancelled",
    "interrupted",
    "handler_error",
    "internal",
]

Stage = Literal["queue", "init", "run", "eval", "api"]


class RaasError(Exception):
    """Base class of every error raas raises on purpose; carries a typed ``kind``."""

    kind: str = "internal"

    def __init__(self, message: str, *, kind: str | None = None, stage: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind
        self.stage = stage

    def to_dict(self) -> dict[str, str | None]:
        return {"stage": self.stage, "kind": self.kind, "message": self.message}
