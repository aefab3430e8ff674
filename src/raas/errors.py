"""Typed errors shared by every layer, and the one classification of failures.

A failure anywhere in raas is reported as ``(stage, kind, message)`` so a trainer can tell an
infrastructure failure (filter the trajectory) from a policy failure (reward it). ``kind`` is one of
:data:`ErrorKind`; it is a plain string on the wire.

Which kinds the policy may see is decided here and nowhere else: a tool failure whose kind is in
:data:`OBSERVATION_KINDS` (the policy's own doing, such as a bad argument or a failing edit) becomes an
observation the policy reads; every other kind (:func:`is_infrastructure`) ends the rollout, which is then
filtered: never scored, never shown to the policy. A kind this module does not know is infrastructure.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Literal, get_args

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
    "llm_timeout",
    "context_window_exceeded",
    # evaluation problems
    "verifier_timeout",
    "eval_error",
    # job lifecycle
    "timeout",
    "cancelled",
    "interrupted",
    "handler_error",
    "token_mismatch",
    "internal",
]
"""``timeout`` is only the job's own budget (job status ``timeout``); an inference server that does not
answer in time is ``llm_timeout`` and a verifier that does not finish is ``verifier_timeout`` (both job
status ``failed``). ``eval_error`` is an evaluation harness that broke (a test environment that cannot run
the tests, a hidden test patch that does not apply): never the policy's doing, so never a reward of 0.
``tool_timeout`` is a sandbox whose tool server stopped answering (not a command that ran past its own
limit: that is an ordinary result with ``timed_out``)."""

Stage = Literal["queue", "init", "run", "eval", "api"]

ALL_KINDS: frozenset[str] = frozenset(get_args(ErrorKind))

OBSERVATION_KINDS: frozenset[str] = frozenset(
    {"bad_request", "not_found", "payload_too_large", "tool_error", "tool_unavailable"}
)
"""Tool-call failures the policy caused or can react to (a bad argument, a missing file, an output too
large, a failing edit, a tool the image lacks): shown to the policy as the call's observation."""

INFRA_KINDS: frozenset[str] = ALL_KINDS - OBSERVATION_KINDS
"""Everything else: the environment, the inference servers, the verifier or raas itself failed, or the
job was stopped. Such a failure ends the rollout; the result is filtered and carries no reward."""


def is_infrastructure(kind: str) -> bool:
    """True when a failure of ``kind`` must end the rollout rather than be shown to the policy
    (unknown kinds included: when in doubt, never train on it)."""
    return kind not in OBSERVATION_KINDS


class RaasError(Exception):
    """Base class of every error raas raises on purpose; carries a typed ``kind``."""

    kind: str = "internal"

    def __init__(self, message: str, *, kind: str | None = None, stage: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if kind is not None:
            self.kind = kind
        self.stage = stage

    @property
    def infrastructure(self) -> bool:
        """See :func:`is_infrastructure`."""
        return is_infrastructure(self.kind)

    def to_dict(self) -> dict[str, str | None]:
        return {"stage": self.stage, "kind": self.kind, "message": self.message}


def error_body(kind: str, message: str, stage: str | None = "api") -> dict[str, Any]:
    """The HTTP API's one error body (``ErrorBody`` in its OpenAPI schema): ``{"detail": message, "error":
    {stage, kind, message}}``. Here, at the bottom, so the agent gateway answers its routing errors in the
    same shape as the API that mounts it."""
    return {"detail": message, "error": {"stage": stage, "kind": kind, "message": message}}


def route_error(status: int, method: str, path: str, detail: str, allowed: str | None = None) -> str:
    """A routing error's message: what was asked and what exists, instead of Starlette's bare "Not Found" /
    "Method Not Allowed" (a ``detail`` a route chose itself is kept)."""
    try:
        default = detail == HTTPStatus(status).phrase
    except ValueError:
        default = False
    if not default:
        return detail
    if status == 404:
        return f"not found: no route {method} {path}"
    if status == 405:
        return f"method not allowed: {method} {path}" + (f" (allowed: {allowed})" if allowed else "")
    return detail
