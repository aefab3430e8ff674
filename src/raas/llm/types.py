"""Value types shared by the LLM layer: sampling parameters, generate results, typed errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raas.errors import RaasError


class ContextWindowExceeded(RaasError):
    """The prompt leaves no room to generate within the server's context window."""

    kind = "context_window_exceeded"


class LLMUnavailable(RaasError):
    """No healthy server could serve the request (connection errors, 5xx, all servers down)."""

    kind = "llm_unavailable"


class LLMTimeout(RaasError):
    """A server accepted the request but did not answer within the request timeout. Not the job's own
    budget (kind ``timeout``): the job fails and is filtered; the server is not failed over, since a slow
    server retried elsewhere only doubles the load."""

    kind = "llm_timeout"


class LLMError(RaasError):
    """The server refused the request or answered something raas cannot read."""

    kind = "llm_error"


class SamplingParams(BaseModel):
    """Sampling for one generate call. The defaults never truncate the distribution (RL needs the
    policy's own distribution): no top-k, no top-p, no min-p, no repetition penalty."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    repetition_penalty: float = Field(1.0, gt=0.0)

    @classmethod
    def parse(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Validate user input, reporting a ``bad_request`` instead of a pydantic error."""
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            raise RaasError(f"invalid sampling params: {exc.errors()[0]['msg']}", kind="bad_request") from exc


@dataclass
class GenerateResult:
    """What one generate call produced: exactly the sampled IDs and their logprobs.

    ``logprobs[i]`` is ``None`` exactly where the server did not report one, for every server kind (never
    an invented 0.0). llama.cpp reports a single probability for the byte tokens that together make one
    multi-byte character (the last of them), and none for bytes of a character cut off by ``max_tokens``;
    vLLM and SGLang normally report every token, and a ``null`` they send stays ``None``.
    """

    output_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str  # "stop" | "length" | "abort"
    server: str = ""
    weight_version: str | None = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    kind: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ServerInfo:
    """What raas learned about a server when it first talked to it."""

    kind: str
    model: str | None = None
    context_length: int | None = None
