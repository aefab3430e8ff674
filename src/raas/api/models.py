"""Request and response bodies of the native API that are not pipeline records themselves."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from raas.core.jobs import JobRequest, SubmitResponse

HTTP_URL_PATTERN = r"^\s*https?://[^\s/]"
"""An inference server's base URL as the API accepts it (a trailing ``/`` or ``/v1`` is fine)."""


class JobSubmission(JobRequest):
    """A job as the API takes it: :class:`JobRequest`, with the schema saying what its validator demands
    (``instance.data_source``, the task handler's name; when absent, the one the instance's fields imply,
    as ``raas run`` infers it for a dataset file)."""

    instance: dict[str, Any] = Field(
        description=(
            "The task instance; data_source names its task handler (when absent it is inferred from the "
            "fields: SWE-bench/SWE-Gym -> swebench, R2E-Gym -> r2e, test cases -> code, question+answer -> "
            "stem, problem+answer -> math)"
        ),
        json_schema_extra={"properties": {"data_source": {"type": "string", "minLength": 1}}},
    )


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jobs: list[JobSubmission] = Field(
        min_length=1, description="All or nothing; at most max_batch_jobs (default 1024) jobs"
    )


class BatchResponse(BaseModel):
    jobs: list[SubmitResponse]


class AddServerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str = Field(
        max_length=2048, pattern=HTTP_URL_PATTERN, description="Base URL; a trailing /v1 is accepted"
    )
    weight_version: str | None = Field(None, max_length=256)
    kind: str = Field("auto", max_length=32, description="auto | vllm | sglang | llamacpp")


class ServersResponse(BaseModel):
    servers: list[dict[str, Any]]


class StageStatus(BaseModel):
    queued: int
    active: int
    workers: int


class StatusResponse(BaseModel):
    """Service state. ``status``/``pending_jobs`` are the ProRL server's fields (``running`` once started
    through ``/start``, else ``stopped``); the rest is raas's own view (a cluster router adds ``nodes`` and
    ``unassigned``)."""

    model_config = ConfigDict(extra="allow")

    status: str
    pending_jobs: int
    accepting: bool
    pending: int
    max_pending: int
    stages: dict[str, StageStatus]
    finished: dict[str, int]
    llm_servers: list[dict[str, Any]]
    llm_available: bool
    llm_paused: bool
    warm_pools: dict[str, Any] = Field(
        default_factory=dict,
        description="Warm sandbox pools: settings, and per pool idle/starting/target and claim counters",
    )


class OkResponse(BaseModel):
    ok: bool = True
    detail: str | None = None


class ErrorDetail(BaseModel):
    stage: str | None = Field(description="Where it failed: api, queue, init, run or eval")
    kind: str = Field(description="What failed, e.g. bad_request, not_found, payload_too_large, overloaded")
    message: str


class FieldError(BaseModel):
    loc: list[str] = Field(description="Path to the offending field")
    msg: str
    type: str


class ErrorBody(BaseModel):
    """Every error response of the API. ``error`` is the typed failure; ``detail`` repeats its message
    (FastAPI's and the ProRL server's field, which their clients read)."""

    detail: str
    error: ErrorDetail
    errors: list[FieldError] | None = Field(None, description="Per-field problems (422 only)")


class ProcessFailure(BaseModel):
    """An error answer of ProRL's ``/process``: an :class:`ErrorBody`, or — when the job ran but was
    stopped or timed out — the job's result in the ProRL layout with ``detail`` saying what happened."""

    model_config = ConfigDict(extra="allow")

    detail: str


ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Bad request",
    401: "Missing or wrong bearer token",
    404: "Not found",
    408: "The request body did not arrive in time (http_body_timeout_s)",
    413: "Too large: the body, a batch or an instance is over its limit",
    422: "The request does not match the schema",
    429: "Full; retry after Retry-After seconds",
    500: "Internal error",
    503: "Unavailable (shutting down, no LLM layer, or too many connections)",
    504: "Timed out",
}

BODY_ERRORS = (400, 408, 413, 422)
"""What any route that reads a body may answer, before the route itself runs."""


def error_responses(*codes: int, **descriptions: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for ``codes``, each an :class:`ErrorBody`; ``descriptions`` (``_404="..."``)
    replace the generic text."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        text = descriptions.get(f"_{code}", ERROR_DESCRIPTIONS[code])
        out[code] = {"model": ErrorBody, "description": text}
    return out
